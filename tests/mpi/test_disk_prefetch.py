"""Prefetch of disk-table rows (HostEmbedding.prefetch, Infeed.prefetch_rows) at every
replica count: training with the feed's prefetch is bit-identical to the in-memory
table; a step whose prefetch has completed (waited on, never on time) looks up
without a miss, and the same step without prefetch misses; a cache just big enough for
the batches in flight never evicts a prefetched row before its update; a cache too
small for them is an error on every replica; the counters reach the timeline; a failed
background read and a failure anywhere in the background thread (a MemoryError) are
raised on every replica by the next agreement, and nothing waits for ever."""

import threading

import numpy as np
import pytest

import popdist_lite as pl
from popdist_lite import counters

from disk_cache import cache_bytes

T, E, IDS, STEPS, DEPTH = 1200, 8, 16, 200, 3
DEADLINE = 120  # seconds; only reached when the code under test is wrong
SPECS = {"sgd": lambda: pl.HostEmbeddingOptimizerSpec(0.3),
         "adam": lambda: pl.HostEmbeddingAdamOptimizerSpec(0.05, beta1=0.9, beta2=0.99, epsilon=1e-8)}
PRECISIONS = {"fp32": {"dtype": np.float32},
              "fp16": {"dtype": np.float16, "stochastic_rounding": "ON"},
              "fp16/master32": {"dtype": np.float16, "master_weights": np.float32}}


def storage(kw, spec, r, rows, tmp_path):
    """A DiskStorage whose cache holds exactly ``rows`` records."""
    return pl.DiskStorage(cache_bytes(kw, spec, E, r, rows), directory=str(tmp_path))


def recommender(dtype, steps=STEPS):
    """The recommender-style batches: per replica per step IDS Zipf(1.1) IDs (hot rows,
    duplicates; every other one uniform, so the steps touch more rows than the cache
    holds) and their gradients, drawn from a generator seeded by (step, replica)."""
    def make_dataset(replica, replicas):
        for step in range(steps):
            rng = np.random.default_rng([step, replica])
            ids = np.minimum(rng.zipf(1.1, size=IDS) - 1, T - 1)
            ids[::2] = rng.integers(0, T, size=IDS)[::2]
            yield {"ids": ids, "grads": rng.standard_normal((IDS, E)).astype(dtype)}
    return make_dataset


@pytest.mark.mpi
@pytest.mark.parametrize("strategy, spec_name, precision", [("TOKEN", "sgd", "fp32"), ("TOKEN", "adam", "fp16"),
                                                            ("ENCODING", "sgd", "fp16/master32"),
                                                            ("ENCODING", "adam", "fp32")])
def test_feed_prefetch_is_bit_identical(strategy, spec_name, precision, comm, tmp_path):
    """200 steps from a feed that prefetches the disk table's rows DEPTH batches ahead,
    a cache of DEPTH + 1 batches' worst case (a fraction of the partition), the whole
    table read (the cache written back and emptied) mid-way: every lookup, the weights
    and the optimizer state equal the in-memory table's bit for bit."""
    r = comm.size
    kw = {"partition_strategy": strategy, **PRECISIONS[precision]}
    spec = SPECS[spec_name]()
    memory = pl.create_host_embedding("p-m", [T, E], optimizer_spec=spec, seed=3, **kw)
    rows = (DEPTH + 1) * IDS * r + 4
    disk = pl.create_host_embedding("p-d", [T, E], optimizer_spec=spec, seed=3,
                                    storage=storage(kw, spec, r, rows, tmp_path), **kw)
    partition = T if strategy == "ENCODING" else -(-T // r)
    assert disk.storage_stats["cache_rows"] == min(rows, partition)
    feed = pl.infeed(recommender(kw["dtype"]), prefetch_depth=DEPTH).prefetch_rows(disk, "ids")
    steps = 0
    for batch in feed:
        a, b = memory.lookup(batch["ids"]), disk.lookup(batch["ids"])
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), f"step {steps}"
        memory.apply_gradients(batch["ids"], batch["grads"])
        disk.apply_gradients(batch["ids"], batch["grads"])
        steps += 1
        if steps == STEPS // 2:  # a checkpoint's write-back mid-way empties the cache under the prefetches
            assert memory.get_embedding_tensor().tobytes() == disk.get_embedding_tensor().tobytes()
    assert steps == STEPS
    stats = disk.storage_stats
    # the first step prefetches batches 1..DEPTH, every later one the batch DEPTH ahead
    assert stats["prefetches"] == DEPTH + STEPS - 1
    assert stats["prefetched_rows"] > 0 and stats["hits"] > 0
    if partition > stats["cache_rows"]:
        assert stats["evictions"] > 0
    cache = disk._disk.cache
    assert not disk._disk.jobs and not cache.held.any() and not cache.loading.any()  # all let go at the end
    for master in (True, False):
        want = memory.get_embedding_tensor(master=master)
        assert want.tobytes() == disk.get_embedding_tensor(master=master).tobytes()
    a, b = memory.state().arrays, disk.state().arrays
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].tobytes() == np.asarray(b[key]).tobytes(), key


