"""Sparse (deduplicated all-to-all) vs dense (the TF-IPU guide's) TOKEN exchange vs a
numpy reference, and the per-replica counters, at any number of replicas.

Every replica builds every replica's indices from the same generator, so each one
knows the whole step and checks its own result against numpy.
"""

import numpy as np
import pytest
from mpi4py import MPI

import popdist_lite as pl

EXCHANGES = ["sparse", "dense"]


def step_indices(rng, r, t, kind, sizes=None):
    """Every replica's indices for one step: ragged shapes, duplicates, maybe empty."""
    sizes = sizes or [(0 if k == 1 else 3 + 7 * k) for k in range(r)]  # replica 1 passes none
    if kind == "zipf":  # skewed: a few hot rows, many duplicates
        return [np.minimum(rng.zipf(1.3, size=n) - 1, t - 1) for n in sizes]
    return [rng.integers(0, t, size=n) for n in sizes]


def make(name, t, e, exchange, full, lr=0.0, dtype=np.float32):
    spec = pl.HostEmbeddingOptimizerSpec(lr) if lr else None
    return pl.create_host_embedding(name, shape=[t, e], dtype=dtype, initializer=full, optimizer_spec=spec,
                                    exchange=exchange)


@pytest.mark.mpi
@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("kind", ["uniform", "zipf"])
@pytest.mark.parametrize("t,e", [(1, 3), (2, 4), (3, 1), (37, 5), (1000, 16)])  # t < r for small t
def test_lookup_and_update_match_numpy(comm, rng, exchange, kind, t, e):
    r, k, lr = comm.size, comm.rank, 0.5
    full = rng.standard_normal((t, e)).astype(np.float32)
    emb = make("tbl", t, e, exchange, full, lr=lr)
    assert emb.exchange == exchange
    reference = full.astype(np.float64)
    for _ in range(3):  # several steps: buffers are reused, values must stay right
        idx = step_indices(rng, r, t, kind)
        grads = [rng.standard_normal((i.size, e)).astype(np.float32) for i in idx]
        mine = idx[k].reshape(-1, 1) if k % 2 else idx[k]  # any shape
        out = emb.lookup(mine.astype(np.int32))
        assert out.shape == mine.shape + (e,) and out.dtype == np.float32
        np.testing.assert_allclose(out, reference[mine].astype(np.float32), rtol=1e-5, atol=1e-6)
        emb.apply_gradients(mine, grads[k].reshape(mine.shape + (e,)))
        acc = np.zeros((t, e))
        for i, g in zip(idx, grads):
            np.add.at(acc, i, g)
        reference -= lr * acc
    np.testing.assert_allclose(emb.get_embedding_tensor(), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["bitmap", "positions", "sort"])
@pytest.mark.parametrize("kind", ["uniform", "zipf"])
def test_every_deduplication_matches_numpy(comm, rng, strategy, kind):
    """Lookups deduplicate with a bitmap (many indices for the table's size), a position
    array (few indices, table within POSITION_BYTES_MAX) or a sort (tables beyond it):
    each gives numpy's rows, and updates stay exact."""
    r, k, t, e, lr = comm.size, comm.rank, 1000, 4, 0.25
    full = rng.standard_normal((t, e)).astype(np.float32)
    emb = make("dedup", t, e, "sparse", full, lr=lr)
    if strategy == "sort":
        emb._exchange.use_slots = False  # as for a table whose position array would be too large
    n = 200 if strategy == "bitmap" else 30  # bitmap when t <= BITMAP_FACTOR * n
    reference = full.astype(np.float64)
    for step in range(3):
        idx = step_indices(rng, r, t, kind, sizes=[n + 3 * j + step for j in range(r)])
        out = emb.lookup(idx[k])
        # exact before any update; after one, float32 steps round where the float64 reference does not
        np.testing.assert_allclose(out, reference[idx[k]].astype(np.float32), rtol=0 if step == 0 else 1e-6,
                                   atol=0 if step == 0 else 1e-6)
        grads = [np.full((i.size, e), 1.0 + j, np.float32) for j, i in enumerate(idx)]
        emb.apply_gradients(idx[k], grads[k])
        for i, g in zip(idx, grads):
            np.subtract.at(reference, i, lr * g)
    np.testing.assert_allclose(emb.get_embedding_tensor(), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["uniform", "zipf"])
