"""Per-rank supervisor: ``python -m popdist_lite_launcher.node.agent -- program args``.

mpirun starts one agent per rank (like torchrun's per-worker agent) on the rank's host.
The agent reads the job's key from its key file and removes the file
(:func:`popdist_lite_launcher.node.keys.take_key`: no process's environment holds the key,
only the file's path), starts the program as its child, tees the child's stderr while keeping its
last lines, forwards SIGTERM/SIGINT, and keeps ONE authenticated TCP connection to the
launcher's collector (``POPRUN_LITE_COLLECTOR``; :class:`Link`, framing and handshake in
:mod:`popdist_lite_launcher.core.channel`) over which it sends records
(:mod:`popdist_lite.records`): ``hello``, a ``heartbeat`` every second, the ``error``
record of its program (the uncaught exception from ``popdist_lite``'s excepthook,
stamped with this agent's identity: anything else the program sends is dropped), and
``exit`` with the exit code or signal and the stderr tail. The same connection carries
the launcher's requests to this agent, checked like every line (a frame of this
connection, a valid record of :data:`records.TO_AGENT
<popdist_lite.records.TO_AGENT>`): :data:`REQUESTS` maps a record kind to its handler
(``signal``: send one of :data:`records.REQUEST_SIGNALS
<popdist_lite.records.REQUEST_SIGNALS>` to the program; ``stack_request``: answer with
the program's Python stacks; ``resize_request``: tell the program, with one byte on its
socket, that the launcher wants it to checkpoint and stop for a resize). The program's
``resize_stop`` record (its replicas agreed to stop for that resize) is relayed like its
``error`` record.

With ``POPRUN_LITE_STALL_INSPECTOR=1`` the agent also gives its program a progress slot
and a stack file on this host (:mod:`popdist_lite_launcher.node.rank_progress`) and sends a
``progress`` record whenever the program enters another collective call (with its
disk tables' counters once it has any).

The program reaches its agent through a host-local socket pair whose descriptor is in
``POPDIST_LITE_RECORD_FD`` (see :func:`popdist_lite.records.send`).

Enrolment before the program: the program's process is created held (:data:`HOLD`: a
shell waiting for one line on the program's socket, so that its pid is known for the
``hello``) and runs the program only after the launcher's welcome, which a job's
collector sends once every rank has enrolled (:class:`popdist_lite_launcher.supervise.collector.Collector`,
``enrolment``) and after which it accepts no hello. Every agent removed its key file
before its hello, so when a program starts no key file of the job is left on any host;
and a key the program could still find (a file whose agent never started) would be
spent. An agent that cannot enrol does not start its program and exits with
:data:`NOT_STARTED`.

With ``POPRUN_LITE_HOLD_SIGNALS`` set (preemption on, :mod:`popdist_lite_launcher.node.hold_signals`)
the agent holds those signals (SIGTERM and the requeue signal): SIGTERM from its parent
(the MPI daemon ending the job), or a SIGINT, stops the program with SIGKILL; a held
signal from anyone else (Slurm signalling the job's steps) becomes a ``signalled``
record naming it, on which the launcher decides (a checkpoint, a requeue); the program
starts with them and SIGINT ignored, until ``popdist_lite.init()`` holds them itself.

The launcher's death ends the program: when the connection to the collector ends (end of
file or an error, the launcher was killed or closed it) the agent SIGKILLs its program
at once and exits. The program gets SIGKILL when the agent dies (``PR_SET_PDEATHSIG``).

Environment read here (set by the launcher):
    POPRUN_LITE_COLLECTOR                   the collector's host:port (no records if unset)
    POPRUN_LITE_KEY_FILE                    the file holding the job's key (hex), removed
    POPRUN_LITE_STALL_INSPECTOR             "1": record and forward the program's progress
    POPRUN_LITE_HOLD_SIGNALS                the signals to hold (see above)
    POPDIST_LITE_ROLE                       "replica" (default) or "feeder"
    POPDIST_LITE_FEEDER_OF / _FEEDER_INDEX  on a feeder: the replica it feeds, its index
    POPDIST_REPLICA_INDEX_OFFSET            this rank's replica (= instance) index
    POPDIST_NUM_LOCAL_REPLICAS              replicas per instance (1)
    POPDIST_LITE_ONLY_OUTPUT_FROM_INSTANCE  if set and not this instance: hide output
    OMPI_COMM_WORLD_RANK / PMI_RANK / PMIX_RANK   the MPI rank (first set)
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from popdist_lite import records

from . import hold_signals, keys
from .hold_signals import child_preexec
from .link import Link, warn
from .rank_progress import RankProgress
from .tee import Tee
from ..core.text import signal_name

TAIL_LINES = 200
#: Seconds between forwarding SIGTERM/SIGINT to the program and SIGKILLing it.
PROGRAM_KILL_DELAY_SECONDS = 3.0
#: The agent's exit code when it did not start its program (it could not enrol).
NOT_STARTED = 125
#: The held program: bash (a POSIX sh such as dash takes descriptors 0-9 only) running
#: ``"$@"`` once one line arrives on the descriptor ``$0`` (the program's socket), and
#: exiting without running it at end of file. ``exec`` keeps the pid.
HOLD = ["bash", "-c", 'read -r _ <&"$0" && exec "$@"']


class _ProgramSocket:
    """The agent's end of the socket pair to its program: bytes to the program
    (:data:`records.ACK <popdist_lite.records.ACK>`, :data:`records.RESIZE
    <popdist_lite.records.RESIZE>`) are written under one lock, from the relay and the
    request threads."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.lock = threading.Lock()

    def write(self, data: bytes) -> None:
        if data:
            with self.lock:
                try:
                    self.sock.sendall(data)
                except OSError:  # the program is gone
                    pass


