"""A replica's partition on disk, as its table sees it: :class:`DiskRows`.

The record of a local row holds its master weights (``c`` columns of the master dtype)
and each optimizer slot laid out per row (``"table"`` slots: ``c`` values, ``"row"``
slots: one); ``"replicated"`` slots stay in RAM. Lookups gather rows by local index
through :class:`ServingRows` (``take``, as numpy's, cast to the lookup dtype: a float16
table serves its float32 master rows rounded, as the in-memory table's serving copy);
an update reads the touched rows' records, runs the optimizer spec on them as a
compact partition of ``u`` rows and writes them back (marked dirty), so every spec whose
update is row-local gives the in-memory table's values bit for bit.

Errors inside an exchange (a cache too small, a short read) cannot be raised there
without leaving the other replicas in the collective: :class:`DiskRows` keeps them as a
:class:`~popdist_lite.collectives.Problem` and :meth:`DiskRows.agree` raises the first one on
every replica after the exchange.

Prefetch (:meth:`DiskRows.prefetch`): the rows of a coming batch are reserved in the
cache now; one background thread per table (:class:`_Reader`), FIFO, reads the batch's
missing rows and then writes back the dirty rows the reservation evicted. Every
failure of that thread (a read, a write-back, a ``MemoryError`` anywhere in it) is
kept by the cache and raised by the next :meth:`DiskRows.agree` on every replica, and
wakes whoever waits for the rows (:class:`~.cache.RowCache`); each
prefetch is a :class:`Prefetch` whose holds on its slots are dropped by
:meth:`DiskRows.release` once the table has been used (updated, or looked up when it is
not trainable) as many times as the prefetch said (its ``due``).
"""

from __future__ import annotations

import collections
import queue
import threading
import weakref
from time import perf_counter

import numpy as np

from ... import counters, progress
from ...collectives import Problem
from ...collectives.agreement import agree, register_op
from .cache import SLOT_OVERHEAD, CacheBroken, CacheTooSmall, RowCache
from .rowfile import RowFile, RowFileError

_OP = register_op("disk_rows")
_NOTHING = np.zeros(0, np.int64)
_CHUNK_BYTES = 8 << 20
#: Counters of :attr:`DiskRows.stats`: ``wait_seconds`` is the training loop's time in
#: the file or waiting for a prefetch's write-back or read (``disk_seconds`` adds the
#: background writes and reads), ``prefetched_rows`` the rows prefetches read into the cache.
STAT_NAMES = ("hits", "misses", "evictions", "rows_read", "rows_written", "bytes_read", "bytes_written",
              "disk_seconds", "wait_seconds", "prefetched_rows", "prefetches")
_SECONDS = ("disk_seconds", "wait_seconds")


class Prefetch:
    """One prefetch of a batch's rows on this replica (returned by
    :meth:`popdist_lite.HostEmbedding.prefetch`).

    Attributes:
        rows: this replica's distinct partition rows of the batch (``int``).
        reads: how many of them were not cached and are read by the background thread.
        due: the table's use count (:attr:`DiskRows.uses`) after which its rows are let go.
    """

    def __init__(self, slots: np.ndarray, reads: int, due: int):
        self.slots, self.rows, self.reads, self.due = slots, len(slots), reads, due
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.read_span: tuple[float, float] | None = None  # (start, end) of the background read and write-back
        if not reads:
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until this replica's reads for the batch are in the cache (or failed:
        the lookup then reads the rows itself). Local.

        Returns:
            True when done, False when ``timeout`` (seconds) passed first."""
        return self._done.wait(timeout)

    @property
    def done(self) -> bool:
        return self._done.is_set()


class _Reader:
    """The background thread that reads each prefetch's rows into a cache, then writes
    back the dirty rows its reservation evicted, one prefetch after another. Reading
    first makes the batch's rows ready a write-back sooner; the two sets of rows are
    disjoint (a reservation evicts cached rows for rows not cached), and the write-back
    still comes before the next prefetch's read (FIFO)."""

    def __init__(self, cache: RowCache, name: str):
        self.cache, self.jobs = cache, queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"popdist-lite-prefetch-{name}"[:60])
        self.thread.start()

    def submit(self, job: Prefetch, slots: np.ndarray, rows: np.ndarray, back: tuple | None) -> None:
        """Queue the read of ``rows`` into ``slots``, then ``back`` (:meth:`RowCache.reserve`'s
        write-back or ``None``)."""
        self.jobs.put((job, slots, rows, back))

    def _run(self) -> None:
        while (item := self.jobs.get()) is not None:
            job, slots, rows, back = item
            try:
                start, job.error = self.cache.load(slots, rows)  # an error is kept by the cache
                if back is not None:
                    self.cache.store(*back)  # likewise
                job.read_span = (start, perf_counter())
            except BaseException as exc:  # noqa: BLE001 - outside load and store: the cache cannot recover
                job.error = exc
                self.cache.break_down(exc)
            finally:
                job._done.set()

    def stop(self) -> None:
        """Let the reader finish the reads queued and end (joined)."""
        self.jobs.put(None)
        if self.thread is not threading.current_thread():
            self.thread.join()


