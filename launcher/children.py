"""The launcher's short-lived helper processes (discovery scripts, probes and cleanups
run through the launch agent): each starts in its own session and is tracked until it
is reaped, so that :func:`kill_all`, called at the end of every attempt and when the
launcher exits, leaves none of them, nor anything they started, running. A process
group is also SIGKILLed when its leader has exited (what a script left in the
background goes with it)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading

_lock = threading.Lock()
_live: set[subprocess.Popen] = set()


def start(cmd: list[str], **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **kwargs)`` in a new session, tracked until :func:`finish`.

    Raises:
        OSError: ``cmd`` cannot be run.
    """
    with _lock:
        proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
        _live.add(proc)
    return proc


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:  # the group is empty (gone) already
        pass


def finish(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s process group (whatever is left of it), reap it and stop
    tracking it."""
    _kill_group(proc)
    proc.wait()
    with _lock:
        _live.discard(proc)


def run(cmd: list[str], *, timeout: float, input_text: str | None = None) -> subprocess.CompletedProcess:
    """Like ``subprocess.run(cmd, input=input_text, capture_output=True, text=True,
    timeout=timeout)`` (stdin ``/dev/null`` without ``input_text``), with the process
    in its own session, its group SIGKILLed when it ends or times out, and
    :func:`kill_all` able to end it from another thread.

    Raises:
        OSError: ``cmd`` cannot be run.
        subprocess.TimeoutExpired: still running after ``timeout`` seconds (killed).
    """
    proc = start(cmd, stdin=subprocess.PIPE if input_text is not None else subprocess.DEVNULL,
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(input_text, timeout=timeout)
    finally:
        finish(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def kill_all() -> int:
    """SIGKILL the process group of every tracked process (their owners reap them):
    how many there were."""
    with _lock:
        procs = list(_live)
    for proc in procs:
        _kill_group(proc)
    return len(procs)


def running() -> int:
    """How many tracked processes have not been reaped yet."""
    with _lock:
        return len(_live)
