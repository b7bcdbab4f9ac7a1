"""A prefetch's write-back of the dirty rows its reservation evicts, done by the table's
background thread (popdist_lite/embedding/storage/cache.py, disk.py), one process on
MPI.COMM_SELF, every value against a numpy reference of the table:

- the evicted rows looked up while the background thread is still held in their
  write-back are served the updated values (the lookup waits for the write-back);
- the prefetch call returns while its write-back is still held: the training loop
  wrote nothing, the background thread wrote and counted every evicted row;
- the background thread reads a prefetch's rows before it writes back the rows the
  prefetch evicted: with that write-back held, the batch is in the cache already and a
  lookup of it waits for nothing;
- a background write-back that fails (ENOSPC) keeps its records: the evicted rows read
  back updated (by a lookup and by a later prefetch), the error is raised by the next
  agreement, and the sync afterwards writes every row to the file; when even keeping
  them fails (a MemoryError), the table is broken: every later call says so.

The background thread is held by an event inside the file's write (the uncounted
writes, ``count=False``, are the background thread's), and the lookup's wait is seen
through the cache's condition, so nothing here depends on timing.
"""

import errno
import threading

import numpy as np
import pytest
from mpi4py import MPI

from popdist_lite.embedding.storage import DiskStorage
from popdist_lite.embedding.storage.cache import SLOT_OVERHEAD
from popdist_lite.embedding.storage.disk import DiskRows

ROWS, COLS, CAPACITY = 64, 4, 12
DEADLINE = 60  # seconds; only reached when the code under test is wrong
COMM = MPI.COMM_SELF


class _SeenCondition(threading.Condition):
    """The cache's condition, noting that someone waited on it."""

    def __init__(self, lock):
        super().__init__(lock)
        self.waited = threading.Event()

    def wait(self, timeout=None):
        self.waited.set()
        return super().wait(timeout)


@pytest.fixture
def table(tmp_path):
    storage = DiskStorage(cache_bytes=CAPACITY * (COLS * 4 + SLOT_OVERHEAD), directory=tmp_path)
    rows = DiskRows("t", 0, (ROWS, COLS), np.float32, None, storage)
    assert rows.cache.capacity == CAPACITY
    rows.cache.loaded = _SeenCondition(rows.cache.lock)
    yield rows
    rows.close()


def _background_writes(table, behave):
    """Route the file's uncounted writes (the background thread's) through ``behave(rows)``
    before writing; the counted ones (the training loop's) are written as they are."""
    write = table.file.write

    def routed(rows, records, count=True):
        if count:
            return write(rows, records)
        behave(rows)
        return write(rows, records, count=False)

    table.file.write = routed


def _hold_background_writes(table, written=None):
    """Hold the background thread inside each of its writes until the returned ``gate``
    is set; ``writing`` is set once it is held (``written``: a list the held writes'
    row counts are appended to once let go). Returns ``(writing, gate)``."""
    writing, gate = threading.Event(), threading.Event()

    def hold(rows):
        writing.set()
        assert gate.wait(DEADLINE)
        if written is not None:
            written.append(len(rows))

    _background_writes(table, hold)
    return writing, gate


def _train(table, reference, rows, seed):
    """One update of ``rows`` (adding random values) on the table and the reference."""
    rows = np.asarray(rows, np.int64)
    delta = np.random.default_rng(seed).standard_normal((len(rows), COLS), dtype=np.float32)
    table.update(rows, lambda weights, state: (np.arange(len(rows)), weights + delta), COMM)
    reference[rows] += delta


def _evicted(table, rows):
    return np.array([r for r in rows if table.cache.slot_of[r] < 0], np.int64)


def _lookup(table, rows):
    out = table.take(np.asarray(rows, np.int64), np.float32)
    assert table.problem is None, table.problem.message
    return out


