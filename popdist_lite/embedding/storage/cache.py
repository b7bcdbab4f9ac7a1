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

Prefetch (:meth:`RowCache.reserve`, :meth:`RowCache.store`, :meth:`RowCache.load`) in
two halves: the caller (the training loop's thread) reserves slots for the missing rows
under the cache's lock (evicting; the dirty victims' records and rows are copied out,
not written), marks them ``loading`` and maps their rows to them; a background thread,
one job after another, first reads the job's records, then writes the job's copied
victims back (the two sets of rows are disjoint), both outside the lock (positional
reads and writes and numpy copies release the GIL), and publishes each under the lock
(``loaded`` is notified). Every other method holds the lock too, and a lookup that
meets a ``loading`` slot waits for it (``wait_seconds``).

The file's bytes of a row are read only when they are its truth:

- a reserved row: it is written back only from a slot, and a ``loading`` slot is never
  dirty; a victim's write-back is queued before the read of any later job (FIFO), so a
  row evicted by one prefetch and reserved by a later one is read after it was written;
- every read on the caller's thread (a lookup's misses, :meth:`flush`, :meth:`clear`,
  :meth:`wait_loaded`) first waits until no write-back is ``pending`` (all of them,
  not only those of its rows: with prefetch a lookup rarely misses, and a row has at
  most one write-back in flight, since it is not cached again before that is done);
- a write-back that failed keeps its records (``unwritten``, sorted by row) and the
  error (``failure``, taken by :meth:`take_failure`): a read of those rows, by a
  lookup or a prefetch, takes their records from there (the slot is then dirty), and
  :meth:`flush` writes the rest.

