"""The agent's side of the stall inspector: its rank's progress slot and stack dumps.

The agent makes two unlinked temporary files on its own host, the rank's progress slot
and stack file (:mod:`popdist_lite.progress`), and passes them to the program as open
descriptors named by ``POPDIST_LITE_PROGRESS_FD`` and ``POPDIST_LITE_STACK_FD`` (so
nothing is left on disk however the agent ends). :meth:`RankProgress.watch`
reads the slot every :data:`POLL_SECONDS` in a thread and calls ``send(lane, call, op,
since)`` for each lane on which the rank has entered another collective call (the
agent forwards that to the launcher as a ``progress`` record); :meth:`RankProgress.dump_stack` sends the rank
:data:`popdist_lite.progress.STACK_SIGNAL` and returns the stack text faulthandler
appended to the file, or ``stopped (state T)`` for a rank that is stopped (SIGSTOP,
SIGTSTP) or traced, which cannot dump its stack until it is continued (its state read
from ``/proc/PID/stat``). Nothing here uses MPI, and nothing is shared between hosts.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time

from popdist_lite import progress

from . import procfs
from ..core.text import stopped_text

#: Seconds between two reads of the rank's slot.
POLL_SECONDS = 0.2
#: Seconds the rank has to write its stack after the signal.
STACK_TIMEOUT_SECONDS = 2.0


class RankProgress:
    """The progress slot and stack file of one rank (see the module docstring)."""

    def __init__(self):
        self.slot = tempfile.TemporaryFile(prefix="poprun-lite-progress-")
        progress.create_slot(self.slot)
        # append mode: the rank's faulthandler writes at the end, we read with pread
        self.stacks = tempfile.TemporaryFile(mode="a+b", prefix="poprun-lite-stacks-")
        for f in (self.slot, self.stacks):
            os.set_inheritable(f.fileno(), True)
        self._stop = threading.Event()
        self._stack_lock = threading.Lock()

    def env(self) -> dict[str, str]:
        """The variables that turn on the rank's recorder and stack dumps."""
        return {progress.PROGRESS_ENV: str(self.slot.fileno()),
                progress.STACK_ENV: str(self.stacks.fileno())}

    def fds(self) -> list[int]:
        """The descriptors the rank must inherit (``pass_fds``)."""
        return [self.slot.fileno(), self.stacks.fileno()]

    def read(self) -> tuple[int, str, float, int] | None:
        """The rank's last ``(call, op, since, pid)``, or None before its first call.
        Reads until two reads agree, so a half-written slot is never returned."""
        return self._read_stable(progress.read_slot, None)

    def read_lanes(self) -> list[tuple[str, int, str, float]]:
        """The rank's last ``(lane, call, op, since)`` on each lane it has used
        (:func:`popdist_lite.progress.read_lanes`), read as :meth:`read` does."""
        return self._read_stable(progress.read_lanes, [])

    def read_storage(self) -> dict | None:
        """The rank's disk-table counters (:func:`popdist_lite.progress.read_storage`),
        None before it has any; read as :meth:`read` does."""
        return self._read_stable(progress.read_storage, None)

    def storage_fields(self) -> dict:
        """``{"storage": counters}`` for a ``progress`` record, or ``{}`` before the rank
        has any."""
        storage = self.read_storage()
        return {} if storage is None else {"storage": storage}

    def _read_stable(self, parse, default):
        """``parse`` of the slot's bytes once two reads agree (so a half-written slot is
        never parsed); ``default`` when they never do or the slot cannot be read."""
        try:
            last = None
            for _ in range(5):
                data = os.pread(self.slot.fileno(), progress.SLOT_SIZE, 0)
                if data == last:
                    return parse(data)
                last = data
        except (OSError, ValueError):
            pass
        return default

    def watch(self, send) -> None:
        """Start a daemon thread calling ``send(lane, call, op, since)`` for every new
        call the rank enters on each lane (as seen every :data:`POLL_SECONDS`), until
        :meth:`close`."""
        def loop():
            seen = {}
            while not self._stop.wait(POLL_SECONDS):
                for lane, *now in self.read_lanes():
                    if seen.get(lane) != now:
                        seen[lane] = now
                        try:
                            send(lane, *now)
                        except Exception:  # noqa: BLE001 - the link may be gone; keep supervising
                            pass
        threading.Thread(target=loop, name="poprun-lite progress", daemon=True).start()

    def dump_stack(self, pid: int, timeout: float = STACK_TIMEOUT_SECONDS) -> str:
        """Ask process ``pid`` (the rank) for every thread's Python stack; return the text
        it appended to the stack file within ``timeout`` s; :func:`~popdist_lite_launcher.core.text.stopped_text` if the process is stopped (then it is
        not signalled) or was stopped when no text came; "" if none came otherwise."""
        state = _stopped_state(pid)
        if state:
            return stopped_text(state)
        with self._stack_lock:
            fd = self.stacks.fileno()
            try:
                start = os.fstat(fd).st_size
                os.kill(pid, progress.STACK_SIGNAL)
            except OSError:
                return ""
            deadline = time.monotonic() + timeout
            text, size = b"", start
            while time.monotonic() < deadline:
                time.sleep(0.05)
                try:
                    now = os.fstat(fd).st_size
                except OSError:
                    break
                if now > start and now == size:  # grew, then stopped growing: complete
                    break
                size = now
            try:
                text = os.pread(fd, max(0, os.fstat(fd).st_size - start), start)
            except OSError:
                pass
        state = _stopped_state(pid) if not text else None
        return stopped_text(state) if state else text.decode("utf-8", "replace")

    def close(self) -> None:
        """Stop watching and close the files (they vanish with the last descriptor)."""
        self._stop.set()
        self.slot.close()
        self.stacks.close()


def _stopped_state(pid: int) -> str | None:
    """``"T"`` (stopped) or ``"t"`` (traced) if that is the state of process ``pid`` in
    ``/proc/PID/stat``, else None (running, sleeping, gone, or no ``/proc``)."""
    letter = procfs.state(pid)
    return letter if letter in ("T", "t") else None
