"""The launcher's short-lived helper processes (discovery scripts, probes and cleanups
run through the launch agent): each starts in its own session and is tracked until it
is reaped, so that :func:`kill_all`, called at the end of every attempt and when the
launcher exits, leaves none of them, nor anything they started, running. A process
group is also SIGKILLed when its leader has exited (what a script left in the
background goes with it). Output that is not trusted (a discovery script's, Slurm's
commands') is read by :func:`run_bounded` as it comes, up to a limit, never all of it
first."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import threading
import time

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


def run_bounded(cmd: list[str], *, timeout: float, max_bytes: int, max_lines: int | None = None,
                lines_are: str = "lines", tail_bytes: int = 2000) -> tuple[subprocess.CompletedProcess, str | None]:
    """Run ``cmd`` as :func:`run` does (stdin ``/dev/null``), reading its standard output
    and error as they come: ``(completed, problem)``. ``completed`` holds the exit code
    (None when stopped), stdout (bytes) and the last ``tail_bytes`` of stderr. Reading
    stops, and the process group is killed, once ``timeout`` seconds have passed
    (``problem``: ``still running after T s (killed)``) or stdout holds more than
    ``max_bytes`` bytes or more than ``max_lines`` lines (``printed more than N bytes
    (killed)``, ``... N lines (killed)``, with ``lines_are`` for "lines"), so that no more than one read (64 KiB) past a
    limit is ever held; ``problem`` is None when the process ended in time.

    Raises:
        OSError: ``cmd`` cannot be run.
    """
    proc = start(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err, problem, lines, code = bytearray(), bytearray(), None, 0, None
    deadline = time.monotonic() + timeout
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ, out)
            selector.register(proc.stderr, selectors.EVENT_READ, err)
            while selector.get_map() and problem is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    problem = f"still running after {timeout:g} s (killed)"
                    break
                for key, _ in selector.select(left):
                    chunk = os.read(key.fileobj.fileno(), 65536)
                    if not chunk:
                        selector.unregister(key.fileobj)
                        continue
                    key.data.extend(chunk)
                    if key.data is out:
                        lines += chunk.count(b"\n")
                        if len(out) > max_bytes:
                            problem = f"printed more than {max_bytes} bytes (killed)"
                        elif max_lines is not None and lines > max_lines:
                            problem = f"printed more than {max_lines} {lines_are} (killed)"
                    del err[:-tail_bytes]
        if problem is None:
            try:
                code = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                problem = f"still running after {timeout:g} s (killed)"
    finally:
        finish(proc)  # its group, whatever it left running, and the reaping
        proc.stdout.close()
        proc.stderr.close()
    return subprocess.CompletedProcess(cmd, code, bytes(out), bytes(err)), problem


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