Every failure of the background thread ends in ``failure`` (the table's next agreement
raises it on every replica) and wakes whoever waits: :meth:`load` and :meth:`store`
catch any exception (an ``OSError``, a ``MemoryError``) and always publish (a read
that did not complete unmaps its rows, which a lookup then reads itself; a write-back
that did not complete keeps its records), and a failure outside them, which may leave
a slot ``loading`` or a write-back ``pending`` for ever, breaks the cache
(:meth:`break_down`): every wait and every later call raises :class:`CacheBroken`. So
does a failed write-back whose records could not be kept either (they are nowhere).
"""

from __future__ import annotations

import threading
from time import perf_counter

import numpy as np

#: Bytes of bookkeeping per cache slot beside its record (row_of, score, dirty, pinned,
#: held, loading).
SLOT_OVERHEAD = 8 + 8 + 1 + 1 + 4 + 1
#: Bytes of records one write-back call copies out of the cache and writes (a flush of a
#: full cache in parts of this size): the copy, and the file's scratch buffer for the
#: pages it reads in first, stay this small instead of growing with the cache.
WRITE_BACK_BYTES = 1 << 20


class CacheTooSmall(ValueError):
    """The cache cannot hold the distinct rows one call needs; ``rows``: the slots it
    would have needed (0 when unknown)."""

    def __init__(self, message: str, rows: int = 0):
        super().__init__(message)
        self.rows = rows


class CacheBroken(RuntimeError):
    """The cache's background thread failed where the cache could not recover (see the
    module docstring): the table cannot be used any more."""


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
        loaded: the lock's condition, notified when a background write-back or read is
            published.
        pending: write-backs handed to the background thread (:meth:`reserve`) and not
            yet done (:meth:`store`).
        unwritten: ``(rows int64[k] sorted, records)`` of failed background
            write-backs, or ``None``.
        failure: the first failure of the background thread (a read, a write-back or
            the thread itself), until :meth:`take_failure`.
        broken: the failure that broke the cache (:meth:`break_down`), or ``None``.
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
        self.loaded = threading.Condition(self.lock)  # notified when a job's write-back or read is published
        self.pending = 0  # write-backs handed to the background thread, not yet done
        self.unwritten: tuple[np.ndarray, np.ndarray] | None = None  # (rows, records) of failed write-backs
        self.failure: BaseException | None = None  # the first background failure, until take_failure
        self.broken: BaseException | None = None  # what broke the cache (break_down), for ever

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
            self._check()
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
                    self._wait(lambda: self.loading[slots[late]].any())
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

    def _allocate(self, rows: np.ndarray, keep: np.ndarray,
                  defer: bool = False) -> tuple[np.ndarray, tuple | None]:
        """Slots for the missing sorted ``rows`` (free ones first, then victims, written
        back when dirty); ``keep``: the batch's hit slots (never evicted for it). The
        rows are mapped to the slots (records not yet read). ``defer``: the dirty
        victims are not written but returned, ``(rows int64[k] sorted, records)``
        copies (``None`` when none), for the background thread's :meth:`store`.

        Returns:
            ``(slots, deferred write-back or None)``.

        Raises:
            CacheTooSmall: as :meth:`_victims` (nothing changed).
        """
        back = None
        n = len(rows)
        fresh = min(n, self.capacity - self.used)
        new = np.arange(self.used, self.used + fresh, dtype=np.int64)
        if fresh < n:
            need = n - fresh
            victims = self._victims(need, keep, n + len(keep))
            if defer:
                back = self._copy_dirty(victims)
            else:
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
        return new, back

    def _copy_dirty(self, slots: np.ndarray) -> tuple | None:
        """The rows and record copies of the dirty ones of ``slots``, sorted by row
        (marked clean), or ``None``."""
        slots = slots[self.dirty[slots]]
        if not len(slots):
            return None
        slots = slots[np.argsort(self.row_of[slots], kind="stable")]
        self.dirty[slots] = False
        return self.row_of[slots].copy(), self.records[slots]

    def _wait_written(self) -> None:
        """Wait (under the lock) until no write-back is pending."""
        self._wait(lambda: self.pending)

    def _wait(self, busy) -> None:
        """Wait (under the lock) while ``busy()``; every wake-up comes from the background
        thread's :meth:`load`, :meth:`store` or :meth:`break_down`.

        Raises:
            CacheBroken: the cache is or becomes broken."""
        while True:
            self._check()
            if not busy():
                return
            self.loaded.wait()

    def _check(self) -> None:
        """Raise :class:`CacheBroken` if the cache is broken (under the lock)."""
        if self.broken is not None:
            raise CacheBroken(f"the cache of rows is unusable: its background thread failed "
                              f"({type(self.broken).__name__}: {self.broken}) and left rows it was reading or "
                              f"writing in an unknown state; make the table again (from a checkpoint)")

    def _fail(self, error: BaseException) -> None:
        """Keep ``error`` for :meth:`take_failure` unless an earlier one is kept (under the lock)."""
        if self.failure is None:
            self.failure = error

    def break_down(self, error: BaseException) -> None:
        """The background thread failed outside :meth:`load` and :meth:`store`: keep
        ``error``, break the cache and wake every waiter (they raise :class:`CacheBroken`)."""
        with self.lock:
            if self.broken is None:
                self.broken = error
            self._fail(error)
            self.loaded.notify_all()

    def _take_unwritten(self, rows: np.ndarray, slots: np.ndarray) -> None:
        """Put the kept records of failed write-backs among sorted ``rows`` into their
        ``slots`` (which hold the file's records), mark those slots dirty and forget them
        there (last: until then they are still kept)."""
        if self.unwritten is None:
            return
        kept_rows, kept = self.unwritten
        here = np.isin(kept_rows, rows, assume_unique=True)
        if not here.any():
            return
        at = slots[np.searchsorted(rows, kept_rows[here])]
        rest = None if here.all() else (kept_rows[~here], kept[~here])
        self.records[at] = kept[here]
        self.dirty[at] = True
        self.unwritten = rest

    def _fill(self, rows: np.ndarray, keep: np.ndarray) -> np.ndarray:
        """Slots for the missing sorted ``rows``, read from the file now (see
        :meth:`_allocate`), after the pending write-backs. On a failed read the rows are
        unmapped again."""
        self._wait_written()
        new, _ = self._allocate(rows, keep)
        block = np.empty(len(rows), self.file.record)
        try:
            self.file.read(rows, block)
        except BaseException:
            self._unmap(new)
            raise
        self.records[new] = block
        self._take_unwritten(rows, new)
        return new

    def _unmap(self, slots: np.ndarray) -> None:
        """Free ``slots`` (clean: their rows are read again from the file when asked for)."""
        self.slot_of[self.row_of[slots]] = -1
        self.row_of[slots] = -1
        self.score[slots] = 0
        self.dirty[slots] = False

    # -- prefetch ------------------------------------------------------------------------
    def reserve(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Hold the slots of sorted unique ``rows`` for a prefetch: the cached ones as
        they are, the missing ones newly reserved (``loading``, to be filled by
        :meth:`load`). Every slot's ``held`` count goes up by one until :meth:`release`.
        Hits and misses are not counted (they are the lookups').

        The dirty victims are not written here: their rows and record copies are
        returned, and :attr:`pending` counts them until :meth:`store` is done.

        Returns:
            ``(slots of all rows, reserved slots, their rows, write-back)``; the
            write-back is ``(rows int64[k] sorted, records)`` to hand to :meth:`store`
            before the :meth:`load` of the reserved slots, or ``None``.

        Raises:
            CacheTooSmall: the missing rows do not fit beside the pinned and held ones
                (nothing changed).
        """
        with self.lock:
            self._check()
            start = perf_counter()
            slots = self.slot_of[rows].astype(np.int64)
            missing = slots < 0
            new_rows = rows[missing]
            new, back = np.zeros(0, np.int64), None
            if len(new_rows):
                new, back = self._allocate(new_rows, slots[~missing], defer=True)
                slots[missing] = new
                self.loading[new] = True
                if back is not None:
                    self.pending += 1
            np.add.at(self.held, slots, 1)
            self.stats["wait_seconds"] += perf_counter() - start
            return slots, new, new_rows, back

    def store(self, rows: np.ndarray, records: np.ndarray) -> tuple[float, BaseException | None]:
        """Write the records of a reservation's dirty victims (``rows`` sorted, as
        :meth:`reserve` returned them) to the file outside the lock, then count the
        write (``rows_written``, ``bytes_written``, ``disk_seconds``) and end its
        ``pending`` under the lock. Called by the background thread; raises nothing.

        Returns:
            ``(the write's start (perf_counter), error or None)``; on an error the records
            are kept (``unwritten``: read from there, written by :meth:`flush`; when even
            that fails, the cache is broken) and the error is kept for :meth:`take_failure`.
        """
        start = perf_counter()
        error = None
        try:
            self.file.write(rows, records, count=False)
        except BaseException as exc:  # noqa: BLE001 - kept, and raised by the table's next agreement
            error = exc
        with self.lock:
            try:
                if error is None:
                    self.file.count("written", rows, start, phase=False)
                else:
                    self._keep_unwritten(rows, records)
            except BaseException as exc:  # noqa: BLE001 - as above (a count, or records that could not be kept)
                if error is not None and self.broken is None:
                    self.broken = exc  # the rows were written nowhere: the cache no longer holds the truth
                error = error or exc
            finally:
                if error is not None:
                    self._fail(error)
                self.pending -= 1
                self.loaded.notify_all()
        return start, error

    def _keep_unwritten(self, rows: np.ndarray, records: np.ndarray) -> None:
        """Add the records of a failed write-back to ``unwritten`` (under the lock)."""
        if self.unwritten is not None:  # a row is in at most one of them (module docstring)
            rows = np.concatenate((self.unwritten[0], rows))
            records = np.concatenate((self.unwritten[1], records))
            order = np.argsort(rows, kind="stable")
            rows, records = rows[order], records[order]
        self.unwritten = (rows, records)

    def take_failure(self) -> BaseException | None:
        """The first failure of the background thread since the last call, or ``None``."""
        with self.lock:
            failure, self.failure = self.failure, None
            return failure

    def load(self, slots: np.ndarray, rows: np.ndarray) -> tuple[float, BaseException | None]:
        """Read the records of reserved ``slots`` (rows ``rows``, sorted) from the file,
        outside the lock, then publish them. Called by the background reader; raises
        nothing.

        Returns:
            ``(the read's start (perf_counter), error or None)``; on an error the error is
            kept for :meth:`take_failure` and, unless the records were already in place
            (an error in counting them), the rows are unmapped (their slots stay held,
            empty, until the prefetch is let go), so a lookup reads them itself.
        """
        start = perf_counter()
        error, block = None, None
        try:
            block = np.empty(len(rows), self.file.record)
            self.file.read(rows, block, count=False)
        except BaseException as exc:  # noqa: BLE001 - kept, and raised by the table's next agreement
            error = exc
        with self.lock:
            placed = False
            try:
                if error is None:
                    self.records[slots] = block
                    self._take_unwritten(rows, slots)
                    placed = True
                    self.file.count("read", rows, start, phase=False)
                    self.stats["prefetched_rows"] += len(rows)
            except BaseException as exc:  # noqa: BLE001 - as above
                error = exc
            finally:
                if not placed:
                    self._unmap(slots)
                if error is not None:
                    self._fail(error)
                self.loading[slots] = False
                self.loaded.notify_all()
        return start, error

    def release(self, slots: np.ndarray) -> None:
        """Drop one hold of each of ``slots`` (a prefetch's batch was updated)."""
        with self.lock:
            np.subtract.at(self.held, slots, 1)

    def wait_loaded(self) -> None:
        """Wait until no slot is loading and no write-back is pending (every prefetch's
        write-back and read published)."""
        with self.lock:
            self._wait(lambda: self.loading.any() or self.pending)

    def _write_back(self, slots: np.ndarray) -> None:
        """Write the dirty ones of ``slots`` to the file, sorted by row, in parts of
        :data:`WRITE_BACK_BYTES` (each part marked clean once written: after a failed
        write the rest stays dirty)."""
        slots = slots[self.dirty[slots]]
        if not len(slots):
            return
        order = np.argsort(self.row_of[slots], kind="stable")
        slots = slots[order]
        part = max(1, WRITE_BACK_BYTES // self.file.record.itemsize)
        for first in range(0, len(slots), part):
            these = slots[first:first + part]
            self.file.write(self.row_of[these], self.records[these])
            self.dirty[these] = False

    def unpin(self) -> None:
        with self.lock:
            self.pinned[:] = False

    def flush(self) -> None:
        """Write every dirty row back, and the records of failed background write-backs,
        after the pending ones (the file is then the whole truth).

        Raises:
            OSError: a write failed (the records not written are kept)."""
        with self.lock:
            self._wait_written()
            if self.unwritten is not None:
                self.file.write(*self.unwritten)
                self.unwritten = None
            self._write_back(np.arange(self.used, dtype=np.int64))

    def clear(self) -> None:
        """Forget every cached row, pins and holds included, and the records of failed
        write-backs (after :meth:`flush` and :meth:`wait_loaded`, or to discard them;
        it waits for the pending write-backs)."""
        with self.lock:
            self._wait_written()
            self.unwritten = None
            cached = self.row_of[:self.used]
            self.slot_of[cached[cached >= 0]] = -1
            self.row_of[:] = -1
            self.dirty[:] = False
            self.pinned[:] = False
            self.held[:] = 0
            self.loading[:] = False
            self.score[:] = 0
            self.used = 0