def test_rows_evicted_by_a_prefetch_read_back_updated_while_their_write_back_is_held(table):
    reference = np.zeros((ROWS, COLS), np.float32)
    writing, gate = _hold_background_writes(table)
    _train(table, reference, np.arange(CAPACITY), seed=1)  # every slot dirty
    table.prefetch(np.arange(40, 46), ahead=1)  # evicts 6 dirty rows
    evicted = _evicted(table, np.arange(CAPACITY))
    assert len(evicted) == 6
    assert writing.wait(DEADLINE), "the prefetch's write-back did not reach the background thread"

    def open_once_the_lookup_waits():
        table.cache.loaded.waited.wait(DEADLINE)
        gate.set()

    opener = threading.Thread(target=open_once_the_lookup_waits, daemon=True)
    opener.start()
    try:
        got = _lookup(table, evicted)
    finally:
        gate.set()
        opener.join(DEADLINE)
    np.testing.assert_array_equal(got, reference[evicted])
    assert table.wait_prefetches(DEADLINE)
    np.testing.assert_array_equal(_lookup(table, np.arange(ROWS)[:CAPACITY // 2]), reference[:CAPACITY // 2])


def test_the_prefetch_returns_before_its_write_back_which_the_background_thread_counts(table):
    reference = np.zeros((ROWS, COLS), np.float32)
    written = []
    writing, gate = _hold_background_writes(table, written)
    _train(table, reference, np.arange(CAPACITY), seed=2)
    try:
        job = table.prefetch(np.arange(40, 46), ahead=1)  # returns with the write-back held
        assert writing.wait(DEADLINE)
        assert table.stats["rows_written"] == 0 and not job.done  # the training loop wrote nothing
        evicted = _evicted(table, np.arange(CAPACITY))
    finally:
        gate.set()
    assert job.wait(DEADLINE)
    table.cache.wait_loaded()
    assert written == [6]
    assert table.stats["rows_written"] == 6
    assert table.stats["bytes_written"] == 6 * table.record.itemsize
    assert table.stats["prefetched_rows"] == 6
    np.testing.assert_array_equal(table.file.read_range(0, ROWS)["weights"][evicted], reference[evicted])


def test_a_prefetch_reads_its_rows_before_it_writes_back_its_victims(table):
    reference = np.zeros((ROWS, COLS), np.float32)
    writing, gate = _hold_background_writes(table)
    _train(table, reference, np.arange(CAPACITY), seed=4)
    batch = np.arange(40, 46)
    try:
        table.prefetch(batch, ahead=1)  # evicts 6 dirty rows
        assert writing.wait(DEADLINE), "the prefetch's write-back did not reach the background thread"
        slots = table.cache.slot_of[batch]
        assert (slots >= 0).all() and not table.cache.loading[slots].any()  # read before the write-back
        table.cache.loaded.waited.clear()
        np.testing.assert_array_equal(_lookup(table, batch), reference[batch])
        assert not table.cache.loaded.waited.is_set()  # served from the cache, no wait
    finally:
        gate.set()
    assert table.wait_prefetches(DEADLINE)


def test_a_failed_background_write_back_is_kept_served_and_raised_by_the_next_agreement(table):
    reference = np.zeros((ROWS, COLS), np.float32)

    def fail(rows):
        raise OSError(errno.ENOSPC, "No space left on device (ENOSPC) writing rows of the partition file",
                      table.file.name)

    _background_writes(table, fail)
    _train(table, reference, np.arange(CAPACITY), seed=3)
    assert table.prefetch(np.arange(40, 46), ahead=1).wait(DEADLINE)
    evicted = _evicted(table, np.arange(CAPACITY))
    assert len(evicted) == 6
    assert not table.file.read_range(0, ROWS)["weights"][evicted].any()  # the file's bytes are stale
    first, later = evicted[:3], evicted[3:]
    np.testing.assert_array_equal(_lookup(table, first), reference[first])  # a lookup's read: the kept records
    with pytest.raises(RuntimeError, match="ENOSPC"):
        table.agree(COMM)
    table.agree(COMM)  # raised once
    # a later prefetch of kept rows reads them from the kept records too (its own
    # write-back of 3 more dirty rows fails again and is kept beside them)
    job = table.prefetch(later, ahead=1)
    assert job.reads == 3 and job.wait(DEADLINE)
    np.testing.assert_array_equal(_lookup(table, later), reference[later])
    with pytest.raises(RuntimeError, match="ENOSPC"):
        table.agree(COMM)
    assert table.cache.unwritten is not None
    table.drop_prefetches()
    _train(table, reference, np.concatenate((first, later)), seed=4)
    table.sync()  # the kept records and every dirty row go to the file
    assert table.cache.unwritten is None
    np.testing.assert_array_equal(np.asarray(table.weights), reference)
    np.testing.assert_array_equal(_lookup(table, np.arange(ROWS)[::6]), reference[::6])


def test_a_failed_write_back_whose_records_cannot_be_kept_breaks_the_table(table):
    """The write-back fails and keeping its records fails too (a MemoryError): those rows
    are nowhere, so the next agreement raises the write's error and every later call
    that the table must be made again; the background thread is done, nothing waits."""
    reference = np.zeros((ROWS, COLS), np.float32)

    def fail(rows):
        raise OSError(errno.ENOSPC, "No space left on device (ENOSPC) writing rows of the partition file",
                      table.file.name)

    def no_memory(rows, records):
        raise MemoryError("injected")

    _background_writes(table, fail)
    table.cache._keep_unwritten = no_memory
    _train(table, reference, np.arange(CAPACITY), seed=5)
    assert table.prefetch(np.arange(40, 46), ahead=1).wait(DEADLINE)
    with pytest.raises(RuntimeError, match="ENOSPC"):
        table.agree(COMM)
    broken = r"the cache of rows is unusable: its background thread failed \(MemoryError: injected\)"
    table.take(np.arange(3), np.float32)
    with pytest.raises(RuntimeError, match=broken):
        table.agree(COMM)
    with pytest.raises(RuntimeError, match=broken):
        table.sync()
