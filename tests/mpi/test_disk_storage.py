"""Disk-backed host embedding tables (DiskStorage) against the in-memory table, at
every replica count: the same lookups and the same weights and optimizer state, bit
for bit, with a cache a fraction of the partition so rows are evicted and read back;
the errors of a cache too small, a truncated partition file, a directory that cannot
be written or that another user could change; a partition file with no name in its
directory; checkpoints between disk and in-memory tables, resharded."""

import dataclasses
import mmap
import os

import numpy as np
import pytest

import popdist_lite as pl
from popdist_lite.embedding.optimizer_specs import EmbeddingOptimizerSpec

import disk_cache

T, E, IDS = 240, 8, 16
STRATEGIES = ["TOKEN", "TOKEN/dense", "ENCODING"]
SPECS = {"sgd": lambda: pl.HostEmbeddingOptimizerSpec(0.3),
         "adam": lambda: pl.HostEmbeddingAdamOptimizerSpec(0.05, beta1=0.9, beta2=0.99, epsilon=1e-8),
         "adagrad_rowwise": lambda: pl.HostEmbeddingAdagradOptimizerSpec(0.5, rowwise=True),
         "momentum": lambda: pl.HostEmbeddingMomentumOptimizerSpec(0.2, momentum=0.8)}
PRECISIONS = {"fp32": {"dtype": np.float32},
              "fp16": {"dtype": np.float16, "stochastic_rounding": "ON"},
              "fp16/master32": {"dtype": np.float16, "master_weights": np.float32}}


def layout(strategy):
    name, _, exchange = strategy.partition("/")
    return {"partition_strategy": name, **({"exchange": exchange} if exchange else {})}


def cache_rows(r):
    """Slots above one call's distinct rows on a replica (at most every replica's IDs)."""
    return IDS * r + 4


def cache_bytes(table_kwargs, spec, r, rows=None):
    """``rows`` cache slots (default :func:`cache_rows`) of a table's records."""
    return disk_cache.cache_bytes(table_kwargs, spec, E, r, cache_rows(r) if rows is None else rows)


def zipf_ids(rng, n):
    """Zipf(1.1) IDs (hot rows, duplicates) and, every other one, uniform ones (so that
    more rows are touched than the cache holds)."""
    ids = np.minimum(rng.zipf(1.1, size=n) - 1, T - 1)
    ids.reshape(-1)[::2] = rng.integers(0, T, size=ids.size)[::2]
    return ids


def make_pair(name, strategy, spec_name, precision, comm, tmp_path, policy="lru", rows=None, **extra):
    kw = {**layout(strategy), **PRECISIONS[precision], **extra}
    spec = SPECS[spec_name]()
    memory = pl.create_host_embedding(f"{name}-m", [T, E], optimizer_spec=spec, seed=3, **kw)
    storage = pl.DiskStorage(cache_bytes(kw, spec, comm.size, rows), cache_policy=policy, directory=str(tmp_path))
    disk = pl.create_host_embedding(f"{name}-m", [T, E], optimizer_spec=spec, seed=3, storage=storage, **kw)
    return memory, disk


def mapped(array) -> bool:
    """Whether ``array`` is a view of a memory map (of a file)."""
    while isinstance(array, np.ndarray):
        array = array.base
    return isinstance(array, mmap.mmap)


def assert_same_state(memory, disk):
    a, b = memory.state().arrays, disk.state().arrays
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert a[key].tobytes() == np.asarray(b[key]).tobytes(), key


