"""Copy a pipe to a file descriptor in a thread, keeping its last lines.

Used for a rank's stderr in the agent (the tail goes into the exit record), and for
mpirun's stdout and stderr in the launcher (the stderr tail is shown when no rank left a
record). A job can end in the middle of a line (a rank killed as it wrote, a host lost):
:meth:`Tee.end_line` then ends that line, so the next attempt's output, or the
launcher's report, starts on a line of its own.
"""

from __future__ import annotations

import collections
import os
import threading


class Tee:
    """Read ``src_fd`` until EOF in a daemon thread, write everything to ``dst_fd``
    (None: discard) and keep the last ``max_lines`` lines. ``src_fd`` is closed at EOF.

    ``drop`` bytes (e.g. ``b"\\0"``: prterun ends its help messages with a NUL) are
    removed before writing. A failing ``dst_fd`` stops the copying, not the tail.
    ``max_lines=0`` keeps no tail (a plain copy).
    """

    def __init__(self, src_fd: int, dst_fd: int | None, max_lines: int, drop: bytes = b""):
        self.src_fd, self.dst_fd, self.drop = src_fd, dst_fd, drop
        self.max_lines = max_lines
        self.lines: collections.deque[bytes] = collections.deque(maxlen=max_lines)
        self.partial = b""
        self.last = b"\n"  # the last byte written to dst_fd
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
            if self.drop:
                chunk = chunk.replace(self.drop, b"")
            if self.dst_fd is not None:
                try:
                    _write_all(self.dst_fd, chunk)
                    self.last = chunk[-1:] or self.last
                except OSError:
                    self.dst_fd = None
            if not self.max_lines:
                continue
            parts = (self.partial + chunk).split(b"\n")
            self.partial = parts.pop()[-65536:]
            self.lines.extend(parts)
        os.close(self.src_fd)

    def end_line(self, timeout: float = 2.0) -> None:
        """After the pipe's EOF (waiting up to ``timeout`` s for it), write a newline to
        ``dst_fd`` if what was written did not end with one."""
        self.thread.join(timeout)
        if self.dst_fd is not None and self.last != b"\n" and not self.thread.is_alive():
            try:
                os.write(self.dst_fd, b"\n")
                self.last = b"\n"
            except OSError:
                pass

    def text(self, timeout: float = 2.0) -> str:
        """The kept lines (waiting up to ``timeout`` s for the pipe to reach EOF)."""
        self.thread.join(timeout)
        lines = list(self.lines) + ([self.partial] if self.partial else [])
        return b"\n".join(lines[-self.max_lines:]).decode("utf-8", "replace")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
