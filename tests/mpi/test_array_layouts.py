"""Host embeddings take index and gradient arrays of any memory layout (strided views,
negative strides, Fortran order) and give exactly what the same values in C-contiguous
arrays give, at any number of replicas.

Every test updates two tables built from the same initial table: one with the arrays
as laid out, one with C-contiguous copies, and checks that they end up identical and
that lookups equal the numpy reference ``full[ids]``.
"""

import numpy as np
import pytest

import popdist_lite as pl

# (partition strategy, exchange)
EXCHANGES = [("TOKEN", "dense"), ("TOKEN", "sparse"), ("ENCODING", "dense")]


def strided(a):
    """A view of ``a``'s values with every axis-0 step 3 elements apart in memory."""
    padded = np.zeros((a.shape[0], 3, *a.shape[1:]), dtype=a.dtype)
    padded[:, 1] = a
    view = padded[:, 1]
    assert not view.flags.c_contiguous or a.size <= 1
    return view


def reversed_(a):
    """A view of ``a``'s values with a negative axis-0 stride."""
    view = np.ascontiguousarray(a[::-1])[::-1]
    assert view.strides[0] < 0 or a.shape[0] <= 1
    return view


def fortran(a):
    """``a``'s values in Fortran order."""
    return np.asfortranarray(a)


LAYOUTS = {"strided": strided, "reversed": reversed_, "fortran": fortran}


def step_indices(rng, r, k, t, layout, dtype):
    """This replica's indices, with duplicates, a different number per replica: 1-D, or
    2-D for Fortran order (a 1-D array in Fortran order is also C-contiguous)."""
    shapes = [(3 + j, 4) if layout == "fortran" else (9 + 2 * j,) for j in range(r)]
    return [rng.integers(0, t, size=s).astype(dtype) for s in shapes][k]


def twins(name, full, strategy, exchange, lr=0.5, **kw):
    """Two tables with the same initial values and SGD learning rate."""
    spec = pl.HostEmbeddingOptimizerSpec(lr)
    return [pl.create_host_embedding(f"{name}{i}", shape=list(full.shape), partition_strategy=strategy,
                                     exchange=exchange, optimizer_spec=spec, initializer=full, **kw)
            for i in range(2)]


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.int64, np.int32])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("strategy,exchange", EXCHANGES)
def test_lookup_and_update_take_any_layout(comm, rng, strategy, exchange, layout, dtype):
    t, e, r, k = 23, 5, comm.size, comm.rank
    full = rng.standard_normal((t, e)).astype(np.float32)
    ids = step_indices(rng, r, k, t, layout, dtype)
    grads = rng.standard_normal(ids.shape + (e,)).astype(np.float32)
    laid_ids, laid_grads = LAYOUTS[layout](ids), LAYOUTS[layout](grads)
    assert not laid_ids.flags.c_contiguous and not laid_grads.flags.c_contiguous
    np.testing.assert_array_equal(laid_ids, ids)
    np.testing.assert_array_equal(laid_grads, grads)
    plain, laid = twins("layout", full, strategy, exchange)
    np.testing.assert_array_equal(laid.lookup(laid_ids), full[ids])
    plain.apply_gradients(ids, grads)
    laid.apply_gradients(laid_ids, laid_grads)
    np.testing.assert_array_equal(laid.get_embedding_tensor(), plain.get_embedding_tensor())
    np.testing.assert_array_equal(laid.lookup(laid_ids), plain.lookup(ids))