@pytest.mark.mpi
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("spec_name", ["sgd", "adam"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_training_is_bit_identical(strategy, spec_name, precision, comm, tmp_path):
    r, k = comm.size, comm.rank
    policy = "lfu" if spec_name == "adam" else "lru"
    memory, disk = make_pair("t", strategy, spec_name, precision, comm, tmp_path, policy)
    rng = np.random.default_rng(7)
    dtype = PRECISIONS[precision]["dtype"]
    for step in range(25):
        ids = zipf_ids(rng, (r, IDS))[k]
        grads = rng.standard_normal((r, IDS, E)).astype(dtype)[k]
        a, b = memory.lookup(ids), disk.lookup(ids)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), f"step {step}"
        memory.apply_gradients(ids, grads)
        disk.apply_gradients(ids, grads)
    assert memory.get_embedding_tensor(master=True).tobytes() == disk.get_embedding_tensor(master=True).tobytes()
    assert memory.get_embedding_tensor().tobytes() == disk.get_embedding_tensor().tobytes()
    assert_same_state(memory, disk)
    stats = disk.storage_stats
    assert stats["hits"] > 0 and stats["misses"] > 0 and stats["rows_read"] > 0
    rows = T if strategy == "ENCODING" else -(-T // r)
    if rows > stats["cache_rows"]:  # a partition larger than the cache: rows went to disk and back
        assert stats["evictions"] > 0 and stats["rows_written"] > 0
    assert memory.storage_stats is None
    phases = pl.stats()["phases"]  # the file's reads and writes on the timeline's phases
    assert phases["disk.read"]["calls"] > 0 and phases["disk.read"]["seconds"] > 0


@pytest.mark.mpi
@pytest.mark.parametrize("spec_name", ["adagrad_rowwise", "momentum"])
@pytest.mark.parametrize("strategy", ["TOKEN", "ENCODING"])
def test_bags_limits_and_other_optimizers(strategy, spec_name, comm, tmp_path):
    """Pooled bags (mean combiner), ID limits with minibatching (TOKEN), row-wise Adagrad
    (a cross-replica row sum with ENCODING) and momentum, a loss scale."""
    r, k = comm.size, comm.rank
    extra = {"max_unique_ids_per_partition": 4, "enable_minibatching": True} if strategy == "TOKEN" else {}
    memory, disk = make_pair("b", strategy, spec_name, "fp32", comm, tmp_path, **extra)
    rng = np.random.default_rng(11)
    for step in range(12):
        values = zipf_ids(rng, (r, 3, 5))[k]
        grads = rng.standard_normal((r, 3, E)).astype(np.float32)[k]
        a = memory.lookup_bags(values, combiner="mean", padding_id=0)
        b = disk.lookup_bags(values, combiner="mean", padding_id=0)
        assert a.tobytes() == b.tobytes(), f"step {step}"
        memory.apply_bag_gradients(values, grads, combiner="mean", padding_id=0, loss_scale=4.0)
        disk.apply_bag_gradients(values, grads, combiner="mean", padding_id=0, loss_scale=4.0)
    assert_same_state(memory, disk)


@pytest.mark.mpi
def test_cache_smaller_than_a_batch_fails_on_every_replica(comm, tmp_path):
    r, k = comm.size, comm.rank
    spec = SPECS["sgd"]()
    kw = {"partition_strategy": "TOKEN", "dtype": np.float32}
    table = pl.create_host_embedding("small", [T, E], optimizer_spec=spec, seed=1,
                                     storage=pl.DiskStorage(cache_bytes(kw, spec, r, rows=3),
                                                            directory=str(tmp_path)))
    before = table.get_embedding_tensor()
    ids = (np.arange(IDS) * r + k) if k == 0 else np.zeros(1, np.int64)  # replica 0 sends 16 rows to itself
    with pytest.raises(ValueError, match=r"disk storage\): replica 0: the cache holds 3 rows; this call needs"):
        table.lookup(ids)
    with pytest.raises(ValueError, match="replica 0: the cache holds 3 rows"):
        table.apply_gradients(ids, np.ones(ids.shape + (E,), np.float32))
    assert table.get_embedding_tensor().tobytes() == before.tobytes()  # nothing was updated
    small = np.array([k % T])
    table.lookup(small)  # the table still works for calls that fit
    table.apply_gradients(small, np.ones((1, E), np.float32))


@pytest.mark.mpi
def test_truncated_partition_file_fails_on_every_replica(comm, tmp_path):
    spec = SPECS["sgd"]()
    kw = {"partition_strategy": "TOKEN", "dtype": np.float32}
    table = pl.create_host_embedding("cut", [T, E], optimizer_spec=spec, seed=1,
                                     storage=pl.DiskStorage(cache_bytes(kw, spec, comm.size), directory=str(tmp_path)))
    if comm.rank == 0:
        os.ftruncate(table._disk.file.fd, 100)
    comm.Barrier()
    ids = np.arange(comm.size * 4)  # every replica reads rows of every partition (cold cache)
    with pytest.raises(RuntimeError, match=r"replica 0: short read .* truncated"):
        table.lookup(ids)
    if comm.rank == 0:
        with pytest.raises(RuntimeError, match="it was truncated"):
            table.state()


@pytest.mark.mpi
def test_partition_file_has_no_name_to_remove_or_replace(comm, shared, tmp_path):
    """The partition file has no name in its directory (O_TMPFILE, or unlinked once
    made) and is reached only through the table's descriptor and memory map: the
    directory is empty while the table trains, so a temporary-files cleaner or a user
    has nothing to remove, and files put there under the names partition files take
    are never read nor written. Training goes on bit for bit with the in-memory
    table's, and the checkpoint saved afterwards holds every row."""
    r, k = comm.size, comm.rank
    memory, disk = make_pair("gone", "TOKEN", "adam", "fp32", comm, tmp_path)
    assert os.listdir(tmp_path) == []
    planted = {tmp_path / f"popdist-gone-m-r{k}-{i}.rows": bytes([i + 1]) * 4096 for i in range(3)}
    rng = np.random.default_rng(13)
    for step in range(16):
        if step == 6:
            assert os.listdir(tmp_path) == []
            for path, data in planted.items():
                path.write_bytes(data)
        ids = zipf_ids(rng, (r, IDS))[k]
        grads = rng.standard_normal((r, IDS, E)).astype(np.float32)[k]
        assert memory.lookup(ids).tobytes() == disk.lookup(ids).tobytes(), f"step {step}"
        memory.apply_gradients(ids, grads)
        disk.apply_gradients(ids, grads)
    assert disk.storage_stats["rows_written"] > 0  # rows went to the file and back
    assert_same_state(memory, disk)
    path = pl.save_checkpoint(shared, {"emb": disk}, step=1)
    restored = pl.create_host_embedding("gone-m", [T, E], optimizer_spec=SPECS["adam"](), seed=9)
    pl.load_checkpoint(path, {"emb": restored})
    assert_same_state(memory, restored)
    pl.load_checkpoint(path, {"emb": disk})
    assert_same_state(memory, disk)
    assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in planted)
    assert all(path.read_bytes() == data for path, data in planted.items())


@dataclasses.dataclass(frozen=True)
class _SharedStateSpec(EmbeddingOptimizerSpec):
    """A user's spec whose update reads replicated state: no row-local update, so a disk
    table refuses it."""

    learning_rate: float

    def init_state(self, shard_shape):
        return {"norm": np.zeros(1, np.float32)}

    def state_layouts(self):
        return {"norm": "replicated"}


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["TOKEN", "ENCODING"])
def test_sgd_with_gradient_accumulation(strategy, comm, shared, tmp_path):
    """SGD-GA (the application every 3rd call updates every row accumulated since the
    last one, beyond the call's own rows; stochastic rounding): bit-identical to the
    in-memory table, with a cache that holds the rows of 3 calls and evictions; a
    checkpoint saved between applications, loaded into a new disk table, carries on
    with the same accumulated rows."""
    r, k = comm.size, comm.rank
    kw = {**layout(strategy), "dtype": np.float16, "stochastic_rounding": "ON"}

    def spec():
        return pl.HostEmbeddingSGDGAOptimizerSpec(0.3, accumulation_factor=3)

    def disk_table(name):
        storage = pl.DiskStorage(cache_bytes(kw, spec(), r, rows=3 * IDS * r + 4), directory=str(tmp_path))
        return pl.create_host_embedding(name, [T, E], optimizer_spec=spec(), seed=3, storage=storage, **kw)

    memory = pl.create_host_embedding("ga", [T, E], optimizer_spec=spec(), seed=3, **kw)
    disk = disk_table("ga")
    rng = np.random.default_rng(17)
    seen = []  # every replica's IDs

    def steps(tables, count):
        for _ in range(count):
            all_ids = zipf_ids(rng, (r, IDS))
            seen.append(all_ids)
            ids = all_ids[k]
            grads = rng.standard_normal((r, IDS, E)).astype(np.float16)[k]
            outs = [t.lookup(ids) for t in tables]
            assert all(o.tobytes() == outs[0].tobytes() for o in outs)
            for t in tables:
                t.apply_gradients(ids, grads)

    steps((memory, disk), 16)  # 16 = 5 applications and 1 call accumulated
    assert_same_state(memory, disk)
    touched = np.unique(np.concatenate(seen, axis=None))
    if strategy == "TOKEN":
        touched = touched[touched % r == k]
    if touched.size > disk.storage_stats["cache_rows"]:  # more rows than the cache holds: some went to disk
        assert disk.storage_stats["evictions"] > 0
    path = pl.save_checkpoint(shared, {"emb": disk}, step=16)
    again = disk_table("ga")
    pl.load_checkpoint(path, {"emb": again})
    steps((memory, disk, again), 8)
    assert_same_state(memory, disk)
    assert_same_state(memory, again)


