"""Running the mpirun command: signals, timeout, hard kill, failure records.

:func:`run_job` starts mpirun in a new session, passes its stderr through while
keeping the last lines, forwards SIGINT/SIGTERM to it, enforces ``--timeout``,
and if the job is not gone ``KILL_GRACE_SECONDS`` after being told to stop,
SIGKILLs every process of mpirun's session (mpirun gives each rank its own
process group, so killing one group is not enough).
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from . import report

#: Seconds between asking the job to stop and killing all of its processes.
KILL_GRACE_SECONDS = 8.0
MPIRUN_TAIL_LINES = 50


@dataclass
class JobResult:
    """Outcome of one mpirun run."""

    returncode: int                      # mpirun's exit status (negative: signal)
    stop_reason: str | None = None       # e.g. "job interrupted by SIGINT"
    stop_signal: int | None = None       # the signal the launcher received, if any
    timed_out: bool = False
    mpirun_tail: str = ""
    failures: list = field(default_factory=list)


def _pump_stderr(src, tail: collections.deque) -> None:
    """Copy mpirun's stderr to ours, keeping the last lines."""
    out = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
    partial = b""
    fd = src.fileno()
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunk = chunk.replace(b"\0", b"")  # prterun ends its help messages with a NUL
        if out is not None:
            try:
                out.write(chunk)
                out.flush()
            except (OSError, ValueError):
                out = None
        parts = (partial + chunk).split(b"\n")
        partial = parts.pop()[-65536:]
        tail.extend(parts)
    if partial:
        tail.append(partial)


def session_pids(sid: int) -> list[int]:
    """PIDs of the live processes in session ``sid`` (Linux /proc; [] elsewhere)."""
    pids = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return pids
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # fields after the ")" closing the command name: state ppid pgrp session ...
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 3 and int(fields[3]) == sid:
            pids.append(int(entry))
    return pids


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (mpirun's, as it leads it)."""
    for pid in session_pids(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(sid, signal.SIGKILL)
    except OSError:
        pass


def run_job(cmd: list[str], run_dir: str, *, timeout: float | None = None,
            env: dict[str, str] | None = None) -> JobResult:
    """Run ``cmd`` (an mpirun command) to completion and collect failure records.

    SIGINT/SIGTERM received meanwhile are forwarded to mpirun; ``timeout``
    seconds (None/0: no limit) after the start mpirun gets SIGTERM. In both cases
    the whole session is SIGKILLed if still alive ``KILL_GRACE_SECONDS`` later.
    Must be called from the main thread (it installs signal handlers).

    Raises:
        OSError: mpirun cannot be started.
    """
    result = JobResult(returncode=0)
    state = {"proc": None, "stop_at": None}

    def stop(signum, _frame=None):
        if result.stop_signal is None and not result.timed_out:
            result.stop_signal = signum
            result.stop_reason = f"job interrupted by {signal.Signals(signum).name}"
        if state["stop_at"] is None:
            state["stop_at"] = time.monotonic()
        if state["proc"] is not None:
            try:
                state["proc"].send_signal(signum)
            except OSError:
                pass

    # handlers first: a Ctrl-C while starting must not orphan mpirun (its own session)
    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True, env=env)
        state["proc"] = proc
        if result.stop_signal is not None:
            stop(result.stop_signal)
        tail: collections.deque = collections.deque(maxlen=MPIRUN_TAIL_LINES)
        pump = threading.Thread(target=_pump_stderr, args=(proc.stderr, tail), daemon=True)
        pump.start()
        start = time.monotonic()
        killed = False
        while True:
            try:
                result.returncode = proc.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if timeout and not result.timed_out and result.stop_signal is None \
                    and now - start > timeout:
                result.timed_out = True
                result.stop_reason = f"job timed out after {timeout:g} s"
                stop(signal.SIGTERM)
            if state["stop_at"] is not None and not killed \
                    and now - state["stop_at"] > KILL_GRACE_SECONDS:
                kill_session(proc.pid)
                killed = True
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if killed or result.stop_reason:
        kill_session(proc.pid)  # leftovers that ignored the stop request
    pump.join(2.0)
    result.mpirun_tail = b"\n".join(tail).decode("utf-8", "replace")
    result.failures = report.merge_records(report.load_records(run_dir))
    return result