def cold_batch(step, r, k, per_owner):
    """Replica ``k``'s IDs of a batch of rows no earlier batch touched: TOKEN owner ``o``
    gets ``per_owner`` IDs ``o + r * row`` whose local rows ``row`` are its own range,
    apart from every other owner's (so an ID's ``id // r`` on a replica that does not
    own it is no row of that replica's batch); each replica looks up ``per_owner`` of
    the global batch, from every owner in turn."""
    rows = step * per_owner * r + np.arange(r)[:, None] * per_owner + np.arange(per_owner)  # (owner, i)
    ids = (np.arange(r)[:, None] + r * rows).T.reshape(-1)  # ordered (i, owner)
    return ids[k * per_owner:(k + 1) * per_owner]


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["TOKEN", "TOKEN/dense", "ENCODING"])
def test_completed_prefetch_means_no_misses(strategy, comm, tmp_path):
    """Cold batches: without prefetch every distinct row of the step misses; with the
    batch prefetched a step ahead and the prefetch waited for, its lookup and update
    hit every row and read nothing (the prefetch is made after a step's update, so the
    next update is its batch's: ahead=0)."""
    r, k = comm.size, comm.rank
    name, _, exchange = strategy.partition("/")
    kw = {"partition_strategy": name, "dtype": np.float32, **({"exchange": exchange} if exchange else {})}
    spec = SPECS["adam"]()
    per_owner = 6
    local = per_owner if name == "TOKEN" else per_owner * r  # rows of a batch on this replica
    memory = pl.create_host_embedding("n-m", [T, E], optimizer_spec=spec, seed=4, **kw)
    disk = pl.create_host_embedding("n-d", [T, E], optimizer_spec=spec, seed=4,
                                    storage=storage(kw, spec, r, 3 * local, tmp_path), **kw)
    grads = np.full((per_owner, E), 0.25, np.float32)
    for step in range(8):
        ids = cold_batch(step, r, k, per_owner)
        prefetch = step % 2 == 1  # odd steps were prefetched during the step before
        before = dict(disk.storage_stats)
        a, b = memory.lookup(ids), disk.lookup(ids)
        memory.apply_gradients(ids, grads)
        disk.apply_gradients(ids, grads)
        assert a.tobytes() == b.tobytes()
        after = disk.storage_stats
        misses, hits = after["misses"] - before["misses"], after["hits"] - before["hits"]
        read = after["rows_read"] - before["rows_read"]
        if prefetch:
            assert (misses, hits, read) == (0, 2 * local, 0), f"step {step}"
        else:
            assert misses == local and read == local, f"step {step}"  # the lookup's; the update hits
        if step % 2 == 0:  # prefetch the next (cold) batch, then wait for it: never on time
            handle = disk.prefetch(cold_batch(step + 1, r, k, per_owner), ahead=0)
            assert handle.rows == local and handle.reads == local
            assert handle.wait(timeout=120) and handle.done
            assert disk.storage_stats["prefetched_rows"] - after["prefetched_rows"] == local
    assert memory.get_embedding_tensor().tobytes() == disk.get_embedding_tensor().tobytes()
    assert memory.prefetch(cold_batch(0, r, k, per_owner)) is None  # an in-memory table: nothing to do
    assert memory.wait_prefetch(0)