def test_sparse_equals_dense_step_by_step(comm, rng, kind):
    """The two exchanges of the same table agree on every lookup and every update."""
    r, k, t, e = comm.size, comm.rank, 500, 8
    full = rng.standard_normal((t, e)).astype(np.float32)
    sparse, dense = make("a", t, e, "sparse", full, lr=0.1), make("a", t, e, "dense", full, lr=0.1)
    for step in range(4):
        idx = step_indices(rng, r, t, kind, sizes=[(step * 5 + 11 * j) % 40 for j in range(r)])
        g = rng.standard_normal((idx[k].size, e)).astype(np.float32)
        # fp32 sums in a different order: equal up to rounding
        np.testing.assert_allclose(sparse.lookup(idx[k]), dense.lookup(idx[k]), rtol=1e-6, atol=1e-6)
        sparse.apply_gradients(idx[k], g)
        dense.apply_gradients(idx[k], g)
        np.testing.assert_allclose(sparse.local_shard, dense.local_shard, rtol=1e-6, atol=1e-6)


@pytest.mark.mpi
def test_all_replicas_pass_nothing(comm):
    emb = make("empty", 5, 2, "sparse", np.ones((5, 2), np.float32), lr=1.0)
    out = emb.lookup(np.zeros((0, 3), np.int64))
    assert out.shape == (0, 3, 2)
    emb.apply_gradients(np.zeros(0, np.int64), np.zeros((0, 2), np.float32))
    np.testing.assert_array_equal(emb.get_embedding_tensor(), np.ones((5, 2)))


@pytest.mark.mpi
@pytest.mark.parametrize("call", ["lookup", "update"])
@pytest.mark.parametrize("too_large", [True, False], ids=["negative-and-too-large", "negative-only"])
def test_sparse_bad_index_raises_everywhere_and_updates_nothing(comm, rng, call, too_large):
    t, e, r = 10, 3, comm.size
    full = rng.standard_normal((t, e)).astype(np.float32)
    emb = make("bad", t, e, "sparse", full, lr=1.0)
    bad_replica, value = r - 1, -7
    idx = np.array([1, 2, value] + [t + 3] * too_large if comm.rank == bad_replica else [0, 1, 1])
    run = (lambda: emb.lookup(idx)) if call == "lookup" else \
        (lambda: emb.apply_gradients(idx, np.ones((idx.size, e), np.float32)))
    with pytest.raises(IndexError, match=rf"host embedding 'bad': replica {bad_replica} passed index {value}, "
                                         rf"expected indices in \[0, {t}\).*nothing was looked up or updated"):
        run()
    np.testing.assert_array_equal(emb.get_embedding_tensor(), full)
    # the runtime keeps working, clipping still clips
    np.testing.assert_array_equal(emb.lookup(np.array([-1, t]), clip_indices=True), full[[0, t - 1]])
    emb.apply_gradients(np.array([2]), np.ones((1, e), np.float32))
    expected = full.copy()
    expected[2] -= r
    np.testing.assert_allclose(emb.get_embedding_tensor(), expected, rtol=1e-6)


@pytest.mark.mpi
def test_sparse_bad_arguments_raise_everywhere(comm):
    emb = make("args", 6, 2, "sparse", np.zeros((6, 2), np.float32), lr=1.0)
    last = comm.size - 1
    shape = (2, 3) if comm.rank == last else (2, 2)
    with pytest.raises(ValueError, match=rf"replica {last}: host embedding 'args': argument grads"):
        emb.apply_gradients(np.array([0, 1]), np.ones(shape, np.float32))
    with pytest.raises(TypeError, match="argument indices: expected an integer dtype"):
        emb.lookup(np.array([0.5]) if comm.rank == last else np.array([0]))
    np.testing.assert_array_equal(emb.lookup(np.array([5])), np.zeros((1, 2)))


@pytest.mark.mpi
def test_float16_sparse_table_sums_in_float32(comm):
    t, e, r = 4, 2, comm.size
    full = np.zeros((t, e), np.float16)
    emb = make("half", t, e, "sparse", full, lr=1.0, dtype=np.float16)
    idx = np.zeros(2000, np.int64)  # 2000 * r additions of 1e-3 to row 0
    emb.apply_gradients(idx, np.full((2000, e), 1e-3, np.float16))
    got = emb.lookup(np.array([0]))
    assert got.dtype == np.float16
    expected = np.float16(-(2000 * r) * np.float32(np.float16(1e-3)))
    np.testing.assert_allclose(got[0].astype(np.float32), expected, rtol=2e-3)


