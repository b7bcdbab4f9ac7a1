"""The hot-row cache in front of a :class:`~.rowfile.RowFile`: a fixed array of record
slots, fully associative, with LRU or LFU eviction, pinned and dirty slots.

Bookkeeping (numpy arrays, so a batch of rows costs a few vectorised operations):
``slot_of`` (int32 per partition row, -1 when not cached), and per slot ``row_of``
(int64), ``score`` (int64: the tick of the last use for LRU, the uses since the row
came in for LFU), ``dirty`` and ``pinned`` (bool). A batch's misses are read from the
file in one pass sorted by row (so by offset); the victims are the unpinned slots of
lowest score outside the batch, written back first when dirty, in one sorted pass.
"""

from __future__ import annotations

import numpy as np

#: Bytes of bookkeeping per cache slot beside its record (row_of, score, dirty, pinned).
SLOT_OVERHEAD = 8 + 8 + 1 + 1


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
        stats: dict of counters to add to (``hits``, ``misses``, ``evictions``).
    """

    def __init__(self, file, capacity: int, policy: str, stats: dict):
        self.file, self.capacity, self.policy, self.stats = file, int(capacity), policy, stats
        self.records = np.zeros(self.capacity, file.record)
        self.slot_of = np.full(file.rows, -1, np.int32)
        self.row_of = np.full(self.capacity, -1, np.int64)
        self.score = np.zeros(self.capacity, np.int64)
        self.dirty = np.zeros(self.capacity, bool)
        self.pinned = np.zeros(self.capacity, bool)
        self.used = 0  # slots [0, used) have held a row
        self.tick = 0

    def slots(self, rows: np.ndarray, pin: bool) -> np.ndarray:
        """The slots holding sorted unique partition ``rows`` (``int64[n]``), reading the
        missing ones (evicting others); pinned afterwards when ``pin``.

        Raises:
            CacheTooSmall: the rows do not fit beside the pinned ones (nothing changed).
            OSError: the file could not be read or written.
        """
        slots = self.slot_of[rows].astype(np.int64)
        missing = slots < 0
        n_miss = int(np.count_nonzero(missing))
        self.stats["hits"] += len(rows) - n_miss
        self.stats["misses"] += n_miss
        if n_miss:
            slots[missing] = self._fill(rows[missing], slots[~missing])
        self.tick += 1
        if self.policy == "lru":
            self.score[slots] = self.tick
        else:
            self.score[slots] += 1
        if pin:
            self.pinned[slots] = True
        return slots

    def _fill(self, rows: np.ndarray, keep: np.ndarray) -> np.ndarray:
        """Slots for the missing sorted ``rows``, read from the file; ``keep``: the
        batch's hit slots (never evicted for it)."""
        n = len(rows)
        fresh = min(n, self.capacity - self.used)
        new = np.arange(self.used, self.used + fresh, dtype=np.int64)
        if fresh < n:
            need = n - fresh
            held = self.pinned[:self.used].copy()
            held[keep] = True
            candidates = np.flatnonzero(~held)
            if len(candidates) < need:
                pinned = int(np.count_nonzero(self.pinned[:self.used]))
                raise CacheTooSmall(f"the cache holds {self.capacity} rows; this call needs {n + len(keep)} distinct "
                                    f"rows of this replica's partition beside {pinned} rows pinned by lookups "
                                    f"awaiting their update", rows=n + len(keep) + pinned)
            if need < len(candidates):
                victims = candidates[np.argpartition(self.score[candidates], need - 1)[:need]]
            else:
                victims = candidates
            self._write_back(victims)
            self.slot_of[self.row_of[victims]] = -1
            self.stats["evictions"] += need
            new = np.concatenate((new, np.sort(victims)))
        self.used += fresh
        block = np.empty(n, self.file.record)
        self.file.read(rows, block)
        self.records[new] = block
        self.row_of[new] = rows
        self.slot_of[rows] = new
        self.dirty[new] = False
        self.score[new] = 0
        return new

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
        self.pinned[:] = False

    def flush(self) -> None:
        """Write every dirty row back (the file is then the whole truth)."""
        self._write_back(np.arange(self.used, dtype=np.int64))

    def clear(self) -> None:
        """Forget every cached row (after :meth:`flush`, or to discard them)."""
        held = self.row_of[:self.used]
        self.slot_of[held[held >= 0]] = -1
        self.row_of[:] = -1
        self.dirty[:] = False
        self.pinned[:] = False
        self.score[:] = 0
        self.used = 0