@pytest.mark.mpi
@pytest.mark.parametrize("strategy,exchange", EXCHANGES)
def test_replica_slice_of_a_shared_batch(comm, rng, strategy, exchange):
    """The common case: every replica passes its slice ``ids[k::r]`` of one batch."""
    t, e, r, k = 19, 4, comm.size, comm.rank
    full = rng.standard_normal((t, e)).astype(np.float32)
    ids = rng.integers(0, t, size=8 * r + 3)
    grads = rng.standard_normal((ids.size, e)).astype(np.float32)
    plain, laid = twins("slice", full, strategy, exchange)
    np.testing.assert_array_equal(laid.lookup(ids[k::r]), full[ids[k::r]])
    laid.apply_gradients(ids[k::r], grads[k::r])
    plain.apply_gradients(ids[k::r].copy(), grads[k::r].copy())
    acc = np.zeros((t, e))
    np.add.at(acc, ids, grads)  # every replica's slice together: the whole batch
    np.testing.assert_array_equal(laid.get_embedding_tensor(), plain.get_embedding_tensor())
    np.testing.assert_allclose(laid.get_embedding_tensor(), full - 0.5 * acc, rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
@pytest.mark.parametrize("limits", ["minibatching", "dropping", "within"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("exchange", ["dense", "sparse"])
def test_id_limit_paths_take_any_layout(comm, rng, exchange, layout, limits):
    """Tables with ID limits: a call split into minibatches, one with IDs dropped, one
    within the limits (the limits' check runs, then one pass)."""
    t, e, r, k = 400, 3, comm.size, comm.rank
    full = rng.standard_normal((t, e)).astype(np.float32)
    shapes = [(10 + j, 4) if layout == "fortran" else (40 + 4 * j,) for j in range(r)]
    ids = [rng.integers(0, t, size=s) for s in shapes][k]
    grads = rng.standard_normal(ids.shape + (e,)).astype(np.float32)
    # minibatching limits distinct IDs (no hash bucket alone holds more than the limit here)
    kind, limit, kw = {"minibatching": ("max_unique_ids_per_partition", 6, dict(enable_minibatching=True)),
                       "dropping": ("max_ids_per_partition", 3, dict(allow_id_dropping=True)),
                       "within": ("max_ids_per_partition", 256, {})}[limits]
    plain, laid = twins("limits", full, "TOKEN", exchange, **{kind: limit}, **kw)
    laid_ids, laid_grads = LAYOUTS[layout](ids), LAYOUTS[layout](grads)
    np.testing.assert_array_equal(laid.lookup(laid_ids), plain.lookup(ids))
    plain.apply_gradients(ids, grads)
    laid.apply_gradients(laid_ids, laid_grads)
    stats = pl.last_id_stats(laid.name)[f"{laid.name}/update"]
    assert (stats[kind] > limit) == (limits != "within")  # the path under test ran
    assert (stats["num_minibatches"] > 1) == (limits == "minibatching")
    np.testing.assert_array_equal(laid.get_embedding_tensor(), plain.get_embedding_tensor())


@pytest.mark.mpi
@pytest.mark.parametrize("layout", ["strided", "reversed"])
@pytest.mark.parametrize("strategy,exchange", EXCHANGES)
def test_bags_take_any_layout(comm, rng, strategy, exchange, layout):
    """Ragged bags: values, lengths, weights and gradients as strided or reversed views."""
    t, e, r, k = 17, 4, comm.size, comm.rank
    full = rng.standard_normal((t, e)).astype(np.float32)
    lengths = [rng.integers(0, 4, size=3 + j) for j in range(r)][k]
    values = [rng.integers(0, t, size=9 * (j + 2)) for j in range(r)][k][:lengths.sum()]
    weights = rng.random(values.size)
    grads = rng.standard_normal((lengths.size, e)).astype(np.float32)
    lay = LAYOUTS[layout]
    plain, laid = twins("bags", full, strategy, exchange)
    args = dict(lengths=lengths, weights=weights, combiner="mean")
    laid_args = dict(lengths=lay(lengths), weights=lay(weights), combiner="mean")
    np.testing.assert_array_equal(laid.lookup_bags(lay(values), **laid_args), plain.lookup_bags(values, **args))
    plain.apply_bag_gradients(values, grads, **args)
    laid.apply_bag_gradients(lay(values), lay(grads), **laid_args)
    np.testing.assert_array_equal(laid.get_embedding_tensor(), plain.get_embedding_tensor())


@pytest.mark.mpi
def test_contiguous_arguments_are_not_copied(comm, rng):
    """Only arrays that need it are copied: C-contiguous int64 indices and gradients of
    the lookup dtype reach the exchange as they are."""
    from popdist_lite.embedding.host_embedding import _prepare
    emb = pl.create_host_embedding("nocopy", shape=[10, 3], optimizer_spec=pl.HostEmbeddingOptimizerSpec(0.1))
    ids = rng.integers(0, 10, size=(4, 2))
    grads = rng.standard_normal((4, 2, 3)).astype(np.float32)
    flat, flat_grads, problem = _prepare(emb.spec, ids, False, grads=grads)
    assert problem is None and np.shares_memory(flat, ids) and np.shares_memory(flat_grads, grads)
    flat, flat_grads, _ = _prepare(emb.spec, ids[::-1], False, grads=grads[::-1])
    assert flat.flags.c_contiguous and flat_grads.flags.c_contiguous
    np.testing.assert_array_equal(flat, ids[::-1].reshape(-1))
    np.testing.assert_array_equal(flat_grads, grads[::-1].reshape(-1, 3))
