"""Per-rank supervisor: ``python -m popdist_lite_launcher.agent -- program args``.

mpirun starts one agent per rank (like torchrun's per-worker agent) on the rank's host.
The agent starts the program as its child, tees the child's stderr while keeping its
last lines, forwards SIGTERM/SIGINT, and keeps ONE TCP connection to the launcher's
collector (``POPRUN_LITE_COLLECTOR``) over which it sends, as newline-delimited JSON
(:mod:`popdist_lite.records`): ``hello``, a ``heartbeat`` every second, every record the
program sends it (its uncaught exception from ``popdist_lite``'s excepthook), and
``exit`` with the exit code or signal and the stderr tail. The same connection
carries the launcher's requests to this agent: :data:`REQUESTS` maps a record kind to
its handler (``signal``: send a signal to the program; ``stack_request``: answer with
the program's Python stacks).

With ``POPRUN_LITE_STALL_INSPECTOR=1`` the agent also gives its program a progress slot
and a stack file on this host (:mod:`popdist_lite_launcher.rank_progress`) and sends a
``progress`` record whenever the program enters another collective call.

The program reaches its agent through a host-local socket pair whose descriptor is in
``POPDIST_LITE_RECORD_FD`` (see :func:`popdist_lite.records.send`).

Environment read here (set by the launcher):
    POPRUN_LITE_COLLECTOR                   the collector's host:port (no records if unset)
    POPRUN_LITE_STALL_INSPECTOR             "1": record and forward the program's progress
    POPDIST_LITE_ROLE                       "replica" (default) or "feeder"
    POPDIST_LITE_FEEDER_OF / _FEEDER_INDEX  on a feeder: the replica it feeds, its index
    POPDIST_REPLICA_INDEX_OFFSET            this rank's replica (= instance) index
    POPDIST_NUM_LOCAL_REPLICAS              replicas per instance (1)
    POPDIST_LITE_ONLY_OUTPUT_FROM_INSTANCE  if set and not this instance: hide output
    OMPI_COMM_WORLD_RANK / PMI_RANK / PMIX_RANK   the MPI rank (first set)
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from popdist_lite import records
from .rank_progress import RankProgress
from .tee import Tee

TAIL_LINES = 200
#: Seconds between forwarding SIGTERM/SIGINT to the program and SIGKILLing it.
PROGRAM_KILL_DELAY_SECONDS = 3.0
#: Seconds to wait for the collector to accept the connection.
CONNECT_TIMEOUT_SECONDS = 10.0

def _set_pdeathsig() -> None:
    """In the child (preexec_fn): get SIGKILL when the agent dies (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except Exception:  # noqa: BLE001 - best effort, never fail the exec
        pass


class Link:
    """The agent's connection to the launcher's collector.

    ``address`` is ``host:port`` (None or unreachable: records are dropped, with one
    warning on stderr). :meth:`send` is thread-safe; :meth:`start` sends ``hello`` and
    starts the heartbeat and the reader of the launcher's requests, which calls
    ``on_request(record)``.
    """

    def __init__(self, address: str | None):
        self.sock = None
        self.lock = threading.Lock()
        self.closed = threading.Event()
        if not address:
            return
        host, _, port = address.rpartition(":")
        try:
            self.sock = socket.create_connection((host.strip("[]"), int(port)),
                                                 timeout=CONNECT_TIMEOUT_SECONDS)
            self.sock.settimeout(None)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, ValueError) as exc:
            print(f"poprun-lite agent on {socket.gethostname()}: cannot reach the launcher's "
                  f"collector at {address}: {exc}; this rank's failures will not be reported",
                  file=sys.stderr, flush=True)
            self.sock = None

    def send(self, record: dict | bytes) -> bool:
        """Send a record (a dict, or an already encoded line); False if not sent."""
        if self.sock is None:
            return False
        line = record if isinstance(record, bytes) else records.encode(record)
        with self.lock:
            try:
                self.sock.sendall(line)
                return True
            except OSError:
                return False

    def start(self, hello: dict, on_request) -> None:
        if self.sock is None:
            return
        self.send(records.make("hello", hello))
        threading.Thread(target=self._heartbeat, daemon=True).start()
        threading.Thread(target=self._requests, args=(on_request,), daemon=True).start()

    def _heartbeat(self) -> None:
        beat = records.encode(records.make("heartbeat"))
        while not self.closed.wait(records.HEARTBEAT_SECONDS):
            if not self.send(beat):
                return

    def _requests(self, on_request) -> None:
        lines = records.LineBuffer()
        while True:
            try:
                chunk = self.sock.recv(65536)
            except OSError:
                return
            if not chunk:
                return
            for line in lines.feed(chunk):
                try:
                    on_request(records.decode(line))
                except Exception as exc:  # noqa: BLE001 - a bad request must not kill the agent
                    print(f"poprun-lite agent: ignored request {line[:200]!r}: {exc}",
                          file=sys.stderr, flush=True)

    def close(self) -> None:
        """Stop the heartbeat and close the connection (after the last record)."""
        self.closed.set()
        if self.sock is not None:
            with self.lock:
                try:
                    self.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                self.sock.close()


