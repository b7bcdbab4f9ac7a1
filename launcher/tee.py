"""Copy a pipe to a file descriptor in a thread, keeping its last lines.

Used for a rank's stderr in the agent (the tail goes into the exit record) and for
mpirun's stderr in the launcher (the tail is shown when no rank left a record).
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
    """

    def __init__(self, src_fd: int, dst_fd: int | None, max_lines: int, drop: bytes = b""):
        self.src_fd, self.dst_fd, self.drop = src_fd, dst_fd, drop
        self.max_lines = max_lines
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
            if self.drop:
                chunk = chunk.replace(self.drop, b"")
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
        """The kept lines (waiting up to ``timeout`` s for the pipe to reach EOF)."""
        self.thread.join(timeout)
        lines = list(self.lines) + ([self.partial] if self.partial else [])
        return b"\n".join(lines[-self.max_lines:]).decode("utf-8", "replace")