@pytest.mark.mpi
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_feed_prefetch_with_a_cache_just_big_enough(policy, comm, tmp_path):
    """Cold batches of ``per_owner`` rows per replica through a feed of depth 2; the
    cache holds exactly 3 batches (the one stepping and the 2 ahead). Prefetched rows are
    held until their update: once the step's prefetch is waited for (wait_prefetch),
    its lookup misses nothing; had a later prefetch evicted them (its new rows score
    lowest), it would miss. Then the same with a cache one row smaller: a ValueError on
    every replica."""
    r, k = comm.size, comm.rank
    depth, per_owner, steps = 2, 5, 12
    kw = {"partition_strategy": "TOKEN", "dtype": np.float32}
    spec = SPECS["sgd"]()

    def make_dataset(replica, replicas):
        for step in range(steps):
            yield {"ids": cold_batch(step, replicas, replica, per_owner)}

    memory = pl.create_host_embedding("j-m", [T, E], optimizer_spec=spec, seed=5, **kw)
    disk = pl.create_host_embedding("j-d", [T, E], optimizer_spec=spec, seed=5,
                                    storage=storage(kw, spec, r, (depth + 1) * per_owner, tmp_path), **kw)
    disk.storage_stats["misses"]  # noqa: B018 - a disk table
    grads = np.ones((per_owner, E), np.float32)
    feed = pl.infeed(make_dataset, prefetch_depth=depth).prefetch_rows(disk, "ids").prefetch_rows(memory, "ids")
    for step, batch in enumerate(feed):
        assert disk.wait_prefetch(timeout=120)
        before = disk.storage_stats["misses"]
        a, b = memory.lookup(batch["ids"]), disk.lookup(batch["ids"])
        assert a.tobytes() == b.tobytes()
        misses = disk.storage_stats["misses"] - before
        assert misses == (per_owner if step == 0 else 0), f"step {step}: {misses} misses"  # step 0: not prefetched
        memory.apply_gradients(batch["ids"], grads)
        disk.apply_gradients(batch["ids"], grads)
    assert disk.storage_stats["evictions"] > 0  # the cache was full: rows went
    assert memory.get_embedding_tensor().tobytes() == disk.get_embedding_tensor().tobytes()

    small = pl.create_host_embedding("j-s", [T, E], optimizer_spec=spec, seed=5,
                                     storage=storage(kw, spec, r, (depth + 1) * per_owner - 1, tmp_path), **kw)
    feed = pl.infeed(make_dataset, prefetch_depth=depth).prefetch_rows(small, "ids")
    with pytest.raises(ValueError, match=r"replica \d+: the cache holds 14 rows; .* held by prefetches in flight"
                                         r".*prefetch fewer batches ahead"):
        for batch in feed:
            small.lookup(batch["ids"])
            small.apply_gradients(batch["ids"], grads)
    feed.close()


@pytest.mark.mpi
def test_prefetch_errors_on_every_replica(comm, tmp_path):
    r, k = comm.size, comm.rank
    kw = {"partition_strategy": "TOKEN", "dtype": np.float32}
    spec = SPECS["sgd"]()
    disk = pl.create_host_embedding("e-d", [T, E], optimizer_spec=spec, seed=6,
                                    storage=storage(kw, spec, r, 8, tmp_path), **kw)
    bad = np.zeros(3, np.float32) if k == r - 1 else np.zeros(3, np.int64)
    with pytest.raises(TypeError, match=f"replica {r - 1}: .*prefetch: argument indices: expected an integer"):
        disk.prefetch(bad)
    with pytest.raises(ValueError, match="argument ahead"):
        disk.prefetch(np.zeros(1, np.int64), ahead=-1)
    many = np.arange(r * 9) if k == 0 else np.zeros(0, np.int64)  # 9 rows on every owner: 8 fit
    with pytest.raises(ValueError, match=r"replica \d+: the cache holds 8 rows"):
        disk.prefetch(many)
    assert not disk._disk.cache.held.any()  # a refused prefetch holds nothing
    disk.prefetch(np.arange(r * 4), ahead=0).wait(120)  # the table still prefetches what fits
    disk.lookup(np.arange(r * 4))
    disk.apply_gradients(np.arange(r * 4), np.ones((r * 4, E), np.float32))
    assert not disk._disk.cache.held.any()


@pytest.mark.mpi
def test_counters_on_the_timeline(comm, tmp_path):
    """With the timeline on, each lookup and update of a disk table leaves a counter
    event with the cache counters, and each background read a disk.prefetch phase."""
    r, k = comm.size, comm.rank
    kw = {"partition_strategy": "TOKEN", "dtype": np.float32}
    spec = SPECS["sgd"]()
    disk = pl.create_host_embedding("c-d", [T, E], optimizer_spec=spec, seed=7,
                                    storage=storage(kw, spec, r, 64, tmp_path), **kw)
    saved, counters.events = counters.events, []
    try:
        ids = cold_batch(0, r, k, 4)
        disk.prefetch(ids, ahead=0).wait(120)
        disk.lookup(ids)
        disk.apply_gradients(ids, np.ones((4, E), np.float32))
        events = counters.events
    finally:
        counters.events = saved
    samples = [e for e in events if e[1] == counters.COUNTER and e[0] == "disk c-d"]
    assert len(samples) == 2  # after the lookup and after the update
    last = samples[-1][6]
    assert last == {name: disk.storage_stats[name] for name in last}
    assert last["prefetched_rows"] == 4 and last["hits"] == 8 and last["misses"] == 0
    phases = [e[0] for e in events if e[1] == counters.PHASE]
    assert "prefetch" in phases and "disk.prefetch" in phases
    from popdist_lite.timeline import chrome_events

    chrome = [e for e in chrome_events(events, k, (0.0, 0.0)) if e.get("ph") == "C"]
    assert len(chrome) == 2 and chrome[-1]["args"]["prefetched_rows"] == 4