@pytest.mark.mpi
def test_exchange_option_errors(comm):
    with pytest.raises(ValueError, match="argument exchange: expected one of 'dense' for ENCODING tables, got 'sparse'"):
        pl.create_host_embedding("x", shape=[4, 4], partition_strategy="ENCODING", exchange="sparse")
    with pytest.raises(ValueError, match="argument exchange"):
        pl.create_host_embedding("x", shape=[4, 4], exchange="fast")
    assert pl.create_host_embedding("x", shape=[4, 4]).exchange == "sparse"  # the TOKEN default
    assert pl.create_host_embedding("x", shape=[4, 4], partition_strategy="ENCODING").exchange == "dense"
    if comm.size > 1:
        with pytest.raises(ValueError, match=rf"replica {comm.size - 1} passed \(name, shape, dtype, strategy"):
            pl.create_host_embedding("x", shape=[4, 4], exchange="dense" if comm.rank == comm.size - 1 else "sparse")


def totals(comm):
    s = pl.stats()
    mine = np.array([s["bytes_sent"], s["bytes_received"]], dtype=np.int64)
    every = np.empty_like(mine)
    comm.Allreduce(mine, every, op=MPI.SUM)  # raw MPI: not counted
    return s, every


@pytest.mark.mpi
@pytest.mark.parametrize("exchange", EXCHANGES)
def test_counters_add_up(comm, rng, exchange):
    """Over all replicas, bytes sent == bytes received, per collective and in total."""
    r, k, t, e = comm.size, comm.rank, 300, 8
    emb = make("count", t, e, exchange, rng.standard_normal((t, e)).astype(np.float32), lr=0.1)
    pl.reset_stats()
    idx = step_indices(rng, r, t, "zipf")
    emb.lookup(idx[k])
    emb.apply_gradients(idx[k], np.ones((idx[k].size, e), np.float32))
    pl.all_reduce(np.ones(5, np.float32))
    pl.broadcast(np.ones(3, np.int64), root=r - 1)
    pl.all_gather(np.ones(2, np.float16))
    pl.reduce_scatter_sum(np.ones((r, 4), np.float64))
    pl.all_to_all(np.ones((r * 2, 3), np.int32))
    pl.all_to_all_v(np.ones((k, 2), np.float32), splits=[k if j == 0 else 0 for j in range(r)])
    s, every = totals(comm)
    assert every[0] == every[1]
    for name, entry in s["collectives"].items():  # per collective too
        pair = np.array([entry["bytes_sent"], entry["bytes_received"]], dtype=np.int64)
        summed = np.empty_like(pair)
        comm.Allreduce(pair, summed, op=MPI.SUM)
        assert summed[0] == summed[1], name
    assert s["collectives"]["broadcast"]["calls"] == 1
    assert s["collectives"]["all_reduce"]["bytes_sent"] == 5 * 4 * (r - 1)
    assert s["phases"]["lookup"]["calls"] == 1 and s["phases"]["update"]["calls"] == 1
    if exchange == "sparse":
        for phase in ("lookup.route", "lookup.header", "lookup.ids", "lookup.rows", "update.exchange", "update.sum"):
            assert s["phases"][phase]["calls"] == 1, phase
        u = np.unique(idx[k]).size  # rows coming back to this replica, all but its own
        own = np.count_nonzero(np.unique(idx[k]) % r == k)
        assert s["phases"]["lookup.rows"]["bytes_received"] == (u - own) * e * 4
    if r > 1:
        assert every[0] > 0
    pl.reset_stats()
    assert pl.stats()["bytes_sent"] == 0 and pl.stats()["collectives"] == {}


@pytest.mark.mpi
def test_sparse_moves_fewer_bytes_than_dense(comm, rng):
    r, k, t, e = comm.size, comm.rank, 10_000, 32
    if r == 1:
        pytest.skip("nothing moves between replicas on one replica")
    idx = [np.minimum(rng.zipf(1.2, size=400) - 1, t - 1) for _ in range(r)]
    moved = {}
    for exchange in EXCHANGES:
        emb = pl.create_host_embedding("bytes", shape=[t, e], exchange=exchange)
        pl.reset_stats()
        emb.lookup(idx[k])
        moved[exchange] = totals(comm)[1][0]
    assert moved["sparse"] < moved["dense"] / 2