def _close(reader: list, file: RowFile) -> None:
    if reader:
        reader.pop().stop()
    file.close()


class DiskRows:
    """This replica's partition of a table, in a file behind a :class:`RowCache`.

    Args:
        name: the table's name (file name, errors).
        replica: this replica's index (file name).
        shard_shape: ``(rows, c)`` of the partition.
        master_dtype: the weights' storage dtype.
        optimizer_spec: the table's spec or ``None``; ``"table"``/``"row"`` slots go to the file.
        storage: the :class:`~popdist_lite.embedding.storage.DiskStorage`.

    Attributes:
        weights: the file's weights as a ``(rows, c)`` memory map (valid after
            :meth:`sync`; writes to it are seen by the table after :meth:`sync`).
        slots: optimizer state, slot -> memory map (file slots) or array (replicated).
        stats: counters (:data:`STAT_NAMES`).

    Raises:
        CacheTooSmall: ``cache_bytes`` cannot hold one row.
        OSError: the file cannot be created (see :class:`RowFile`).
    """

    def __init__(self, name: str, replica: int, shard_shape: tuple, master_dtype, optimizer_spec, storage):
        rows, cols = shard_shape
        self.name, self.shard_shape, self.storage = name, tuple(shard_shape), storage
        trainable = optimizer_spec is not None and optimizer_spec.trainable
        self.pin = trainable
        probe = optimizer_spec.init_state((1, cols)) if trainable else {}
        layouts = optimizer_spec.state_layouts() if trainable else {}
        self.layouts = {slot: layouts.get(slot) or ("table" if a.shape == (1, cols) else "row" if a.shape == (1,)
                                                   else "replicated") for slot, a in probe.items()}
        fields = [("weights", np.dtype(master_dtype), (cols,))]
        for slot, array in probe.items():
            layout = self.layouts[slot]
            if layout == "table":
                fields.append((f"s/{slot}", array.dtype, (cols,)))
            elif layout == "row":
                fields.append((f"s/{slot}", array.dtype))
        self.record = np.dtype(fields)
        self.capacity = int(storage.cache_bytes) // (self.record.itemsize + SLOT_OVERHEAD)
        if self.capacity < 1:
            raise CacheTooSmall(f"host embedding {name!r}: DiskStorage: cache_bytes={storage.cache_bytes} cannot "
                                f"hold one row ({self.record.itemsize + SLOT_OVERHEAD} bytes)")
        self.stats = {name: (0.0 if name in _SECONDS else 0) for name in STAT_NAMES}
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)[:64]
        self.file = RowFile(storage.directory, f"popdist-{safe}-r{replica}-", self.record, rows, self.stats, name)
        self._reader: list = []  # the background reader, made at the first prefetch that reads
        self._closer = weakref.finalize(self, _close, self._reader, self.file)
        self._initial_state(optimizer_spec, probe, rows, cols)
        # count from the first lookup
        self.stats.update({name: (0.0 if name in _SECONDS else 0) for name in STAT_NAMES})
        self.cache = RowCache(self.file, min(self.capacity, rows), storage.cache_policy, self.stats)
        self.uses = 0  # updates (a trainable table) or lookups (else) so far: what a Prefetch's due counts
        self.jobs: collections.deque[Prefetch] = collections.deque()  # prefetches not yet let go, by due
        self._published: dict = {}  # the stats last added to the progress slot
        records = self.file.map()  # through the descriptor: the file has no name
        self.weights = records["weights"]
        self.slots = {slot: (records[f"s/{slot}"] if f"s/{slot}" in self.record.names else array)
                      for slot, array in self._replicated.items()}
        self.problem: Problem | None = None

    def _initial_state(self, spec, probe, rows: int, cols: int) -> None:
        """Write every record's initial optimizer state (zero weights), in chunks."""
        self._replicated = {}
        for slot, array in probe.items():
            if self.layouts[slot] == "replicated":
                self._replicated[slot] = spec.init_state((rows, cols))[slot]
            else:
                self._replicated[slot] = None  # a placeholder for the order of slots
        step = max(1, _CHUNK_BYTES // self.record.itemsize)
        for first in range(0, rows, step):
            n = min(step, rows - first)
            block = np.zeros(n, self.record)
            if probe:
                state = spec.init_state((n, cols))
                for slot in self.record.names[1:]:
                    block[slot] = state[slot[2:]]
            self.file.write_range(first, block)

    # -- lookups -----------------------------------------------------------------------
    def serving(self, dtype) -> "ServingRows":
        """The object lookups gather rows from (``take``, ``dtype``, ``shape``)."""
        return ServingRows(self, np.dtype(dtype))

    def take(self, indices, dtype, out=None) -> np.ndarray:
        """``weights[indices]`` in ``dtype`` (into ``out`` when given); never raises for
        the table's state: a problem is kept for :meth:`agree` (rows then read as zeros)."""
        indices = np.asarray(indices).reshape(-1)
        if out is None:
            out = np.empty((len(indices), self.shard_shape[1]), dtype)
        if not len(indices):
            return out
        unique, inverse = np.unique(indices, return_inverse=True)
        try:
            if self.problem is not None:
                raise CacheTooSmall(self.problem.message)
            slots = self.cache.slots(unique.astype(np.int64), self.pin)
        except (CacheTooSmall, CacheBroken, RowFileError, OSError) as exc:
            self._keep(exc)
            out[...] = 0
            return out
        np.copyto(out, self.cache.records["weights"][slots[inverse]], casting="unsafe")
        return out

    def _keep(self, exc: BaseException, prefetch: bool = False, background: bool = False) -> None:
        """Keep ``exc`` as this replica's problem for :meth:`agree` (the first one kept
        wins); ``background``: the background thread's."""
        if self.problem is None:
            if isinstance(exc, OSError):
                message = Problem.of(exc).message
            elif isinstance(exc, (CacheTooSmall, CacheBroken, RowFileError)):
                message = str(exc)
            else:
                message = f"{type(exc).__name__}: {exc}"
            if background and not isinstance(exc, CacheBroken):
                message = f"the background prefetch thread failed: {message}"
            if isinstance(exc, CacheTooSmall) and exc.rows:
                fewer = ("prefetch fewer batches ahead (the feed's prefetch_depth) or send fewer distinct IDs per "
                         "batch" if prefetch or self.jobs else "send fewer distinct IDs per call")
                message = (f"{message}; raise DiskStorage(cache_bytes={self.storage.cache_bytes}) to at least "
                           f"{exc.rows * (self.record.itemsize + SLOT_OVERHEAD)} or {fewer}")
            self.problem = Problem(ValueError if isinstance(exc, CacheTooSmall) else RuntimeError, message)

    def agree(self, comm) -> None:
        """Raise the first replica's kept problem on every replica (collective: one
        small agreement); the problem is forgotten, the cache's pins released. A
        failure of the background thread since the last agreement is such a problem
        (a failed write-back's records stay in the cache: see :class:`RowCache`)."""
        failure = self.cache.take_failure()
        if failure is not None:
            self._keep(failure, background=True)
        problem, self.problem = self.problem, None
        if problem is not None:
            self.cache.unpin()
        agree(_OP, _NOTHING, comm, problem=problem, same_from=0, what=f"host embedding {self.name!r} (disk storage)")

    # -- updates -----------------------------------------------------------------------
    def update(self, rows: np.ndarray, step, comm) -> None:
        """Read-modify-write of sorted unique local ``rows``: ``step(shard, state)`` gets
        the rows' weights ``(u, c)`` and state (slot -> ``(u, c)``/``(u,)`` arrays, the
        replicated slots whole) and returns ``(written positions, stored values)`` or
        ``None``. Collective (the agreement of :meth:`agree` comes first, so a problem
        on any replica writes nothing anywhere)."""
        slots = None
        try:
            if self.problem is None:
                slots = self.cache.slots(np.asarray(rows, np.int64), self.pin)
        except (CacheTooSmall, CacheBroken, RowFileError, OSError) as exc:
            self._keep(exc)
        self.agree(comm)
        block = self.cache.records[slots]
        state = {slot: (block[f"s/{slot}"] if array is None else array) for slot, array in self._replicated.items()}
        result = step(block["weights"], state)
        if result is not None:
            written, values = result
            block["weights"][written] = values
        with self.cache.lock:
            self.cache.records[slots] = block
            self.cache.dirty[slots] = True

    def unpin(self) -> None:
        self.cache.unpin()

    # -- prefetch ------------------------------------------------------------------------
    def prefetch(self, rows: np.ndarray, ahead: int) -> Prefetch:
        """Reserve sorted unique local ``rows`` in the cache, held until :attr:`uses`
        exceeds its value now by ``ahead``, and queue the read of the missing ones for
        the background reader, after the write-back of the dirty rows the reservation
        evicted. Never raises: a problem (a cache too small for the rows beside those
        pinned and held) is kept for :meth:`agree`, and the prefetch then holds nothing."""
        self.stats["prefetches"] += 1
        due = self.uses + ahead + 1
        try:
            if self.problem is not None:
                raise CacheTooSmall(self.problem.message)
            slots, new, new_rows, back = self.cache.reserve(np.asarray(rows, np.int64))
        except (CacheTooSmall, CacheBroken, RowFileError, OSError) as exc:
            self._keep(exc, prefetch=True)
            return Prefetch(_NOTHING, 0, due)
        job = Prefetch(slots, len(new), due)
        self.jobs.append(job)
        if len(new):
            if not self._reader:
                self._reader.append(_Reader(self.cache, self.name))
            self._reader[0].submit(job, new, new_rows, back)
        return job

    def used(self) -> None:
        """One more use of the table (an update, or a lookup of a table that is not
        trainable): let go of the prefetches now due."""
        self.uses += 1
        while self.jobs and self.jobs[0].due <= self.uses:
            job = self.jobs.popleft()
            if len(job.slots):
                self.cache.release(job.slots)
            self._record(job)

    def drop_prefetches(self) -> None:
        """Let go of every prefetch (their batches will not come: the feed ended):
        waits for their write-backs and reads."""
        self.cache.wait_loaded()
        while self.jobs:
            job = self.jobs.popleft()
            if len(job.slots):
                self.cache.release(job.slots)
            self._record(job)

    def unpublished(self) -> dict:
        """What :attr:`stats` gained since the last call (the counters of
        :data:`popdist_lite.progress.STORAGE_FIELDS`), for the progress slot's sums."""
        now = {name: self.stats[name] for name in progress.STORAGE_FIELDS}
        last, self._published = self._published, now
        return {name: now[name] - last.get(name, 0) for name in now}

    def wait_prefetches(self, timeout: float | None = None) -> bool:
        """Wait until every prefetch's reads are in the cache; False if ``timeout``
        (seconds) passed first."""
        return all(job.wait(timeout) for job in list(self.jobs))

    def _record(self, job: Prefetch) -> None:
        """The background read and write-back of ``job`` on the timeline (phase
        ``disk.prefetch``, from this thread: :mod:`popdist_lite.counters` is not for
        other threads)."""
        if job.read_span is not None and job.done:
            start, end = job.read_span
            counters.record("disk.prefetch", start, kind=counters.PHASE, detail=self.name, end=end)
            job.read_span = None

    # -- the whole partition -------------------------------------------------------------
    def sync(self) -> None:
        """Write every dirty row back and empty the cache: the file (and :attr:`weights`,
        :attr:`slots`) is then the partition's truth, and writes to the maps are seen by
        the next lookup.

        Raises:
            RowFileError: the file was truncated.
            CacheBroken: the background thread broke the cache.
        """
        self.file.check_size()
        self.cache.wait_loaded()
        self.cache.flush()
        self.cache.clear()
        for job in self.jobs:  # their holds are gone with the cache's rows
            job.slots = _NOTHING

    def release_pages(self) -> None:
        """Write back and drop the file's pages in the page cache (after whole-partition
        access through the maps). The pages this process touched through the maps are
        first unmapped from it (``MADV_DONTNEED``; the shared mapping's data is in the
        file after the flush): the kernel drops no page that is still mapped, so without
        this the advice would leave every page the maps touched in the page cache."""
        self.file.release_map()
        self.file.drop_pages()

    def close(self) -> None:
        """Close the file (its blocks are freed once no array of its maps is left; the
        table is unusable afterwards)."""
        self.weights = None
        self.slots = {}
        self.jobs.clear()
        self._closer()

    @property
    def file_bytes(self) -> int:
        return self.file.size


class ServingRows:
    """What a disk table's exchange gathers lookup rows from: numpy's ``take`` on the
    partition, in the lookup dtype (``np.take(rows, i, axis=0)`` calls it too)."""

    def __init__(self, rows: DiskRows, dtype: np.dtype):
        self.rows, self.dtype = rows, dtype
        self.shape = rows.shard_shape
        self.ndim = 2

    def take(self, indices, axis=0, out=None, mode="raise"):
        if axis != 0:
            raise ValueError("disk table rows: take supports axis=0 only")
        return self.rows.take(indices, self.dtype, out)