def _relay(program: _ProgramSocket, link: Link, ident: dict) -> None:
    """Pass the program's records (:data:`records.FROM_PROGRAM
    <popdist_lite.records.FROM_PROGRAM>`) to the launcher, stamped with this agent's
    identity (``ident``; the program's own ``time`` is kept), and acknowledge every line
    with one byte (the program may wait for that before aborting the job). Anything
    else the program sends is dropped."""
    sock = program.sock
    lines = records.LineBuffer()
    while True:
        try:
            chunk = sock.recv(65536)
        except OSError:
            break
        if not chunk:
            break
        overlong = lines.overlong
        for line in lines.feed(chunk):
            try:
                record = records.decode(line, records.FROM_PROGRAM)
            except ValueError as exc:
                warn(f"dropped a record from the program: {exc}")
            else:
                link.send({**record, **ident, "time": record["time"]})
            program.write(records.ACK)
        program.write(records.ACK * (lines.overlong - overlong))
    with program.lock:
        sock.close()


def _signal_program(state: dict, request: dict) -> None:
    """``{"kind": "signal", "signal": "SIGUSR1"}``: send that signal to the program."""
    proc = state.get("child")
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.Signals[request["signal"]])


def _dump_stack(state: dict, request: dict) -> None:
    """``{"kind": "stack_request", "request": N}``: answer with the program's Python
    stacks (``stack`` record), from a thread (the dump takes up to two seconds)."""
    proc, watched, link = state.get("child"), state.get("progress"), state.get("link")
    if proc is None or watched is None or link is None:
        return

    def answer():
        text = watched.dump_stack(proc.pid) if proc.poll() is None else ""
        link.send(records.make("stack", {**state["ident"], "time": time.time()},
                               request=request["request"], text=text))
    threading.Thread(target=answer, daemon=True).start()


def _request_resize(state: dict, request: dict) -> None:
    """``{"kind": "resize_request", "replicas": N}``: tell the program (one
    :data:`records.RESIZE <popdist_lite.records.RESIZE>` byte on its socket), where
    :func:`popdist_lite.should_checkpoint` finds it."""
    program = state.get("program")
    if program is not None:
        program.write(records.RESIZE)


#: The launcher's requests this agent understands: record kind -> handler(state, request).
REQUESTS = {"signal": _signal_program, "stack_request": _dump_stack, "resize_request": _request_resize}


def _is_shown(environ) -> bool:
    """False when --only-output-from-instance selects another instance."""
    selected = environ.get("POPDIST_LITE_ONLY_OUTPUT_FROM_INSTANCE")
    if selected in (None, ""):
        return True
    offset = int(environ.get("POPDIST_REPLICA_INDEX_OFFSET", "0"))
    local = max(1, int(environ.get("POPDIST_NUM_LOCAL_REPLICAS", "1")))
    return int(selected) == offset // local


