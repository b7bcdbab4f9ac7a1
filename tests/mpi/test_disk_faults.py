"""A full disk under a disk-backed table (DiskStorage), on one replica: when the
partition file is made (a file-size limit, ``RLIMIT_FSIZE``: ``EFBIG``; as root also a
small tmpfs: ``ENOSPC``) and when dirty rows are written back (the limit lowered under
a running table). Each is raised on every replica, naming the table, the file and the
errno; nothing is half-written (the table still equals an in-memory twin bit for bit
once there is room again, no partition file is left behind), and the last checkpoint
still loads bit for bit."""

import contextlib
import os
import resource
import signal
import subprocess

import numpy as np
import pytest

import popdist_lite as pl

T, E, IDS = 4096, 8, 32
KW = {"partition_strategy": "TOKEN", "dtype": np.float32}
RECORD = 4 * E * 3 + 8  # Adam: weights, m, v (float32) and the row's step count (int64)


def adam():
    return pl.HostEmbeddingAdamOptimizerSpec(0.05, beta1=0.9, beta2=0.99, epsilon=1e-8)


def disk(name, directory, cache_rows=40, seed=3):
    storage = pl.DiskStorage(cache_rows * (RECORD + 18), directory=str(directory))
    return pl.create_host_embedding(name, [T, E], optimizer_spec=adam(), seed=seed, storage=storage, **KW)


def train(tables, comm, rng, steps):
    """``steps`` steps of Zipf(1.1) IDs with every other one uniform (more rows than the cache)."""
    r, k = comm.size, comm.rank
    for _ in range(steps):
        ids = np.minimum(rng.zipf(1.1, size=(r, IDS)) - 1, T - 1)
        ids.reshape(-1)[::2] = rng.integers(0, T, size=ids.size)[::2]
        grads = rng.standard_normal((r, IDS, E)).astype(np.float32)
        for table in tables:
            table.lookup(ids[k])
            table.apply_gradients(ids[k], grads[k])


def arrays(table):
    """Copies of the table's state (the disk table's are maps of its file)."""
    return {key: np.array(a) for key, a in table.state().arrays.items()}


def assert_same(a, b):
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].tobytes() == b[key].tobytes(), key


@contextlib.contextmanager
def file_size_limit(nbytes, on):
    """This process may write no byte of any file at or past ``nbytes`` while inside,
    when ``on`` (Python ignores SIGXFSZ, so such a write fails with EFBIG)."""
    if not on:
        yield
        return
    assert signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@contextlib.contextmanager
def small_tmpfs(path, on, comm):
    """``path`` a 64 KiB tmpfs while inside, when ``on`` (root; skipped on every replica
    when any replica cannot mount it)."""
    path.mkdir()
    mounted = not on
    if on and os.geteuid() == 0:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)],
                                 capture_output=True, timeout=60).returncode == 0
    try:
        if not all(comm.allgather(mounted)):
            pytest.skip("a small tmpfs cannot be mounted here (root only)")
        yield
    finally:
        if on and mounted:
            subprocess.run(["umount", str(path)], capture_output=True, timeout=60, check=True)


@pytest.mark.mpi
@pytest.mark.parametrize("full", ["file_size_limit", "tmpfs"])
def test_full_disk_when_the_file_is_made(full, comm, shared, tmp_path):
    """A restarted job cannot make one replica's partition file: every replica raises,
    no file is left, and the checkpoint loads bit for bit into a table with room."""
    last = comm.size - 1
    table = disk("made", tmp_path / "first")
    train([table], comm, np.random.default_rng(5), 4)
    path = pl.save_checkpoint(shared, {"emb": table}, step=1)
    want = arrays(table)
    where = tmp_path / f"full-r{comm.rank}"
    if full == "file_size_limit":
        where.mkdir()
        fault, errno_name = file_size_limit(16 << 10, comm.rank == last), r"File too large \(EFBIG\)"
    else:
        fault, errno_name = small_tmpfs(where, comm.rank == last, comm), r"No space left on device \(ENOSPC\)"
    with fault:
        with pytest.raises(RuntimeError, match=rf"create_host_embedding\('made'.*: replica {last}: {errno_name} "
                                               rf"reserving \d+ bytes for the partition file: popdist-made-r{last} in .*full-r{last}"):
            disk("made", where)
        assert not list(where.iterdir())  # nothing left behind
    again = disk("made", tmp_path / "second", seed=9)
    pl.load_checkpoint(path, {"emb": again})
    assert_same(arrays(again), want)


@pytest.mark.mpi
def test_full_disk_when_rows_are_written_back(comm, shared, tmp_path):
    """The file-size limit falls under a running table on the last replica: the lookup,
    update, read of the whole table and checkpoint save that must write dirty rows back
    each fail on every replica and change nothing; with room again the table equals its
    in-memory twin and trains on, and the last checkpoint loads bit for bit."""
    r, last = comm.size, comm.size - 1
    table = disk("wb", tmp_path)
    twin = pl.create_host_embedding("wb", [T, E], optimizer_spec=adam(), seed=3, **KW)
    rng = np.random.default_rng(7)
    train([table, twin], comm, rng, 3)
    path = pl.save_checkpoint(shared, {"emb": table}, step=1)
    want = arrays(table)
    train([table, twin], comm, rng, 4)  # the cache (40 rows) is full of updated, dirty rows
    fresh = np.arange(2048, 2048 + IDS * r)  # 32 rows of every partition, mostly not cached
    wrote = (rf"replica {last}: File too large \(EFBIG\) writing rows \d+\.\.\d+ of the partition file: "
             rf"popdist-wb-r{last} in ")
    with file_size_limit(1, comm.rank == last):
        with pytest.raises(RuntimeError, match=rf"host embedding 'wb' \(disk storage\): {wrote}"):
            table.lookup(fresh)
        with pytest.raises(RuntimeError, match=rf"host embedding 'wb' \(disk storage\): {wrote}"):
            table.apply_gradients(fresh, np.ones((fresh.size, E), np.float32))
        with pytest.raises(RuntimeError, match=rf"host embedding 'wb': get_embedding_tensor: {wrote}"):
            table.get_embedding_tensor()
        with pytest.raises(pl.CheckpointError, match=rf"save_checkpoint\(.*step=2\): {wrote}"):
            pl.save_checkpoint(shared, {"emb": table}, step=2)
    assert_same(arrays(table), arrays(twin))  # nothing applied by the refused calls
    assert table.lookup(fresh).tobytes() == twin.lookup(fresh).tobytes()
    for t in (table, twin):  # the refused update, now with room
        t.apply_gradients(fresh, np.ones((fresh.size, E), np.float32))
    train([table, twin], comm, rng, 2)
    assert_same(arrays(table), arrays(twin))
    assert pl.latest_checkpoint(shared) == path
    again = disk("wb", tmp_path / "again", seed=9)
    pl.load_checkpoint(path, {"emb": again})
    assert_same(arrays(again), want)