@pytest.mark.mpi
def test_bad_directory_or_optimizer_fails_on_every_replica(comm, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    directory = str(blocker / "sub") if comm.rank == comm.size - 1 else str(tmp_path)
    with pytest.raises(RuntimeError, match=f"replica {comm.size - 1}: .*{blocker.name}"):
        pl.create_host_embedding("nodir", [T, E], storage=pl.DiskStorage(1 << 16, directory=directory))
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".rows")]  # no file left behind
    with pytest.raises(TypeError, match="cannot take _SharedStateSpec"):
        pl.create_host_embedding("shared", [T, E], optimizer_spec=_SharedStateSpec(0.1),
                                 storage=pl.DiskStorage(1 << 16, directory=str(tmp_path)))
    with pytest.raises(ValueError, match="cache_policy"):
        pl.DiskStorage(1 << 16, cache_policy="fifo")
    with pytest.raises(TypeError, match="argument storage"):
        pl.create_host_embedding("bad", [T, E], storage="ssd")


@pytest.mark.mpi
def test_directory_every_user_may_write_is_refused_on_every_replica(comm, tmp_path):
    """The last replica's directory is mode 0777 without the sticky bit (another user
    could rename the files in it): the table is not made, on every replica, and the
    error names the replica, the directory (each replica has its own) and why; nothing
    is made in any directory."""
    last = comm.rank == comm.size - 1
    directory = tmp_path / "open"
    directory.mkdir()
    directory.chmod(0o777 if last else 0o700)
    with pytest.raises(RuntimeError, match=rf"replica {comm.size - 1}: refused as the directory for partition "
                                           rf"files: every user may write to it \(mode 0777\) and it has no "
                                           r"sticky bit .*: /\S+/open$"):
        pl.create_host_embedding("open", [T, E], storage=pl.DiskStorage(1 << 16, directory=str(directory)))
    assert os.listdir(directory) == []


