"""The agent's side of the stall inspector: its rank's progress slot and stack dumps.

The agent makes a private directory on its own host holding the rank's progress slot
and stack file (:mod:`popdist_lite.progress`), and points the program at them with
``POPDIST_LITE_PROGRESS_FILE`` and ``POPDIST_LITE_STACK_FILE``. :meth:`RankProgress.watch`
reads the slot every :data:`POLL_SECONDS` in a thread and calls ``send(call, op,
since)`` when the rank has entered another collective call (the agent forwards that to
the launcher as a ``progress`` record); :meth:`RankProgress.dump_stack` sends the rank
:data:`popdist_lite.progress.STACK_SIGNAL` and returns the stack text faulthandler
appended to the file. Nothing here uses MPI, and nothing is shared between hosts.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time

from . import progress

#: Seconds between two reads of the rank's slot.
POLL_SECONDS = 0.2
#: Seconds the rank has to write its stack after the signal.
STACK_TIMEOUT_SECONDS = 2.0


class RankProgress:
    """The progress slot and stack file of one rank (see the module docstring)."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="poprun-lite-rank-")
        self.slot_path = os.path.join(self.dir, "progress")
        self.stack_path = os.path.join(self.dir, "stacks")
        progress.create_slot(self.slot_path)
        open(self.stack_path, "w").close()
        self._stop = threading.Event()
        self._stack_lock = threading.Lock()

    def env(self) -> dict[str, str]:
        """The variables that turn on the rank's recorder and stack dumps."""
        return {progress.PROGRESS_ENV: self.slot_path, progress.STACK_ENV: self.stack_path}

    def read(self) -> tuple[int, str, float, int] | None:
        """The rank's last ``(call, op, since, pid)``, or None before its first call.
        Reads until two reads agree, so a half-written slot is never returned."""
        try:
            with open(self.slot_path, "rb") as f:
                last = None
                for _ in range(5):
                    data = os.pread(f.fileno(), progress.SLOT_SIZE, 0)
                    if data == last:
                        return progress.read_slot(data)
                    last = data
        except OSError:
            pass
        return None

    def watch(self, send) -> None:
        """Start a daemon thread calling ``send(call, op, since)`` for every new call
        the rank enters (as seen every :data:`POLL_SECONDS`), until :meth:`close`."""
        def loop():
            seen = None
            while not self._stop.wait(POLL_SECONDS):
                now = self.read()
                if now is not None and now[:3] != seen:
                    seen = now[:3]
                    try:
                        send(*seen)
                    except Exception:  # noqa: BLE001 - the link may be gone; keep supervising
                        pass
        threading.Thread(target=loop, name="poprun-lite progress", daemon=True).start()

    def dump_stack(self, pid: int, timeout: float = STACK_TIMEOUT_SECONDS) -> str:
        """Ask process ``pid`` (the rank) for every thread's Python stack; return the text
        it appended to the stack file within ``timeout`` s ("" if none)."""
        with self._stack_lock:
            try:
                start = os.path.getsize(self.stack_path)
                os.kill(pid, progress.STACK_SIGNAL)
            except OSError:
                return ""
            deadline = time.monotonic() + timeout
            text, size = b"", start
            while time.monotonic() < deadline:
                time.sleep(0.05)
                try:
                    now = os.path.getsize(self.stack_path)
                except OSError:
                    break
                if now > start and now == size:  # grew, then stopped growing: complete
                    break
                size = now
            try:
                with open(self.stack_path, "rb") as f:
                    f.seek(start)
                    text = f.read()
            except OSError:
                pass
            return text.decode("utf-8", "replace")

    def close(self) -> None:
        """Stop watching and remove the directory."""
        self._stop.set()
        shutil.rmtree(self.dir, ignore_errors=True)