@pytest.mark.mpi
def test_failed_prefetch_read_is_met_by_the_lookup_on_every_replica(comm, tmp_path):
    """Replica 0's partition file is cut short: its prefetch's background read fails
    (the handle says so, the rows are not left in the cache as if read), and the lookup
    that then reads them itself raises the short read on every replica."""
    import os

    r, k = comm.size, comm.rank
    kw = {"partition_strategy": "TOKEN", "dtype": np.float32}
    spec = SPECS["sgd"]()
    disk = pl.create_host_embedding("f-d", [T, E], optimizer_spec=spec, seed=8,
                                    storage=storage(kw, spec, r, 32, tmp_path), **kw)
    if k == 0:
        os.ftruncate(disk._disk.file.fd, 100)
    comm.Barrier()
    ids = cold_batch(1, r, k, 4)
    handle = disk.prefetch(ids, ahead=0)
    assert handle.wait(timeout=120)
    assert (handle.error is not None) == (k == 0)
    if k == 0:
        assert (disk._disk.cache.row_of == -1).all()  # nothing kept of the failed read
    with pytest.raises(RuntimeError, match=r"replica 0: short read .* truncated"):
        disk.lookup(ids)
    disk.drop_prefetches()
    assert not disk._disk.cache.held.any()  # each hold dropped once: none left, none negative


def _fail_in_the_background(disk, where, gate):
    """Make the table's background thread meet ``MemoryError("injected")`` once it is let
    through ``gate`` (after the prefetch call, whose own agreement comes first):
    ``"read"`` in its read of the rows, ``"publish"`` in counting them once they are in
    the cache, ``"thread"`` in the thread itself, outside the cache's read and write."""
    rows = disk._disk
    read, count, load = rows.file.read, rows.file.count, rows.cache.load

    def held_read(rows_, out, count=True):
        if not count:  # the background thread's (uncounted) read
            assert gate.wait(DEADLINE)
            if where == "read":
                raise MemoryError("injected")
        return read(rows_, out, count)

    def failing_count(what, rows_, start, phase=True):
        if not phase and where == "publish":  # the background thread's count
            raise MemoryError("injected")
        return count(what, rows_, start, phase)

    def failing_load(slots, rows_):
        assert gate.wait(DEADLINE)
        raise MemoryError("injected")

    rows.file.read, rows.file.count = held_read, failing_count
    if where == "thread":
        rows.cache.load = failing_load


@pytest.mark.mpi
@pytest.mark.parametrize("where", ["read", "publish", "thread"])
def test_background_thread_failure_is_raised_on_every_replica(where, comm, tmp_path):
    """The last replica's background thread meets a MemoryError while it prefetches a
    cold batch: its prefetch handle is done and says so, the lookup of the batch does
    not wait for ever, and its agreement raises the error on every replica, once,
    naming the replica. After a failure in the read or in counting it, the table
    serves and trains on as its in-memory twin (the lookup read the rows itself, or
    they were in place); after one in the thread itself, rows may be left half-read,
    so every later call raises on every replica that the table must be made again."""
    r, k = comm.size, comm.rank
    last = r - 1
    kw = {"partition_strategy": "TOKEN", "dtype": np.float32}
    spec = SPECS["sgd"]()
    memory = pl.create_host_embedding("b-m", [T, E], optimizer_spec=spec, seed=8, **kw)
    disk = pl.create_host_embedding("b-d", [T, E], optimizer_spec=spec, seed=8,
                                    storage=storage(kw, spec, r, 32, tmp_path), **kw)
    gate = threading.Event()
    if k == last:
        _fail_in_the_background(disk, where, gate)
    ids = cold_batch(0, r, k, 4)
    handle = disk.prefetch(ids, ahead=0)
    gate.set()
    assert handle.wait(timeout=DEADLINE)
    assert isinstance(handle.error, MemoryError) if k == last else handle.error is None
    failed = rf"host embedding 'b-d' \(disk storage\): replica {last}: "
    if where == "thread":
        broken = failed + r"the cache of rows is unusable: its background thread failed \(MemoryError: injected\)"
        with pytest.raises(RuntimeError, match=broken):
            disk.lookup(ids)
        with pytest.raises(RuntimeError, match=broken):  # and so is every later call
            disk.lookup(ids)
        return
    with pytest.raises(RuntimeError, match=failed + "the background prefetch thread failed: MemoryError: injected"):
        disk.lookup(ids)
    grads = np.full((len(ids), E), 0.5, np.float32)
    assert disk.lookup(ids).tobytes() == memory.lookup(ids).tobytes()  # raised once
    for table in (memory, disk):
        table.apply_gradients(ids, grads)
    assert disk.get_embedding_tensor().tobytes() == memory.get_embedding_tensor().tobytes()