def _relay(sock: socket.socket, link: Link) -> None:
    """Pass every record line from the program to the launcher and acknowledge it with
    one byte (the program may wait for that before aborting the job)."""
    lines = records.LineBuffer()
    while True:
        try:
            chunk = sock.recv(65536)
        except OSError:
            break
        if not chunk:
            break
        for line in lines.feed(chunk):
            try:
                records.decode(line)
            except ValueError:
                continue
            link.send(line + b"\n")
            try:
                sock.sendall(b"\x06")
            except OSError:
                pass
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
                               request=request.get("request"), text=text))
    threading.Thread(target=answer, daemon=True).start()


#: The launcher's requests this agent understands: record kind -> handler(state, request).
REQUESTS = {"signal": _signal_program, "stack_request": _dump_stack}


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"SIG{signum}"


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
    when the program cannot be started. Sends the records described in the module
    docstring. Does not raise for failures of the program.
    """
    environ = os.environ
    ident = records.env_identity(environ)
    shown = _is_shown(environ)
    ours, theirs = socket.socketpair()
    child_env = dict(environ)
    child_env[records.RECORD_FD_ENV] = str(theirs.fileno())

    pass_fds = [theirs.fileno()]
    pmi_fd = environ.get("PMI_FD")
    if pmi_fd and pmi_fd.isdigit():
        pass_fds.append(int(pmi_fd))

    stop = {"signal": None, "time": None, "child": None, "ident": ident, "progress": None}
    if environ.get(records.INSPECTOR_ENV) == "1":  # the launcher's stall inspector is on
        try:
            stop["progress"] = RankProgress()
            child_env.update(stop["progress"].env())
            pass_fds += stop["progress"].fds()
        except OSError as exc:
            print(f"poprun-lite agent: no stall inspection for this rank: {exc}", file=sys.stderr)

    def forward(signum, _frame):
        if stop["signal"] is None:
            stop["signal"], stop["time"] = signum, time.monotonic()
        proc = stop["child"]
        if proc is not None and proc.poll() is None:
            try:
                proc.send_signal(signum)
            except OSError:
                pass

    def on_request(request: dict) -> None:
        handler = REQUESTS.get(request["kind"])
        if handler is not None:
            handler(stop, request)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    link = Link(environ.get(records.COLLECTOR_ENV))
    stop["link"] = link

    read_fd, write_fd = os.pipe()
    stdout = None if shown else subprocess.DEVNULL
    relay = None
    try:
        child = subprocess.Popen(
            program, env=child_env, stdout=stdout, stderr=write_fd, pass_fds=pass_fds,
            preexec_fn=_set_pdeathsig if sys.platform.startswith("linux") else None)
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
        relay = threading.Thread(target=_relay, args=(ours, link), daemon=True)
        relay.start()
        stop["child"] = child
        link.start(ident, on_request)
        if stop["progress"] is not None:
            stop["progress"].watch(lambda call, op, since: link.send(records.make(
                "progress", {**ident, "time": time.time()}, call=call, op=op, since=since)))
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
                           signal=_signal_name(sig) if sig else None,
                           stderr_tail=tail if code else "",
                           terminated=stop["signal"] is not None))
    link.close()
    if stop["progress"] is not None:
        stop["progress"].close()
    if code == 0:
        return 0
    return 128 + sig if sig else code


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m popdist_lite_launcher.agent -- program [args...]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        print("usage: python -m popdist_lite_launcher.agent -- program [args...]", file=sys.stderr)
        sys.exit(2)
    sys.exit(run(args))


if __name__ == "__main__":
    main()
