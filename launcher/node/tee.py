"""Copy a pipe to a file descriptor in a thread, keeping its last lines.

Used for a rank's stderr in the agent (the tail goes into the exit record), and for
mpirun's stdout and stderr in the launcher (the stderr tail is shown when no rank left a
record). A job can end in the middle of a line (a rank killed as it wrote, a host lost):
:meth:`Tee.end_line` then ends that line, so the next attempt's output, or the
launcher's report, starts on a line of its own.

What is copied can pass through a filter first (``filter=``): an object with
``feed(chunk) -> bytes`` (what to write now), ``timeout() -> float | None`` (seconds
until it wants :meth:`expire` called, None: no deadline) and ``expire() -> bytes``; the
kept lines are always the unfiltered input. :class:`HeldTracebacks` is the agent's:
a traceback is held back until it is known whether it ended the program (then the
failure report tells it, not the live output) or not (then it is written late).
"""

from __future__ import annotations

import collections
import os
import select
import threading
import time

#: Seconds a traceback is held back before it is written anyway (the program goes on).
HOLD_SECONDS = 5.0
#: Seconds a partial line that may begin a traceback is held back for its rest.
PREFIX_SECONDS = 0.2
#: Bytes held back at most: beyond, what is held is written and the hold ends.
HOLD_LIMIT_BYTES = 256 * 1024


class Tee:
    """Read ``src_fd`` until EOF in a daemon thread, write everything to ``dst_fd``
    (None: discard) and keep the last ``max_lines`` lines. ``src_fd`` is closed at EOF.

    ``drop`` bytes (e.g. ``b"\\0"``: prterun ends its help messages with a NUL) are
    removed before writing. A failing ``dst_fd`` stops the copying, not the tail.
    ``max_lines=0`` keeps no tail (a plain copy). ``filter``: see the module docstring.
    """

    def __init__(self, src_fd: int, dst_fd: int | None, max_lines: int, drop: bytes = b"", filter=None):
        self.src_fd, self.dst_fd, self.drop, self.filter = src_fd, dst_fd, drop, filter
        self.max_lines = max_lines
        self.lines: collections.deque[bytes] = collections.deque(maxlen=max_lines)
        self.partial = b""
        self.last = b"\n"  # the last byte written to dst_fd
        self.lock = threading.Lock()  # writes to dst_fd: the thread's and finish()'s
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _read(self) -> bytes | None:
        """The next chunk (b"" at EOF), or None when the filter's deadline came first."""
        wait = self.filter.timeout() if self.filter is not None else None
        if wait is not None:
            ready, _, _ = select.select([self.src_fd], [], [], max(0.0, wait))
            if not ready:
                return None
        return os.read(self.src_fd, 65536)

    def _run(self) -> None:
        while True:
            try:
                chunk = self._read()
            except OSError:
                break
            if chunk is None:
                self.write(self.filter.expire())
                continue
            if not chunk:
                break
            if self.drop:
                chunk = chunk.replace(self.drop, b"")
            self.write(self.filter.feed(chunk) if self.filter is not None else chunk)
            if not self.max_lines:
                continue
            parts = (self.partial + chunk).split(b"\n")
            self.partial = parts.pop()[-65536:]
            self.lines.extend(parts)
        os.close(self.src_fd)

    def write(self, data: bytes) -> None:
        """Write ``data`` to ``dst_fd`` (nothing once a write failed)."""
        with self.lock:
            if self.dst_fd is None or not data:
                return
            try:
                _write_all(self.dst_fd, data)
                self.last = data[-1:]
            except OSError:
                self.dst_fd = None

    def end_line(self, timeout: float = 2.0) -> None:
        """After the pipe's EOF (waiting up to ``timeout`` s for it), write a newline to
        ``dst_fd`` if what was written did not end with one."""
        self.thread.join(timeout)
        if self.last != b"\n" and not self.thread.is_alive():
            self.write(b"\n")

    def finish(self, failed: bool, timeout: float = 2.0) -> None:
        """After the pipe's EOF (waiting up to ``timeout`` s for it): write what the
        filter still holds, as its ``end(failed)`` says."""
        self.thread.join(timeout)
        if self.filter is not None and not self.thread.is_alive():
            self.write(self.filter.end(failed))

    def text(self, timeout: float = 2.0) -> str:
        """The kept lines (waiting up to ``timeout`` s for the pipe to reach EOF)."""
        self.thread.join(timeout)
        lines = list(self.lines) + ([self.partial] if self.partial else [])
        return b"\n".join(lines[-self.max_lines:]).decode("utf-8", "replace")


class HeldTracebacks:
    """The agent's filter of its program's stderr (:class:`Tee`'s ``filter``): from a
    line that begins a traceback (:data:`MARKERS`: popdist-lite's excepthook, Python's
    own, a ``SyntaxError``'s ``File`` line) everything is held back. The agent then calls
    :meth:`end` when the program has ended: held text of a program that failed is
    dropped (the failure report shows it, from the ``error`` record or the stderr tail,
    which keeps every line); of one that succeeded it is written. Held text is written
    anyway after :data:`HOLD_SECONDS` (the program went on: a traceback it printed and
    survived) or beyond :data:`HOLD_LIMIT_BYTES`. A line starts at the start of the
    stream or after ``\\n`` or ``\\r`` (a progress bar's line)."""

    MARKERS = (b"popdist-lite: uncaught exception in ", b"Traceback (most recent call last):", b'  File "')

    def __init__(self, seconds: float = HOLD_SECONDS, limit: int = HOLD_LIMIT_BYTES, clock=time.monotonic):
        self.seconds, self.limit, self.clock = seconds, limit, clock
        self.held = b""
        self.holding = False      # a traceback began: everything after it is held
        self.deadline: float | None = None

    def _marker_start(self, data: bytes) -> int | None:
        starts = []
        for marker in self.MARKERS:
            at = data.find(marker)
            while at >= 0:
                if at == 0 or data[at - 1:at] in (b"\n", b"\r"):
                    starts.append(at)
                    break
                at = data.find(marker, at + 1)
        return min(starts) if starts else None

    def feed(self, chunk: bytes) -> bytes:
        if self.holding:
            self.held += chunk
            return self.release() if len(self.held) > self.limit else b""
        data, self.held, self.deadline = self.held + chunk, b"", None
        start = self._marker_start(data)
        if start is not None:
            self.holding, self.held, self.deadline = True, data[start:], self.clock() + self.seconds
            return data[:start] + (self.release() if len(self.held) > self.limit else b"")
        cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
        rest = data[cut:]
        if rest and any(marker.startswith(rest) for marker in self.MARKERS):  # maybe a marker's start
            self.held, self.deadline = rest, self.clock() + PREFIX_SECONDS
            return data[:cut]
        return data

    def timeout(self) -> float | None:
        return None if self.deadline is None else self.deadline - self.clock()

    def expire(self) -> bytes:
        return self.release() if self.deadline is not None and self.clock() >= self.deadline else b""

    def release(self) -> bytes:
        """What is held, no longer held."""
        data, self.held, self.holding, self.deadline = self.held, b"", False, None
        return data

    def end(self, failed: bool) -> bytes:
        """At the program's end: what to write of what is held (nothing of a traceback
        when the program ``failed``)."""
        holding = self.holding
        data = self.release()
        return b"" if failed and holding else data


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
