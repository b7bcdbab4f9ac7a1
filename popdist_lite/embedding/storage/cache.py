"""The hot-row cache in front of a :class:`~.rowfile.RowFile`: a fixed array of record
slots, fully associative, with LRU or LFU eviction, pinned and dirty slots, and slots
reserved by a prefetch whose rows a background thread is reading.

Bookkeeping (numpy arrays, so a batch of rows costs a few vectorised operations):
``slot_of`` (int32 per partition row, -1 when not cached), and per slot ``row_of``
(int64, -1 when free), ``score`` (int64: the tick of the last use for LRU, the uses
since the row came in for LFU), ``dirty`` and ``pinned`` (bool: a lookup's rows until
their update), ``held`` (int32: the prefetches in flight that hold the slot) and
``loading`` (bool: its record is still being read by a prefetch). A batch's misses are
read from the file in one pass sorted by row (so by offset); the victims are the slots
of lowest score outside the batch that are neither pinned, held nor loading, written
back first when dirty, in one sorted pass.

Prefetch (:meth:`RowCache.reserve`, :meth:`RowCache.load`) in two halves: the caller
(the training loop's thread) reserves slots for the missing rows under the cache's
lock (evicting, and writing dirty victims back, there), marks them ``loading`` and maps
their rows to them; a background thread reads the records outside the lock (positional
reads and numpy copies release the GIL) and publishes them under the lock. Every other
method holds the lock too, and a lookup that meets a ``loading`` slot waits for it
(``wait_seconds``). The file's bytes of a reserved row cannot change before it is read:
a row is written back only from its slot, and a ``loading`` slot is never dirty.
"""

from __future__ import annotations

import threading
from time import perf_counter

import numpy as np

#: Bytes of bookkeeping per cache slot beside its record (row_of, score, dirty, pinned,
#: held, loading).
SLOT_OVERHEAD = 8 + 8 + 1 + 1 + 4 + 1


class CacheTooSmall(ValueError):
    """The cache cannot hold the distinct rows one call needs; ``rows``: the slots it
    would have needed (0 when unknown)."""

    def __init__(self, message: str, rows: int = 0):
        super().__init__(message)
        self.rows = rows


