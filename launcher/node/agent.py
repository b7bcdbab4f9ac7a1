"""Per-rank supervisor: ``python -m popdist_lite_launcher.node.agent -- program args``.

mpirun starts one agent per rank (like torchrun's per-worker agent) on the rank's host.
The agent reads the job's key from its key file and removes the file
(:func:`popdist_lite_launcher.node.keys.take_key`: no process's environment holds the
key, only the file's path), starts the program as its child, tees the child's stderr
while keeping its last lines (holding back a traceback until the program's end shows
whether it ended it: then the failure report tells it, from the ``error`` record or
the tail, and the live output does not:
:class:`~popdist_lite_launcher.node.tee.HeldTracebacks`), forwards SIGTERM/SIGINT, and
keeps ONE authenticated TCP connection to the launcher's collector (``POPRUN_LITE_COLLECTOR``;
:class:`~popdist_lite_launcher.node.link.Link`, framing and handshake in
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
``resize_stop`` record (its replicas agreed to stop for that resize), its
``checkpoint_saved`` and its ``timeline`` records (its timeline events, under
``--timeline``) are relayed like its ``error`` record.

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
import termios
import threading
import time

from popdist_lite import records

from . import hold_signals, keys
from .hold_signals import child_preexec
from .link import Link, warn
from .rank_progress import RankProgress
from .tee import HeldTracebacks, Tee
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


def _signal_program(agent: "_Agent", request: dict) -> None:
    """``{"kind": "signal", "signal": "SIGUSR1"}``: send that signal to the program."""
    proc = agent.child
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.Signals[request["signal"]])


def _dump_stack(agent: "_Agent", request: dict) -> None:
    """``{"kind": "stack_request", "request": N}``: answer with the program's Python
    stacks (``stack`` record), from a thread (the dump takes up to two seconds)."""
    proc, watched, link = agent.child, agent.progress, agent.link
    if proc is None or watched is None or link is None:
        return

    def answer():
        text = watched.dump_stack(proc.pid) if proc.poll() is None else ""
        link.send(records.make("stack", {**agent.ident, "time": time.time()},
                               request=request["request"], text=text))
    threading.Thread(target=answer, daemon=True).start()


def _request_resize(agent: "_Agent", request: dict) -> None:
    """``{"kind": "resize_request", "replicas": N}``: tell the program (one
    :data:`records.RESIZE <popdist_lite.records.RESIZE>` byte on its socket), where
    :func:`popdist_lite.should_checkpoint` finds it."""
    agent.program_socket.write(records.RESIZE)


#: The launcher's requests this agent understands: record kind -> handler(agent, request).
REQUESTS = {"signal": _signal_program, "stack_request": _dump_stack, "resize_request": _request_resize}


def _is_shown(environ) -> bool:
    """False when --only-output-from-instance selects another instance."""
    selected = environ.get("POPDIST_LITE_ONLY_OUTPUT_FROM_INSTANCE")
    if selected in (None, ""):
        return True
    offset = int(environ.get("POPDIST_REPLICA_INDEX_OFFSET", "0"))
    local = max(1, int(environ.get("POPDIST_NUM_LOCAL_REPLICAS", "1")))
    return int(selected) == offset // local


def size_terminal(environ, fd: int = 1) -> None:
    """Give the terminal on ``fd`` (the rank's stdout) the launcher's size, ``COLUMNS`` x
    ``LINES`` of ``environ``, when it has none: Open MPI gives a rank's stdout a pty of
    size 0x0, on which tqdm draws nothing."""
    try:
        columns, lines = int(environ.get("COLUMNS", "")), int(environ.get("LINES", ""))
        if columns > 0 and lines > 0 and os.isatty(fd) and os.get_terminal_size(fd) == (0, 0):
            termios.tcsetwinsize(fd, (lines, columns))
    except (ValueError, OSError, termios.error):
        pass


def run(program: list[str]) -> int:
    """Run ``program`` under supervision and return the agent's exit code: 0 on
    success, else the child's exit code (128+signum when killed by a signal), 127
    when the program cannot be started, :data:`NOT_STARTED` when the agent could not
    enrol with the launcher. Sends the records described in the module docstring. Does
    not raise for failures of the program.
    """
    size_terminal(os.environ)
    agent = _Agent(program, os.environ)
    waits = agent.connect()  # a launcher to enrol with: hold the program until then
    tail_reader = agent.start(waits)
    if tail_reader is None:  # the program could not be started
        return agent.report(127, time.time(), agent.failure)
    if waits and not agent.enrolled(tail_reader):
        return NOT_STARTED
    relay = agent.watch()
    return agent.report(*agent.wait(relay, tail_reader))


class _Agent:
    """One run of the agent (:func:`run`): its program and the program's socket, its link
    to the launcher, and the first signal that told it to stop (and when)."""

    def __init__(self, program: list[str], environ):
        self.program = program
        self.holds_term = bool(environ.get(hold_signals.ENV))
        self.held = hold_signals.held(environ) if self.holds_term else ()
        if self.holds_term:  # before any thread starts: every thread of the agent blocks them
            hold_signals.block(self.held)
        self.key = keys.take_key(environ)  # the key file is gone before anything is started
        self.collector_address = environ.get(records.COLLECTOR_ENV)
        self.ident = records.env_identity(environ)
        self.shown = _is_shown(environ)
        ours, self.theirs = socket.socketpair()
        self.program_socket = _ProgramSocket(ours)
        self.child_env = dict(environ)
        self.child_env[records.RECORD_FD_ENV] = str(self.theirs.fileno())
        self.pass_fds = [self.theirs.fileno()]
        pmi_fd = environ.get("PMI_FD")
        if pmi_fd and pmi_fd.isdecimal():
            self.pass_fds.append(int(pmi_fd))
        self.signal: int | None = None      # the first signal that told the agent to stop
        self.stopped_at: float | None = None  # when (monotonic)
        self.child: subprocess.Popen | None = None
        self.link: Link | None = None
        self.failure = ""                     # why the program could not be started
        self.progress: RankProgress | None = None
        if environ.get(records.INSPECTOR_ENV) == "1":  # the launcher's stall inspector is on
            try:
                self.progress = RankProgress()
                self.child_env.update(self.progress.env())
                self.pass_fds += self.progress.fds()
            except OSError as exc:
                warn(f"no stall inspection for this rank: {exc}")

    def forward(self, signum, _frame=None) -> None:
        """A signal for the program: noted (the first one and its time), then passed on."""
        if self.signal is None:
            self.signal, self.stopped_at = signum, time.monotonic()
        proc = self.child
        if proc is not None and proc.poll() is None:
            try:  # a held program ignores SIGTERM; the MPI daemon's SIGINT means the same stop
                proc.send_signal(signal.SIGKILL if self.holds_term and signum in (signal.SIGTERM, signal.SIGINT)
                                 else signum)
            except OSError:
                pass

    def on_request(self, request: dict) -> None:
        handler = REQUESTS.get(request["kind"])
        if handler is not None:
            handler(self, request)

    def on_lost(self) -> None:
        """The connection to the launcher ended: the launcher is gone, end the program."""
        self.forward(signal.SIGKILL)
        warn("lost the connection to the launcher; ended the program")

    def connect(self) -> bool:
        """The signal handlers (or the held signals' watch) and the link; whether the
        program must wait for the launcher's welcome (there is a launcher to enrol with)."""
        signal.signal(signal.SIGINT, self.forward)
        self.link = link = Link(self.collector_address, self.key)
        if self.holds_term:
            hold_signals.Watch(os.getppid(), lambda: self.forward(signal.SIGTERM),
                               lambda signum, pid: link.send(records.make(
                                   "signalled", {**self.ident, "time": time.time()}, signal=signal_name(signum),
                                   sender=pid or None)),
                               self.held).start()
        else:
            signal.signal(signal.SIGTERM, self.forward)
        return not link.ready.is_set()

    def start(self, waits: bool) -> Tee | None:
        """Start the program (held until the welcome when ``waits``: :data:`HOLD`) and the
        link's handshake; the copy of the program's stderr, or None when it could not be
        started (:attr:`failure` says why)."""
        read_fd, write_fd = os.pipe()
        try:
            if waits and shutil.which(self.program[0]) is None:
                raise FileNotFoundError(f"{self.program[0]}: no such executable")
            command = [*HOLD, str(self.theirs.fileno()), *self.program] if waits else self.program
            self.child = subprocess.Popen(
                command, env=self.child_env, stdout=None if self.shown else subprocess.DEVNULL, stderr=write_fd,
                pass_fds=self.pass_fds,
                preexec_fn=child_preexec((lambda: hold_signals.ignore_in_child(self.held)) if self.holds_term
                                         else None))
        except OSError as exc:
            os.close(read_fd)
            os.close(write_fd)
            self.theirs.close()
            self.program_socket.sock.close()
            print(f"poprun-lite agent: cannot start {self.program[0]!r}: {exc}", file=sys.stderr)
            self.failure = str(exc)
            self.link.start(self.ident, self.on_request)
            return None
        os.close(write_fd)
        self.theirs.close()
        # with a launcher to report to, a traceback that ends the program is its report's to tell
        held = HeldTracebacks() if self.shown and self.collector_address else None
        tail_reader = Tee(read_fd, sys.stderr.fileno() if self.shown else None, TAIL_LINES, filter=held)
        self.ident["pid"] = self.child.pid
        self.link.start(self.ident, self.on_request, self.on_lost)
        return tail_reader

    def enrolled(self, tail_reader: Tee) -> bool:
        """Wait for the link's welcome, then let the held program run; False (it never
        runs) when the agent could not enrol."""
        while not self.link.ready.wait(0.1) and self.child.poll() is None:
            pass
        if self.link.session is None:  # not enrolled: the held shell reads EOF, runs nothing
            self.program_socket.sock.close()
            self.child.wait()
            tail_reader.text(timeout=1.0)
            warn("the program was not started (no enrolment with the launcher)")
            return False
        self.program_socket.write(b"\n")  # the held shell runs the program
        return True

    def watch(self) -> threading.Thread:
        """While the program runs: the relay of its records (the thread), its progress
        records, and a stop signal that came while it started."""
        relay = threading.Thread(target=_relay, args=(self.program_socket, self.link, self.ident), daemon=True)
        relay.start()
        if self.progress is not None:
            watched, link = self.progress, self.link
            watched.watch(lambda lane, call, op, since: link.send(records.make(
                "progress", {**self.ident, "time": time.time()}, lane=lane, call=call, op=op, since=since,
                **watched.storage_fields())))
        if self.signal is not None:  # told to stop while starting the child
            self.forward(self.signal)
        return relay

    def wait(self, relay: threading.Thread, tail_reader: Tee) -> tuple[int, float, str]:
        """The program's end: ``(exit status, when it ended, stderr's last lines)``; it is
        SIGKILLed :data:`PROGRAM_KILL_DELAY_SECONDS` after a stop signal."""
        child = self.child
        # a thread blocked in waitpid notes the moment the program ended: the report
        # orders failures by time, and a peer's error follows a death within milliseconds
        ended = {}
        waiter = threading.Thread(target=lambda: ended.update(code=child.wait(), at=time.time()), daemon=True)
        waiter.start()
        while waiter.is_alive():
            waiter.join(0.2)
            stopped_at = self.stopped_at
            if waiter.is_alive() and stopped_at is not None \
                    and time.monotonic() - stopped_at > PROGRAM_KILL_DELAY_SECONDS:
                child.kill()
        # when told to stop, mpirun SIGKILLs us soon: do not wait long for the pipes
        wait = 0.2 if self.signal is not None else 2.0
        relay.join(wait)
        tail_reader.finish(failed=ended["code"] != 0, timeout=wait)
        return ended["code"], ended["at"], tail_reader.text(timeout=wait)

    def report(self, code: int, ended_at: float, tail: str) -> int:
        """Send the ``exit`` record, close the link; the agent's exit code."""
        sig = -code if code < 0 else None
        self.ident["time"] = ended_at
        self.link.send(records.make("exit", self.ident, exitcode=None if sig else code,
                                    signal=signal_name(sig) if sig else None,
                                    stderr_tail=tail if code else "",
                                    terminated=self.signal is not None))
        self.link.close()
        if self.progress is not None:
            self.progress.close()
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
