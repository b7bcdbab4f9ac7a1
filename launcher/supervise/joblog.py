"""The job's log: what the launcher keeps from the user's view but not from the user.

The failure report tells a failure once; what it leaves out goes here, and the report
names the file (``log: PATH``): the MPI library's own messages about the job's end
(:mod:`.mpi_messages`), and every failed rank's whole error (its traceback, the end of
its stderr) as its agent reported it. One file per job (every attempt appends), made on
first use in a new private directory (``tempfile.mkdtemp``: an unpredictable name,
readable by its owner only) under ``$TMPDIR``; nothing is written for a job that has
nothing to keep.
"""

from __future__ import annotations

import os
import tempfile
import threading


class JobLog:
    """Append-only text file, created on the first :meth:`write`."""

    def __init__(self, directory: str | None = None):
        self.directory = directory
        self.path: str | None = None
        self.lock = threading.Lock()

    def write(self, text: str) -> None:
        """Append ``text`` (a newline is added if it lacks one). Never raises: a log
        that cannot be written loses its text, not the job."""
        if not text:
            return
        with self.lock:
            try:
                if self.path is None:
                    self.path = os.path.join(tempfile.mkdtemp(prefix="poprun-lite-", dir=self.directory), "job.log")
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(text if text.endswith("\n") else text + "\n")
            except OSError:
                pass

    def section(self, title: str, text: str) -> None:
        """``== title ==`` and ``text``."""
        self.write(f"== {title} ==\n{text}")


#: The log of the job this launcher runs.
LOG = JobLog()