def bag_layout(rng, shape_kind, t, k):
    """One replica's bags as ``(values, lengths or None, padding_id or None, weighted)``:
    ``unit`` one ID per bag, ``equal`` padded 2-D of one width, ``ragged`` with empty
    bags, ``padded`` 2-D with a padding ID."""
    n = 4 + 3 * k
    if shape_kind == "unit":
        return rng.integers(0, t, size=n), np.ones(n, np.int64), None
    if shape_kind == "equal":
        return rng.integers(0, t, size=(n, 3)), None, None
    if shape_kind == "ragged":
        lengths = rng.integers(0, 4, size=n)
        lengths[0] = 0
        return rng.integers(0, t, size=int(lengths.sum())), lengths, None
    values = rng.integers(0, t, size=(n, 4))
    values[rng.random(values.shape) < 0.4] = t + 5  # the padding ID (out of the table: never looked up)
    values[0] = t + 5  # an empty bag
    return values, None, t + 5


@pytest.mark.mpi
@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("shape_kind", ["unit", "equal", "ragged", "padded"])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_bags_pool_and_update_match_numpy(comm, rng, exchange, shape_kind, combiner, weighted, dtype):
    """lookup_bags / apply_bag_gradients against per-bag loops in float64, every bag
    layout (the unit-bag shortcut, one width, ragged with empty bags, padding)."""
    r, k, t, e, lr = comm.size, comm.rank, 23, 5, 0.5
    full = rng.standard_normal((t, e)).astype(dtype)
    emb = make("bags", t, e, exchange, full, lr=lr, dtype=dtype)
    reference = full.astype(np.float64)
    tol = 2e-3 if dtype == np.float16 else 1e-5
    for _ in range(2):
        steps = [bag_layout(rng, shape_kind, t, j) for j in range(r)]
        weights = [rng.uniform(0.5, 2.0, size=v.shape) if weighted else None for v, _, _ in steps]
        batch = [(v.shape[0] if lengths is None else lengths.size) for v, lengths, _ in steps]
        grads = [rng.standard_normal((b, e)).astype(dtype) for b in batch]
        acc = np.zeros((t, e))
        for j, ((values, lengths, pad), w) in enumerate(zip(steps, weights)):
            bags = np.split(values.reshape(-1), np.cumsum(lengths)[:-1]) if lengths is not None else list(values)
            wb = (np.split(w.reshape(-1), np.cumsum(lengths)[:-1]) if lengths is not None else list(w)) \
                if w is not None else [np.ones(b.size) for b in bags]
            want = np.zeros((len(bags), e))
            for b, (ids, ws) in enumerate(zip(bags, wb)):
                keep = ids != pad if pad is not None else np.ones(ids.size, bool)
                ids, ws = ids[keep], ws[keep]
                d = {"sum": 1.0, "mean": ws.sum(), "sqrtn": np.sqrt((ws * ws).sum())}[combiner]
                scale = ws / d if ids.size else ws
                want[b] = (reference[ids] * scale[:, None]).sum(axis=0)
                np.add.at(acc, ids, grads[j][b].astype(np.float64) * scale[:, None])
            if j == k:
                got = emb.lookup_bags(values, lengths, w, combiner=combiner, padding_id=pad)
                assert got.shape == (len(bags), e) and got.dtype == dtype
                np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)
                emb.apply_bag_gradients(values, grads[j], lengths, w, combiner=combiner, padding_id=pad)
        reference -= lr * acc
    np.testing.assert_allclose(emb.get_embedding_tensor().astype(np.float64), reference, rtol=tol, atol=tol)


def test_unit_bags_pool_without_a_copy():
    """One ID per bag with scale 1: pooling and its gradient return the arrays given."""
    from popdist_lite.embedding import combiners

    bags = combiners.make_bags(np.array([3, 1, 3]), np.array([1, 1, 1]), combiner="mean")
    assert bags.unit
    rows = np.arange(6, dtype=np.float32).reshape(3, 2)
    assert np.shares_memory(combiners.pool(rows, bags), rows)
    assert np.shares_memory(combiners.unpool(rows, bags, 2, np.float32), rows)
    assert not combiners.make_bags(np.array([3, 1]), np.array([1, 1]), weights=np.array([1.0, 2.0])).unit
    assert not combiners.make_bags(np.array([3, 1]), np.array([2, 0])).unit
