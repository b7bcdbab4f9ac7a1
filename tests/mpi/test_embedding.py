"""Host embeddings against a numpy reference table, at any number of replicas."""

import numpy as np
import pytest
from mpi4py import MPI

import popdist_lite as pl

STRATEGIES = ["TOKEN", "ENCODING"]


def table(rng, t, e, dtype=np.float32):
    return rng.standard_normal((t, e)).astype(dtype)


def ragged_indices(rng, r, t):
    """Every replica's indices: different shapes, duplicates, one replica may pass none."""
    shapes = [(k % 3, 4) if k % 2 else (5 + k,) for k in range(r)]
    return [rng.integers(0, t, size=s) for s in shapes]


def make(name, shape, strategy, init, lr=0.0, **kw):
    spec = pl.HostEmbeddingOptimizerSpec(lr) if lr else None
    return pl.create_host_embedding(name, shape=shape, partition_strategy=strategy, optimizer_spec=spec,
                                    initializer=init, **kw)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("t,e", [(1, 1), (2, 3), (7, 5), (16, 8), (13, 1), (3, 17)])  # t<r, e<r, odd
def test_lookup_matches_numpy(comm, rng, strategy, t, e):
    r = comm.size
    full = table(rng, t, e)
    emb = make("lookup", [t, e], strategy, full)
    expected_shard = ((-(-t // r)), e) if strategy == "TOKEN" else (t, -(-e // r))
    assert emb.local_shard.shape == expected_shard
    idx = ragged_indices(rng, r, t)[comm.rank]
    with emb.register():
        out = emb.lookup(idx.astype(np.int32))
    assert out.shape == idx.shape + (e,) and out.dtype == np.float32
    np.testing.assert_array_equal(out, full[idx])
    np.testing.assert_array_equal(emb.get_embedding_tensor(), full)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_token_placement_follows_the_guide(comm, rng, strategy):
    t, e, r, k = 11, 6, comm.size, comm.rank
    full = table(rng, t, e)
    emb = make("placement", [t, e], strategy, full)
    if strategy == "TOKEN":
        mine = full[k::r]  # row i on replica i % r at local row i // r
        np.testing.assert_array_equal(emb.local_shard[:len(mine)], mine)
    else:
        c = -(-e // r)
        mine = full[:, k * c:(k + 1) * c]
        np.testing.assert_array_equal(emb.local_shard[:, :mine.shape[1]], mine)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("t,e", [(3, 2), (10, 7), (64, 16)])
def test_apply_gradients_matches_numpy(comm, rng, strategy, t, e):
    r, lr = comm.size, 0.25
    full = table(rng, t, e)
    emb = make("sgd", [t, e], strategy, full, lr=lr)
    idx = ragged_indices(rng, r, t)
    grads = [rng.standard_normal(i.shape + (e,)).astype(np.float32) for i in idx]
    emb.apply_gradients(idx[comm.rank], grads[comm.rank])
    acc = np.zeros((t, e))
    for i, g in zip(idx, grads):
        np.add.at(acc, i.reshape(-1), g.reshape(-1, e))
    np.testing.assert_allclose(emb.get_embedding_tensor(), full - lr * acc, rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_default_initial_table_is_the_same_for_any_replica_count(comm, strategy):
    emb = pl.create_host_embedding("init", shape=[37, 5], partition_strategy=strategy, seed=3)
    single = pl.create_host_embedding("init", shape=[37, 5], partition_strategy="TOKEN", seed=3, comm=MPI.COMM_SELF)
    reference = single.get_embedding_tensor()
    np.testing.assert_array_equal(emb.get_embedding_tensor(), reference)
    assert np.abs(reference).max() <= 0.05 and reference.std() > 0.01
    other = pl.create_host_embedding("init", shape=[37, 5], seed=4, comm=MPI.COMM_SELF)
    assert not np.array_equal(other.get_embedding_tensor(), reference)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_r_replicas_of_batch_b_equal_one_replica_of_batch_rb(comm, rng, strategy):
    """Data parallelism: r replicas x batch b == 1 replica x batch r*b, step after step."""
    r, t, e, b, lr = comm.size, 50, 8, 6, 0.1
    dist = pl.create_host_embedding("dp", shape=[t, e], partition_strategy=strategy, seed=7,
                                    optimizer_spec=pl.HostEmbeddingOptimizerSpec(lr))
    one = pl.create_host_embedding("dp", shape=[t, e], partition_strategy=strategy, seed=7,
                                   optimizer_spec=pl.HostEmbeddingOptimizerSpec(lr), comm=MPI.COMM_SELF)
    for step in range(4):
        batch = rng.integers(0, t, size=(r * b,))
        grads = rng.standard_normal((r * b, e)).astype(np.float32)
        mine = slice(comm.rank * b, (comm.rank + 1) * b)
        np.testing.assert_allclose(dist.lookup(batch[mine]), one.lookup(batch)[mine], rtol=1e-6)
        dist.apply_gradients(batch[mine], grads[mine])
        one.apply_gradients(batch, grads)
    np.testing.assert_allclose(dist.get_embedding_tensor(), one.get_embedding_tensor(), rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bad_index_raises_on_every_replica_and_changes_nothing(comm, rng, strategy):
    t, e, r = 9, 4, comm.size
    full = table(rng, t, e)
    emb = make("bad", [t, e], strategy, full, lr=1.0)
    bad_replica = r - 1
    idx = np.array([0, 1, t if comm.rank == bad_replica else 2])
    for call in (lambda: emb.lookup(idx), lambda: emb.apply_gradients(idx, np.ones((3, e), np.float32))):
        with pytest.raises(IndexError, match=rf"host embedding 'bad': replica {bad_replica} passed index {t}, "
                                             rf"expected indices in \[0, {t}\)"):
            call()
    np.testing.assert_array_equal(emb.get_embedding_tensor(), full)  # nothing updated
    np.testing.assert_array_equal(emb.lookup(np.array([-3, t + 5]), clip_indices=True), full[[0, t - 1]])
    emb.apply_gradients(np.array([1]), np.ones((1, e), np.float32))  # still works
    expected = full.copy()
    expected[1] -= r
    np.testing.assert_allclose(emb.get_embedding_tensor(), expected, rtol=1e-6)


@pytest.mark.mpi
def test_bad_gradients_raise_on_every_replica(comm, rng):
    full = table(rng, 5, 3)
    emb = make("grads", [5, 3], "TOKEN", full, lr=1.0)
    shape = (2, 4) if comm.rank == comm.size - 1 else (2, 3)
    with pytest.raises(ValueError, match=rf"replica {comm.size - 1}: host embedding 'grads': argument grads: "
                                         r"expected shape indices.shape \+ \(e,\) = \(2, 3\), got \(2, 4\)"):
        emb.apply_gradients(np.array([0, 1]), np.ones(shape, np.float32))
    with pytest.raises(TypeError, match="argument indices: expected an integer dtype, got float64"):
        emb.lookup(np.array([0.0, 1.0]))
    np.testing.assert_array_equal(emb.get_embedding_tensor(), full)


@pytest.mark.mpi
def test_zero_learning_rate_means_not_trainable(comm, rng):
    full = table(rng, 6, 2)
    emb = pl.create_host_embedding("frozen", shape=[6, 2], initializer=full,
                                   optimizer_spec=pl.HostEmbeddingOptimizerSpec(0.0))
    emb.apply_gradients(np.array([0, 1]), np.ones((2, 2), np.float32))
    np.testing.assert_array_equal(emb.get_embedding_tensor(), full)


@pytest.mark.mpi
def test_creation_errors(comm):
    with pytest.raises(ValueError, match="expected 'TOKEN' or 'ENCODING', got 'MOD'"):
        pl.create_host_embedding("x", shape=[4, 4], partition_strategy="MOD")
    with pytest.raises(ValueError, match="argument shape"):
        pl.create_host_embedding("x", shape=[4])
    with pytest.raises(TypeError, match="argument dtype"):
        pl.create_host_embedding("x", shape=[4, 4], dtype=np.int32)
    with pytest.raises(ValueError, match="learning_rate"):
        pl.HostEmbeddingOptimizerSpec(-1.0)
    if comm.size > 1:
        with pytest.raises(ValueError, match=rf"replica {comm.size - 1} passed \(name, shape"):
            pl.create_host_embedding("x", shape=[4, 4 + (comm.rank == comm.size - 1)])
        with pytest.raises(ValueError, match=f"replica {comm.size - 1} has a different initial table"):
            pl.create_host_embedding("x", shape=[2, 2], initializer=np.full((2, 2), float(comm.rank == comm.size - 1)))


@pytest.mark.mpi
def test_float16_table(comm, rng):
    full = table(rng, 10, 4, np.float16)
    emb = pl.create_host_embedding("half", shape=[10, 4], dtype=np.float16, initializer=full,
                                   optimizer_spec=pl.HostEmbeddingOptimizerSpec(0.5))
    idx = np.arange(10)
    out = emb.lookup(idx)
    assert out.dtype == np.float16
    np.testing.assert_array_equal(out, full)
    emb.apply_gradients(idx, np.ones((10, 4), np.float16))
    expected = (full.astype(np.float32) - 0.5 * comm.size).astype(np.float16)
    np.testing.assert_array_equal(emb.get_embedding_tensor(), expected)


@pytest.mark.mpi
def test_callable_initializer(comm):
    emb = pl.create_host_embedding("call", shape=[5, 3], initializer=lambda shape, dtype: np.arange(15, dtype=dtype).reshape(shape))
    np.testing.assert_array_equal(emb.get_embedding_tensor(), np.arange(15, dtype=np.float32).reshape(5, 3))


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
def test_bags_whose_divisor_is_zero_pool_to_zeros(comm, rng, strategy, combiner):
    """Bags weighted [0, 0] (a divisor of 0 under mean and sqrtn) and [1, -1] (0 under
    mean) pool to zeros and pass no gradient to their IDs, as the reference's
    ``s / d if d else 0`` (the combiners' module docstring); the bag beside them pools as
    usual. Every replica passes the same bags, so each ID's update is r times one's."""
    r, t, e, lr = comm.size, 9, 3, 0.5
    full = table(rng, t, e)
    emb = pl.create_host_embedding("zero", shape=[t, e], partition_strategy=strategy, initializer=full,
                                   optimizer_spec=pl.HostEmbeddingOptimizerSpec(lr))
    values = np.array([[1, 2], [3, 4], [5, 6]])
    weights = np.array([[0.0, 0.0], [1.0, -1.0], [2.0, 0.5]])
    grads = rng.standard_normal((3, e)).astype(np.float32)
    want, acc = np.zeros((3, e)), np.zeros((t, e))
    for b, (ids, w) in enumerate(zip(values, weights)):
        d = w.sum() if combiner == "mean" else np.sqrt((w * w).sum())
        scale = w / d if d else np.zeros_like(w)
        want[b] = (full[ids].astype(np.float64) * scale[:, None]).sum(axis=0)
        np.add.at(acc, ids, r * grads[b].astype(np.float64) * scale[:, None])
    got = emb.lookup_bags(values, weights=weights, combiner=combiner)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    emb.apply_bag_gradients(values, grads, weights=weights, combiner=combiner)
    np.testing.assert_allclose(emb.get_embedding_tensor(), full - lr * acc, rtol=1e-5, atol=1e-5)