class RowCache:
    """Up to ``capacity`` records of ``file`` in RAM.

    Args:
        file: the :class:`~.rowfile.RowFile`.
        capacity: slots (records).
        policy: ``"lru"`` or ``"lfu"``.
        stats: dict of counters to add to (``hits``, ``misses``, ``evictions``,
            ``prefetched_rows``, ``wait_seconds``).

    Attributes:
        lock: held by every method; a background reader takes it only to publish.
    """

    def __init__(self, file, capacity: int, policy: str, stats: dict):
        self.file, self.capacity, self.policy, self.stats = file, int(capacity), policy, stats
        self.records = np.zeros(self.capacity, file.record)
        self.slot_of = np.full(file.rows, -1, np.int32)
        self.row_of = np.full(self.capacity, -1, np.int64)
        self.score = np.zeros(self.capacity, np.int64)
        self.dirty = np.zeros(self.capacity, bool)
        self.pinned = np.zeros(self.capacity, bool)
        self.held = np.zeros(self.capacity, np.int32)
        self.loading = np.zeros(self.capacity, bool)
        self.used = 0  # slots [0, used) have held a row
        self.tick = 0
        self.lock = threading.Lock()
        self.loaded = threading.Condition(self.lock)  # notified when loading slots are published

    def slots(self, rows: np.ndarray, pin: bool) -> np.ndarray:
        """The slots holding sorted unique partition ``rows`` (``int64[n]``), reading the
        missing ones (evicting others), waiting for those a prefetch is still reading;
        pinned afterwards when ``pin``. ``misses`` counts the rows not cached plus those
        still loading (the call waited for the disk for both).

        Raises:
            CacheTooSmall: the rows do not fit beside the pinned and held ones (nothing changed).
            OSError: the file could not be read or written.
        """
        with self.lock:
            slots = self.slot_of[rows].astype(np.int64)
            missing = slots < 0
            late = np.zeros(len(rows), bool)
            late[~missing] = self.loading[slots[~missing]]
            n_miss = int(np.count_nonzero(missing))
            n_late = int(np.count_nonzero(late))
            self.stats["hits"] += len(rows) - n_miss - n_late
            self.stats["misses"] += n_miss + n_late
            if n_miss or n_late:
                start = perf_counter()
                if n_miss:
                    slots[missing] = self._fill(rows[missing], slots[~missing])
                if n_late:
                    while self.loading[slots[late]].any():
                        self.loaded.wait()
                    gone = late & (self.slot_of[rows] != slots)  # unmapped: the prefetch's read failed
                    if gone.any():
                        slots[gone] = self._fill(rows[gone], slots[~gone])
                self.stats["wait_seconds"] += perf_counter() - start
            self.tick += 1
            if self.policy == "lru":
                self.score[slots] = self.tick
            else:
                self.score[slots] += 1
            if pin:
                self.pinned[slots] = True
            return slots

    def _victims(self, need: int, keep: np.ndarray, n: int) -> np.ndarray:
        """``need`` slots to reuse, lowest score first: neither pinned, held, loading nor
        in ``keep``. Changes nothing.

        Raises:
            CacheTooSmall: fewer such slots."""
        busy = self.pinned[:self.used] | (self.held[:self.used] > 0) | self.loading[:self.used]
        taken = busy.copy()
        taken[keep] = True
        candidates = np.flatnonzero(~taken)
        if len(candidates) < need:
            pinned = int(np.count_nonzero(busy))
            raise CacheTooSmall(f"the cache holds {self.capacity} rows; this call needs {n} distinct rows of this "
                                f"replica's partition beside {pinned} rows pinned by lookups awaiting their update "
                                f"or held by prefetches in flight", rows=n + pinned)
        if need < len(candidates):
            return candidates[np.argpartition(self.score[candidates], need - 1)[:need]]
        return candidates

    def _allocate(self, rows: np.ndarray, keep: np.ndarray) -> np.ndarray:
        """Slots for the missing sorted ``rows`` (free ones first, then victims, written
        back when dirty); ``keep``: the batch's hit slots (never evicted for it). The
        rows are mapped to the slots (records not yet read).

        Raises:
            CacheTooSmall: as :meth:`_victims` (nothing changed).
        """
        n = len(rows)
        fresh = min(n, self.capacity - self.used)
        new = np.arange(self.used, self.used + fresh, dtype=np.int64)
        if fresh < n:
            need = n - fresh
            victims = self._victims(need, keep, n + len(keep))
            self._write_back(victims)
            gone = self.row_of[victims]
            self.slot_of[gone[gone >= 0]] = -1
            self.stats["evictions"] += int(np.count_nonzero(gone >= 0))
            new = np.concatenate((new, np.sort(victims)))
        self.used += fresh
        self.row_of[new] = rows
        self.slot_of[rows] = new
        self.dirty[new] = False
        self.score[new] = 0
        return new

    def _fill(self, rows: np.ndarray, keep: np.ndarray) -> np.ndarray:
        """Slots for the missing sorted ``rows``, read from the file now (see
        :meth:`_allocate`). On a failed read the rows are unmapped again."""
        new = self._allocate(rows, keep)
        block = np.empty(len(rows), self.file.record)
        try:
            self.file.read(rows, block)
        except BaseException:
            self._unmap(new)
            raise
        self.records[new] = block
        return new

    def _unmap(self, slots: np.ndarray) -> None:
        """Free ``slots`` (clean: their rows are read again from the file when asked for)."""
        self.slot_of[self.row_of[slots]] = -1
        self.row_of[slots] = -1
        self.score[slots] = 0

    # -- prefetch ------------------------------------------------------------------------
    def reserve(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Hold the slots of sorted unique ``rows`` for a prefetch: the cached ones as
        they are, the missing ones newly reserved (``loading``, to be filled by
        :meth:`load`). Every slot's ``held`` count goes up by one until :meth:`release`.
        Hits and misses are not counted (they are the lookups').

        Returns:
            ``(slots of all rows, reserved slots, their rows)``.

        Raises:
            CacheTooSmall: the missing rows do not fit beside the pinned and held ones
                (nothing changed).
            OSError: a dirty victim could not be written back.
        """
        with self.lock:
            start = perf_counter()
            slots = self.slot_of[rows].astype(np.int64)
            missing = slots < 0
            new_rows = rows[missing]
            new = np.zeros(0, np.int64)
            if len(new_rows):
                new = self._allocate(new_rows, slots[~missing])
                slots[missing] = new
                self.loading[new] = True
            np.add.at(self.held, slots, 1)
            self.stats["wait_seconds"] += perf_counter() - start
            return slots, new, new_rows

    def load(self, slots: np.ndarray, rows: np.ndarray) -> tuple[float, BaseException | None]:
        """Read the records of reserved ``slots`` (rows ``rows``, sorted) from the file,
        outside the lock, then publish them. Called by the background reader.

        Returns:
            ``(the read's start (perf_counter), error or None)``; on an error the rows are
            unmapped (their slots stay held, empty, until the prefetch is let go), so a
            lookup reads them itself and meets the error again or not.
        """
        block = np.empty(len(rows), self.file.record)
        start = perf_counter()
        error = None
        try:
            self.file.read(rows, block, count=False)
        except BaseException as exc:  # noqa: BLE001 - a lookup meets it again and reports it
            error = exc
        with self.lock:
            if error is None:
                self.records[slots] = block
                self.file.count("read", rows, start, phase=False)
                self.stats["prefetched_rows"] += len(rows)
            else:
                self._unmap(slots)
            self.loading[slots] = False
            self.loaded.notify_all()
        return start, error

    def release(self, slots: np.ndarray) -> None:
        """Drop one hold of each of ``slots`` (a prefetch's batch was updated)."""
        with self.lock:
            np.subtract.at(self.held, slots, 1)

    def wait_loaded(self) -> None:
        """Wait until no slot is loading (every prefetch read published)."""
        with self.lock:
            while self.loading.any():
                self.loaded.wait()

    def _write_back(self, slots: np.ndarray) -> None:
        """Write the dirty ones of ``slots`` to the file, sorted by row."""
        slots = slots[self.dirty[slots]]
        if not len(slots):
            return
        order = np.argsort(self.row_of[slots], kind="stable")
        slots = slots[order]
        self.file.write(self.row_of[slots], self.records[slots])
        self.dirty[slots] = False

    def unpin(self) -> None:
        with self.lock:
            self.pinned[:] = False

    def flush(self) -> None:
        """Write every dirty row back (the file is then the whole truth)."""
        with self.lock:
            self._write_back(np.arange(self.used, dtype=np.int64))

    def clear(self) -> None:
        """Forget every cached row, pins and holds included (after :meth:`flush` and
        :meth:`wait_loaded`, or to discard them)."""
        with self.lock:
            cached = self.row_of[:self.used]
            self.slot_of[cached[cached >= 0]] = -1
            self.row_of[:] = -1
            self.dirty[:] = False
            self.pinned[:] = False
            self.held[:] = 0
            self.loading[:] = False
            self.score[:] = 0
            self.used = 0