def run(program: list[str]) -> int:
    """Run ``program`` under supervision and return the agent's exit code: 0 on
    success, else the child's exit code (128+signum when killed by a signal), 127
    when the program cannot be started, :data:`NOT_STARTED` when the agent could not
    enrol with the launcher. Sends the records described in the module docstring. Does
    not raise for failures of the program.
    """
    environ = os.environ
    holds_term = bool(environ.get(hold_signals.ENV))
    held = hold_signals.held(environ) if holds_term else ()
    if holds_term:  # before any thread starts: every thread of the agent blocks them
        hold_signals.block(held)
    key = keys.take_key(environ)  # the key file is gone before anything is started
    ident = records.env_identity(environ)
    shown = _is_shown(environ)
    ours, theirs = socket.socketpair()
    child_env = dict(environ)
    child_env[records.RECORD_FD_ENV] = str(theirs.fileno())

    pass_fds = [theirs.fileno()]
    pmi_fd = environ.get("PMI_FD")
    if pmi_fd and pmi_fd.isdigit():
        pass_fds.append(int(pmi_fd))

    stop = {"signal": None, "time": None, "child": None, "ident": ident, "progress": None,
            "program": _ProgramSocket(ours)}
    if environ.get(records.INSPECTOR_ENV) == "1":  # the launcher's stall inspector is on
        try:
            stop["progress"] = RankProgress()
            child_env.update(stop["progress"].env())
            pass_fds += stop["progress"].fds()
        except OSError as exc:
            warn(f"no stall inspection for this rank: {exc}")

    def forward(signum, _frame):
        if stop["signal"] is None:
            stop["signal"], stop["time"] = signum, time.monotonic()
        proc = stop["child"]
        if proc is not None and proc.poll() is None:
            try:  # a held program ignores SIGTERM; the MPI daemon's SIGINT means the same stop
                proc.send_signal(signal.SIGKILL if holds_term and signum in (signal.SIGTERM, signal.SIGINT)
                                 else signum)
            except OSError:
                pass

    def on_request(request: dict) -> None:
        handler = REQUESTS.get(request["kind"])
        if handler is not None:
            handler(stop, request)

    def on_lost() -> None:
        """The connection to the launcher ended: the launcher is gone, end the program."""
        forward(signal.SIGKILL, None)
        warn("lost the connection to the launcher; ended the program")

    signal.signal(signal.SIGINT, forward)
    link = Link(environ.get(records.COLLECTOR_ENV), key)
    stop["link"] = link
    if holds_term:
        hold_signals.Watch(os.getppid(), lambda: forward(signal.SIGTERM, None),
                           lambda signum, pid: link.send(records.make(
                               "signalled", {**ident, "time": time.time()}, signal=signal_name(signum),
                               sender=pid or None)),
                           held).start()
    else:
        signal.signal(signal.SIGTERM, forward)
    waits = not link.ready.is_set()  # a launcher to enrol with: hold the program until then

    read_fd, write_fd = os.pipe()
    stdout = None if shown else subprocess.DEVNULL
    relay = None
    try:
        if waits and shutil.which(program[0]) is None:
            raise FileNotFoundError(f"{program[0]}: no such executable")
        command = [*HOLD, str(theirs.fileno()), *program] if waits else program
        child = subprocess.Popen(
            command, env=child_env, stdout=stdout, stderr=write_fd, pass_fds=pass_fds,
            preexec_fn=child_preexec((lambda: hold_signals.ignore_in_child(held)) if holds_term else None))
    except OSError as exc:
        os.close(read_fd)
        os.close(write_fd)
        theirs.close()
        ours.close()
        print(f"poprun-lite agent: cannot start {program[0]!r}: {exc}", file=sys.stderr)
        child, code, tail = None, 127, str(exc)
        link.start(ident, on_request)
    else:
        os.close(write_fd)
        theirs.close()
        tail_reader = Tee(read_fd, sys.stderr.fileno() if shown else None, TAIL_LINES)
        ident["pid"] = child.pid
        stop["child"] = child
        link.start(ident, on_request, on_lost)
        if waits:
            while not link.ready.wait(0.1) and child.poll() is None:
                pass
            if link.session is None:  # not enrolled: the held shell reads EOF, runs nothing
                ours.close()
                child.wait()
                tail_reader.text(timeout=1.0)
                warn("the program was not started (no enrolment with the launcher)")
                return NOT_STARTED
            stop["program"].write(b"\n")  # the held shell runs the program
        relay = threading.Thread(target=_relay, args=(stop["program"], link, ident), daemon=True)
        relay.start()
        if stop["progress"] is not None:
            watched = stop["progress"]
            watched.watch(lambda lane, call, op, since: link.send(records.make(
                "progress", {**ident, "time": time.time()}, lane=lane, call=call, op=op, since=since,
                **watched.storage_fields())))
        if stop["signal"] is not None:  # told to stop while starting the child
            forward(stop["signal"], None)

    ended_at = time.time()
    if child is not None:
        # a thread blocked in waitpid notes the moment the program ended: the report
        # orders failures by time, and a peer's error follows a death within milliseconds
        ended = {}
        waiter = threading.Thread(target=lambda: ended.update(code=child.wait(), at=time.time()),
                                  daemon=True)
        waiter.start()
        while waiter.is_alive():
            waiter.join(0.2)
            stopped_at = stop["time"]
            if waiter.is_alive() and stopped_at is not None \
                    and time.monotonic() - stopped_at > PROGRAM_KILL_DELAY_SECONDS:
                child.kill()
        code, ended_at = ended["code"], ended["at"]
        # when told to stop, mpirun SIGKILLs us soon: do not wait long for the pipes
        wait = 0.2 if stop["signal"] is not None else 2.0
        relay.join(wait)
        tail = tail_reader.text(timeout=wait)

    sig = -code if code < 0 else None
    ident["time"] = ended_at
    link.send(records.make("exit", ident, exitcode=None if sig else code,
                           signal=signal_name(sig) if sig else None,
                           stderr_tail=tail if code else "",
                           terminated=stop["signal"] is not None))
    link.close()
    if stop["progress"] is not None:
        stop["progress"].close()
    if code == 0:
        return 0
    return 128 + sig if sig else code


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m popdist_lite_launcher.node.agent -- program [args...]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        print("usage: python -m popdist_lite_launcher.node.agent -- program [args...]", file=sys.stderr)
        sys.exit(2)
    sys.exit(run(args))


if __name__ == "__main__":
    main()