@pytest.mark.mpi
@pytest.mark.parametrize("source, target", [("disk", "memory"), ("memory", "disk")])
def test_checkpoint_between_disk_and_memory_reshards(source, target, comm, shared, tmp_path):
    """Train a TOKEN table, save it; load it into a table of the other storage as an
    ENCODING table at this replica count, and as a TOKEN table on replica 0 alone."""
    r, k = comm.size, comm.rank
    spec = SPECS["adam"]()
    kw = {"partition_strategy": "TOKEN", "dtype": np.float16, "master_weights": np.float32}

    def storage(kind, kwargs, replicas):
        if kind == "memory":
            return None
        return pl.DiskStorage(cache_bytes(kwargs, spec, replicas, rows=64), directory=str(tmp_path))

    table = pl.create_host_embedding("ck", [T, E], optimizer_spec=spec, storage=storage(source, kw, r), **kw)
    rng = np.random.default_rng(5)
    for _ in range(6):
        ids = zipf_ids(rng, (r, IDS))[k]
        table.lookup(ids)
        table.apply_gradients(ids, rng.standard_normal((r, IDS, E)).astype(np.float16)[k])
    want = table.get_embedding_tensor(master=True)
    probe = np.arange(0, T, 5)  # 48 rows: within the cache (64 rows) on every replica
    want_rows = table.lookup(probe)
    if source == "disk":  # the checkpoint reads the partition file's maps in chunks, not a copy in RAM
        assert all(mapped(a) for a in table.state().arrays.values())
    path = pl.save_checkpoint(shared, {"emb": table}, step=1)
    enc = {**kw, "partition_strategy": "ENCODING"}
    other = pl.create_host_embedding("ck", [T, E], optimizer_spec=spec, seed=9, storage=storage(target, enc, r), **enc)
    pl.load_checkpoint(path, {"emb": other})
    assert other.get_embedding_tensor(master=True).tobytes() == want.tobytes()
    assert other.lookup(probe).tobytes() == want_rows.tobytes()
    sub = comm.Split(0 if k == 0 else 1, k)
    if k == 0:
        alone = pl.create_host_embedding("ck", [T, E], optimizer_spec=spec, seed=9, comm=sub,
                                         storage=storage(target, kw, 1), **kw)
        pl.load_checkpoint(path, {"emb": alone}, comm=sub)
        assert alone.get_embedding_tensor(master=True).tobytes() == want.tobytes()
        steps = alone.state().arrays["optimizer/steps"]
        assert steps.shape == (T,) and steps.sum() > 0
    sub.Free()
    comm.Barrier()
