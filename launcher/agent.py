"""Per-rank supervisor: ``python -m popdist_lite_launcher.agent -- program args``.

mpirun starts one agent per rank (like torchrun's per-worker agent). The agent
starts the program as its child, tees the child's stderr while keeping its last
lines, forwards SIGTERM/SIGINT, and when the child fails writes
``<POPDIST_LITE_RUN_DIR>/rank-<R>.exit.json`` for the launcher's failure report.

Environment read here (set by the launcher):
    POPDIST_LITE_RUN_DIR                    where records go (skipped if unset/missing)
    POPDIST_LITE_ROLE                       "replica" (default) or "feeder"
    POPDIST_LITE_FEEDER_OF / _FEEDER_INDEX  on a feeder: the replica it feeds, its index
    POPDIST_REPLICA_INDEX_OFFSET            this rank's replica (= instance) index
    POPDIST_NUM_LOCAL_REPLICAS              replicas per instance (1)
    POPDIST_LITE_ONLY_OUTPUT_FROM_INSTANCE  if set and not this instance: hide output
    OMPI_COMM_WORLD_RANK / PMI_RANK / PMIX_RANK   the MPI rank (first set)
Environment added for the child:
    POPDIST_LITE_ERROR_FILE = <RUN_DIR>/rank-<R>.error.json
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

TAIL_LINES = 200
KILL_GRACE_SECONDS = 3.0
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


def env_rank(environ=None) -> int | None:
    """The MPI rank from the launcher-set variables (first of OMPI_COMM_WORLD_RANK,
    PMI_RANK, PMIX_RANK that is set), or None."""
    environ = os.environ if environ is None else environ
    for name in RANK_VARS:
        value = environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                continue
    return None


def write_json_atomic(path: str, record: dict) -> None:
    """Write ``record`` as JSON to ``path`` atomically (temporary file, then rename)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)


def _set_pdeathsig() -> None:
    """In the child (preexec_fn): get SIGKILL when the agent dies (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except Exception:  # noqa: BLE001 - best effort, never fail the exec
        pass


class _Tail:
    """Tee bytes from a pipe to a file descriptor (or nowhere) and keep the last lines."""

    def __init__(self, src_fd: int, dst_fd: int | None, max_lines: int = TAIL_LINES):
        self.src_fd, self.dst_fd = src_fd, dst_fd
        self.lines: collections.deque[bytes] = collections.deque(maxlen=max_lines)
        self.partial = b""
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                chunk = os.read(self.src_fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            if self.dst_fd is not None:
                try:
                    os.write(self.dst_fd, chunk)
                except OSError:
                    self.dst_fd = None
            parts = (self.partial + chunk).split(b"\n")
            self.partial = parts.pop()[-65536:]
            self.lines.extend(parts)
        os.close(self.src_fd)

    def text(self, timeout: float = 2.0) -> str:
        """The kept lines (waiting up to ``timeout`` s for the pipe to drain)."""
        self.thread.join(timeout)
        lines = list(self.lines) + ([self.partial] if self.partial else [])
        return b"\n".join(lines[-TAIL_LINES:]).decode("utf-8", "replace")


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
    when the program cannot be started. Failures leave ``rank-<R>.exit.json``.
    Does not raise for failures of the program.
    """
    environ = os.environ
    rank = env_rank(environ)
    run_dir = environ.get("POPDIST_LITE_RUN_DIR")
    if run_dir and not os.path.isdir(run_dir):
        run_dir = None  # e.g. a remote host: no records, the stderr tail still flows
    child_env = dict(environ)
    name = f"rank-{rank if rank is not None else os.getpid()}"
    if run_dir:
        child_env["POPDIST_LITE_ERROR_FILE"] = os.path.join(run_dir, f"{name}.error.json")
    shown = _is_shown(environ)

    pass_fds = []
    pmi_fd = environ.get("PMI_FD")
    if pmi_fd and pmi_fd.isdigit():
        pass_fds.append(int(pmi_fd))

    stop = {"signal": None, "time": None, "child": None}

    def forward(signum, _frame):
        if stop["signal"] is None:
            stop["signal"], stop["time"] = signum, time.monotonic()
        proc = stop["child"]
        if proc is not None and proc.poll() is None:
            try:
                proc.send_signal(signum)
            except OSError:
                pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)

    read_fd, write_fd = os.pipe()
    stdout = None if shown else subprocess.DEVNULL
    try:
        child = subprocess.Popen(
            program, env=child_env, stdout=stdout, stderr=write_fd, pass_fds=pass_fds,
            preexec_fn=_set_pdeathsig if sys.platform.startswith("linux") else None)
    except OSError as exc:
        os.close(read_fd)
        os.close(write_fd)
        print(f"poprun-lite agent: cannot start {program[0]!r}: {exc}", file=sys.stderr)
        child, code, tail = None, 127, str(exc)
    else:
        os.close(write_fd)
        tail_reader = _Tail(read_fd, sys.stderr.fileno() if shown else None)
        stop["child"] = child
        if stop["signal"] is not None:  # told to stop while starting the child
            forward(stop["signal"], None)

    if child is not None:
        while True:
            try:
                code = child.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                stopped_at = stop["time"]
                if stopped_at is not None and time.monotonic() - stopped_at > KILL_GRACE_SECONDS:
                    child.kill()
        # when told to stop, mpirun SIGKILLs us soon: do not wait long for the pipe
        tail = tail_reader.text(timeout=0.2 if stop["signal"] is not None else 2.0)

    if code == 0:
        return 0
    sig = -code if code < 0 else None
    if run_dir:
        record = {
            "rank": rank,
            "replica": int(environ.get("POPDIST_REPLICA_INDEX_OFFSET", "0")),
            "role": environ.get("POPDIST_LITE_ROLE", "replica"),
            "host": socket.gethostname(),
            "pid": child.pid if child is not None else None,
            "time": time.time(),
            "exitcode": None if sig else code,
            "signal": _signal_name(sig) if sig else None,
            "stderr_tail": tail,
            "terminated": stop["signal"] is not None,
        }
        if record["role"] == "feeder":
            record["replica"] = int(environ.get("POPDIST_LITE_FEEDER_OF", record["replica"]))
            index = environ.get("POPDIST_LITE_FEEDER_INDEX", "")
            record["feeder"] = int(index) if index.isdigit() else None
        try:
            write_json_atomic(os.path.join(run_dir, f"{name}.exit.json"), record)
        except OSError as exc:
            print(f"poprun-lite agent: cannot write failure record: {exc}", file=sys.stderr)
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
