"""popdist_lite.jax host embeddings against single-process JAX references at 1-4
replicas, TOKEN and ENCODING: lookups against jnp.take and flax.linen.Embed, bags with
every combiner, five optimizer steps against the global-batch gradient of the whole
table, the in-jit path against the split path, no recompilation for new IDs, and
argument errors raised on every replica."""

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the JAX binding needs the [jax] extra (pip install '.[jax]')")
flax_linen = pytest.importorskip("flax.linen", reason="the JAX binding's tests need the [jax] extra")
import jax.numpy as jnp  # noqa: E402

import popdist_lite as pl  # noqa: E402
import popdist_lite.jax as plj  # noqa: E402

from disk_cache import cache_bytes  # noqa: E402

STRATEGIES = ["TOKEN", "ENCODING"]
T, E = 23, 6  # rows, columns: neither divides evenly over 2-4 replicas
COMBINERS = ["sum", "mean", "sqrtn"]
OPTIMIZERS = {
    "sgd": lambda: pl.HostEmbeddingOptimizerSpec(0.3),
    "adagrad": lambda: pl.HostEmbeddingAdagradOptimizerSpec(0.5, initial_accumulator_value=0.1, epsilon=1e-7),
    "adam": lambda: pl.HostEmbeddingAdamOptimizerSpec(0.05, beta1=0.9, beta2=0.99, epsilon=1e-8),
}


def per_replica_ids(rng, r, shape_of):
    """Every replica's IDs (duplicates likely: T is small), shapes from ``shape_of(k)``."""
    return [rng.integers(0, T, size=shape_of(k)) for k in range(r)]


def ragged_bags(rng, r, batch, width):
    """Every replica's ragged bags: ``batch`` 1-D arrays of 0..width IDs (empty bags and
    duplicates included) and their weights."""
    bags = [[rng.integers(0, T, size=rng.integers(0, width + 1)) for _ in range(batch)] for _ in range(r)]
    weights = [[rng.uniform(0.5, 2.0, size=b.size) for b in replica] for replica in bags]
    return bags, weights


def pool_reference(table, bags, weights, combiner):
    """Pooled rows of ragged bags, from their definition (SparseCore's combiners)."""
    out = []
    for ids, w in zip(bags, weights):
        w = jnp.asarray(w, table.dtype)
        d = {"sum": 1.0, "mean": jnp.sum(w), "sqrtn": jnp.sqrt(jnp.sum(w * w))}[combiner] if ids.size else 1.0
        out.append(jnp.sum(jnp.take(table, ids, axis=0) * w[:, None], axis=0) / d if ids.size
                   else jnp.zeros(table.shape[1], table.dtype))
    return jnp.stack(out)


def collection(name, specs_of, strategy, init, optimizer=None, combiner="sum"):
    table = plj.TableSpec(name, T, E, optimizer=optimizer, combiner=combiner, initializer=init,
                          partition_strategy=strategy)
    return plj.EmbeddingCollection(specs_of(table)), table


# -- lookups -------------------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lookup_equals_jnp_take_and_flax_embed(comm, rng, strategy):
    r, k = comm.size, comm.rank
    full = rng.standard_normal((T, E)).astype(np.float32)
    emb = plj.create_host_embedding("take", [T, E], partition_strategy=strategy, initializer=full)
    ids = per_replica_ids(rng, r, lambda k: (k + 2, 3) if k % 2 else (7 + k,))[k]  # ragged over replicas
    acts = emb.lookup(jnp.asarray(ids))
    assert isinstance(acts, jax.Array) and acts.shape == ids.shape + (E,) and acts.dtype == jnp.float32
    np.testing.assert_array_equal(acts, jnp.take(jnp.asarray(full), ids, axis=0))
    embed = flax_linen.Embed(T, E)
    np.testing.assert_array_equal(acts, embed.apply({"params": {"embedding": jnp.asarray(full)}}, ids))
    np.testing.assert_array_equal(emb.get_embedding_tensor(), full)


@pytest.mark.mpi
def test_sparse_lookups_reach_jax_without_a_copy_and_never_change_afterwards(comm, rng):
    """The sparse exchange's results start on a 64-byte boundary, so JAX shares them
    (DLPack) instead of copying, for any number of IDs; a lookup's jax.Array keeps its
    values while the table is updated and looked up again (each lookup fills a new
    buffer)."""
    from popdist_lite.jax._host import to_jax

    full = rng.standard_normal((T, E)).astype(np.float32)
    emb = plj.create_host_embedding("shared_rows", [T, E], initializer=full,
                                    optimizer_spec=pl.HostEmbeddingOptimizerSpec(0.5))
    assert emb.table.lookup(np.zeros(0, np.int64)).shape == (0, E)
    for n in (1, 3, 17, 64, 1000):
        rows = emb.table.lookup(rng.integers(0, T, n))
        assert rows.ctypes.data % 64 == 0 and rows.flags.c_contiguous
        assert to_jax(rows).unsafe_buffer_pointer() == rows.ctypes.data
    ids = rng.integers(0, T, (5, 3))
    acts = emb.lookup(ids)
    np.testing.assert_array_equal(acts, full[ids])
    for _ in range(3):
        emb.apply_gradients(ids, jnp.ones((5, 3, E)))
        again = emb.lookup(ids)
    assert not np.array_equal(again, full[ids])  # the table did change
    np.testing.assert_array_equal(acts, full[ids])  # the first lookup's array did not


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("combiner", COMBINERS)
def test_bags_equal_a_jax_reference(comm, rng, strategy, combiner):
    """Ragged and padded bags, weights, duplicates, empty bags; the table-level API and
    an EmbeddingCollection whose pooled and sequence features share the table."""
    r, k = comm.size, comm.rank
    full = rng.standard_normal((T, E)).astype(np.float32)
    bags, weights = ragged_bags(rng, r, 5, 4)
    seq = per_replica_ids(rng, r, lambda k: (5, 2))
    expected = pool_reference(jnp.asarray(full), bags[k], weights[k], combiner)

    emb = plj.create_host_embedding(f"bags_{combiner}", [T, E], partition_strategy=strategy, initializer=full)
    values, lengths = np.concatenate(bags[k]).astype(np.int64), np.array([b.size for b in bags[k]])
    got = emb.lookup_bags(values, lengths, np.concatenate(weights[k]), combiner=combiner)
    np.testing.assert_allclose(got, expected, rtol=2e-6, atol=1e-6)

    coll, _ = collection(f"coll_{combiner}", lambda t: [plj.FeatureSpec("bag", t, (5, 4), (5, E)),
                                                        plj.FeatureSpec("seq", t, (5, 2), (5, 2, E))],
                         strategy, full, combiner=combiner)
    acts = coll.lookup({"bag": bags[k], "seq": seq[k]}, weights={"bag": weights[k]})
    assert acts["bag"].shape == (5, E) and acts["seq"].shape == (5, 2, E)
    np.testing.assert_allclose(acts["bag"], expected, rtol=2e-6, atol=1e-6)
    np.testing.assert_array_equal(acts["seq"], full[seq[k]])
    # the same bags padded with -1 (static shape), without weights
    padded = np.full((5, 4), plj.PADDING_ID)
    for b, ids in enumerate(bags[k]):
        padded[b, :ids.size] = ids
    acts = coll.lookup({"bag": padded, "seq": seq[k]})
    unweighted = pool_reference(jnp.asarray(full), bags[k], [np.ones(b.size) for b in bags[k]], combiner)
    np.testing.assert_allclose(acts["bag"], unweighted, rtol=2e-6, atol=1e-6)


# -- optimizers --------------------------------------------------------------------------------
def lazy_reference_step(kind, state, grad, touched):
    """One step of the optimizer on the touched rows only, each with its summed
    gradient (the host optimizers' documented semantics), float64."""
    w, g = state["w"], grad
    if kind == "sgd":
        w[touched] -= 0.3 * g[touched]
    elif kind == "adagrad":
        state["acc"][touched] += g[touched] ** 2
        w[touched] -= 0.5 * g[touched] / (np.sqrt(state["acc"][touched]) + 1e-7)
    else:
        state["t"][touched] += 1
        t = state["t"][touched][:, None]
        state["m"][touched] = 0.9 * state["m"][touched] + 0.1 * g[touched]
        state["v"][touched] = 0.99 * state["v"][touched] + 0.01 * g[touched] ** 2
        m_hat, v_hat = state["m"][touched] / (1 - 0.9 ** t), state["v"][touched] / (1 - 0.99 ** t)
        w[touched] -= 0.05 * m_hat / (np.sqrt(v_hat) + 1e-8)


def replica_loss(seq_acts, bag_acts, c):
    """A replica's loss of its activations (nonlinear, so gradients depend on the table)."""
    return jnp.sum(jnp.tanh(seq_acts) * c[0]) + jnp.sum(jnp.sin(bag_acts) * c[1])


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_five_steps_equal_the_global_batch_reference(comm, rng, strategy, kind):
    """A sequence feature and a bag feature stacked on one table; after 5 steps the
    whole table equals the lazy optimizer applied to the gradient of the sum of every
    replica's loss with respect to the whole table (jax.grad through jnp.take, one
    process)."""
    r, k = comm.size, comm.rank
    full = rng.standard_normal((T, E)).astype(np.float32)
    coll, _ = collection(f"opt_{kind}", lambda t: [plj.FeatureSpec("seq", t, (4, 3), (4, 3, E)),
                                                   plj.FeatureSpec("bag", t, (3, 4), (3, E))],
                         strategy, full, optimizer=OPTIMIZERS[kind](), combiner="mean")
    grad_fn = jax.jit(jax.grad(replica_loss, argnums=(0, 1)))
    state = {"w": full.astype(np.float64), "acc": np.full((T, E), 0.1), "m": np.zeros((T, E)),
             "v": np.zeros((T, E)), "t": np.zeros(T)}
    for _ in range(5):
        seq = per_replica_ids(rng, r, lambda k: (4, 3))
        bags, weights = ragged_bags(rng, r, 3, 4)
        cs = [rng.standard_normal((2, 1, E)).astype(np.float32) for _ in range(r)]
        features, w = {"seq": seq[k], "bag": bags[k]}, {"bag": weights[k]}
        acts = coll.lookup(features, w)
        g_seq, g_bag = grad_fn(acts["seq"], acts["bag"], cs[k])
        coll.apply_gradients(features, {"seq": g_seq, "bag": g_bag}, w)

        def global_loss(table):
            return sum(replica_loss(jnp.take(table, seq[j], axis=0),
                                    pool_reference(table, bags[j], weights[j], "mean"), cs[j]) for j in range(r))

        grad = np.asarray(jax.grad(global_loss)(jnp.asarray(state["w"], jnp.float32)), np.float64)
        touched = np.zeros(T, bool)
        for j in range(r):
            touched[seq[j].reshape(-1)] = True
            for ids in bags[j]:
                touched[ids] = True
        lazy_reference_step(kind, state, grad, touched)
    np.testing.assert_allclose(coll.tables[f"opt_{kind}"].get_embedding_tensor(), state["w"], rtol=2e-5, atol=2e-5)


# -- the in-jit path -------------------------------------------------------------------------
def dense_loss(params, acts, labels):
    h = jnp.tanh(acts["seq"].reshape(acts["seq"].shape[0], -1) @ params["w_seq"] + acts["bag"] @ params["w_bag"])
    return jnp.mean((h - labels) ** 2)


def two_feature_specs(t):
    return [plj.FeatureSpec("seq", t, (4, 3), (4, 3, E)), plj.FeatureSpec("bag", t, (4, 3), (4, E))]


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_in_jit_path_equals_split_path(comm, rng, strategy, kind):
    """The same three steps on both paths. Their jitted functions fuse differently, so
    activation gradients differ by float32 rounding; SGD passes that on unchanged, Adam
    amplifies it (a row moves by lr * m / (sqrt(v) + epsilon): up to lr / epsilon times a
    change of a tiny gradient), hence its wider table tolerance."""
    r, k = comm.size, comm.rank
    full = rng.standard_normal((T, E)).astype(np.float32)
    spec = OPTIMIZERS[kind]()
    tolerance = {"rtol": 1e-6, "atol": 1e-7} if kind == "sgd" else {"rtol": 0, "atol": 2e-5}
    split, _ = collection("split", two_feature_specs, strategy, full, optimizer=spec, combiner="sqrtn")
    in_jit, _ = collection("in_jit", two_feature_specs, strategy, full, optimizer=spec, combiner="sqrtn")
    params = {"w_seq": jnp.asarray(rng.standard_normal((3 * E, 2)), jnp.float32),
              "w_bag": jnp.asarray(rng.standard_normal((E, 2)), jnp.float32)}
    split_grads = jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1)))

    @jax.jit
    def in_jit_grads(params, ids, weights, labels):
        def loss(params):
            acts = in_jit.lookup_in_jit(params["handle"], ids, weights, loss_scale=r)
            return dense_loss(params["dense"], acts, labels)

        return jax.value_and_grad(loss)(params)

    for _ in range(3):
        seq = per_replica_ids(rng, r, lambda k: (4, 3))
        bags, weights = ragged_bags(rng, r, 4, 3)
        labels = [rng.standard_normal((4, 2)).astype(np.float32) for _ in range(r)]
        features, w = {"seq": seq[k], "bag": bags[k]}, {"bag": weights[k]}
        acts = split.lookup(features, w)
        loss_a, (g_params_a, g_acts) = split_grads(params, acts, labels[k])
        split.apply_gradients(features, g_acts, w, loss_scale=r)
        ids, padded_w = in_jit.prepare(features, w)
        loss_b, g = in_jit_grads({"dense": params, "handle": in_jit.handle()}, ids, padded_w, labels[k])
        np.testing.assert_allclose(loss_b, loss_a, rtol=1e-5)
        assert float(g["handle"]) == 0.0
        for name in params:
            np.testing.assert_allclose(g["dense"][name], g_params_a[name], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(in_jit.tables["in_jit"].get_embedding_tensor(),
                                   split.tables["split"].get_embedding_tensor(), **tolerance)


@pytest.mark.mpi
def test_in_jit_limits_no_vmap_and_remat_looks_up_again(comm, rng):
    """The documented limits: vmap of the in-jit lookup is an error; under
    jax.checkpoint the forward callback (a lookup on every replica) runs twice per
    gradient, and the update once."""
    coll, _ = collection("limits", lambda t: [plj.FeatureSpec("seq", t, (4, 3), (4, 3, E))], "TOKEN", None,
                         optimizer=pl.HostEmbeddingOptimizerSpec(0.1))
    ids = {"seq": jnp.asarray(rng.integers(0, T, (4, 3)))}
    with pytest.raises(NotImplementedError, match="vmap"):
        jax.vmap(lambda i: coll.lookup_in_jit(coll.handle(), {"seq": i})["seq"])(jnp.stack([ids["seq"]] * 2))

    def loss(h):
        return jnp.sum(jnp.sin(coll.lookup_in_jit(h, ids)["seq"]))

    calls = {}
    for name, fn in (("plain", loss), ("remat", jax.checkpoint(loss))):
        grad = jax.jit(jax.value_and_grad(fn))
        jax.block_until_ready(grad(coll.handle()))  # compiled, and one step taken
        pl.reset_stats()
        jax.block_until_ready(grad(coll.handle()))
        phases = pl.stats()["phases"]
        calls[name] = (phases["lookup"]["calls"], phases["update"]["calls"])
    assert calls == {"plain": (1, 1), "remat": (2, 1)}


# -- static shapes ------------------------------------------------------------------------------
class CompileCounter:
    """Counts XLA compilations (jax.monitoring's backend-compile events)."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


COMPILES = None


@pytest.fixture
def compiles():
    global COMPILES
    if COMPILES is None:
        COMPILES = CompileCounter()
    return COMPILES


@pytest.mark.mpi
@pytest.mark.parametrize("path", ["split", "in-jit"])
def test_second_step_with_other_ids_does_not_recompile(comm, rng, compiles, path):
    """Ragged bags of other lengths and other IDs: the activations keep the spec's
    shapes, so the jitted steps compile once."""
    import optax

    r, k = comm.size, comm.rank
    coll, _ = collection(f"static_{path}", two_feature_specs, "TOKEN", None,
                         optimizer=pl.HostEmbeddingAdagradOptimizerSpec(0.1))
    params = {"w_seq": jnp.ones((3 * E, 2)), "w_bag": jnp.ones((E, 2))}
    if path == "split":
        train = plj.TrainStep(coll, dense_loss, optax.adam(1e-3))
        state = train.init(params)

        def step(features, weights, labels):
            nonlocal state
            *state, loss = train(*state, features, labels, weights)
            return loss
    else:
        opt = optax.chain(plj.cross_replica_mean(), optax.adam(1e-3))
        p = {"dense": params, "handle": coll.handle()}
        # committed to the device as the jitted step's outputs are, or its second call
        # would compile again for the new placement (JAX's rule, whatever the binding)
        state = jax.device_put((p, opt.init(p)), jax.devices()[0])

        @jax.jit
        def jitted(state, ids, weights, labels):
            def loss(p):
                return dense_loss(p["dense"], coll.lookup_in_jit(p["handle"], ids, weights, loss_scale=r), labels)

            value, g = jax.value_and_grad(loss)(state[0])
            updates, opt_state = opt.update(g, state[1], state[0])
            return (optax.apply_updates(state[0], updates), opt_state), value

        def step(features, weights, labels):
            nonlocal state
            state, loss = jitted(state, *coll.prepare(features, weights), labels)
            return loss

    losses, counts, before = [], [], compiles.count
    for _ in range(3):
        seq = per_replica_ids(rng, r, lambda k: (4, 3))
        bags, weights = ragged_bags(rng, r, 4, 3)
        losses.append(float(step({"seq": seq[k], "bag": bags[k]}, {"bag": weights[k]},
                                 rng.standard_normal((4, 2)).astype(np.float32))))
        counts.append(compiles.count)
    assert counts[0] > before  # the first step compiles (the counter works)
    assert counts[1] == counts[0] and counts[2] == counts[0], f"compilations after each step: {counts}"
    assert all(np.isfinite(losses))


# -- errors ---------------------------------------------------------------------------------------
@pytest.mark.mpi
def test_bad_feature_on_one_replica_raises_on_every_replica(comm, rng):
    r, last = comm.size, comm.size - 1
    coll, _ = collection("errors", two_feature_specs, "TOKEN", None, optimizer=pl.HostEmbeddingOptimizerSpec(0.1))
    seq = rng.integers(0, T, (4, 3))
    bags = [np.array([1, 2]), np.array([3]), np.array([], np.int64), np.array([4, 4, 4])]
    bad_seq = seq[:3] if comm.rank == last else seq
    with pytest.raises(ValueError, match=rf"replica {last}: feature 'seq': expected integer IDs of shape \[4, 3\]"):
        coll.lookup({"seq": bad_seq, "bag": bags})
    long_bags = bags[:3] + [np.arange(5)] if comm.rank == last else bags
    with pytest.raises(ValueError, match=rf"replica {last}: feature 'bag': sample 3 has 5 IDs, more than"):
        coll.lookup({"seq": seq, "bag": long_bags})
    before = np.asarray(coll.tables["errors"].get_embedding_tensor())
    grads = {"seq": np.ones((4, 3, E), np.float32), "bag": np.ones((4, E), np.float32)}
    if comm.rank == last:
        grads["bag"] = np.ones((4, E + 1), np.float32)
    with pytest.raises(ValueError, match=rf"replica {last}: feature 'bag': expected a floating gradient"):
        coll.apply_gradients({"seq": seq, "bag": bags}, grads)
    np.testing.assert_array_equal(coll.tables["errors"].get_embedding_tensor(), before)  # nothing updated
    # inside jit: an out-of-range ID on one replica fails the jitted call on every replica
    ids, w = coll.prepare({"seq": seq, "bag": bags})
    if comm.rank == last:
        ids["seq"] = ids["seq"].at[0, 0].set(T + 5)
    f = jax.jit(lambda h, ids, w: coll.lookup_in_jit(h, ids, w)["seq"].sum())
    with pytest.raises(Exception, match=rf"replica {last}.*{T + 5}"):
        f(coll.handle(), ids, w).block_until_ready()
    assert pl.all_reduce(np.array([1.0]))[0] == r  # every replica still in step
    acts = coll.lookup({"seq": seq, "bag": bags})
    np.testing.assert_array_equal(acts["seq"], before[seq])


@pytest.mark.mpi
def test_bad_specs_or_weights_on_one_replica_raise_on_every_replica(comm, rng):
    last = comm.size - 1
    table = plj.TableSpec("specs", T, E)
    specs = [plj.FeatureSpec("a", table, (2, 3), (2, E))]
    if comm.rank == last:
        specs = specs * 2
    with pytest.raises(ValueError, match=rf"EmbeddingCollection: replica {last}: .*duplicate feature names"):
        plj.EmbeddingCollection(specs)
    coll = plj.EmbeddingCollection(specs[:1])
    bags = [np.array([1, 2]), np.array([3])]
    weights = [np.ones(2), np.ones(1 if comm.rank != last else 2)]
    with pytest.raises(ValueError, match=rf"replica {last}: feature 'a': expected ragged weights with as many"):
        coll.lookup({"a": bags}, {"a": weights})
    with pytest.raises(TypeError, match=rf"replica {last}: AttributeError"):
        coll.lookup({"a": bags}, {"a": [np.ones(2), np.ones(1)]} if comm.rank != last else [1, 2])
    assert pl.all_reduce(np.array([1.0]))[0] == comm.size  # still in step


@pytest.mark.mpi
def test_specs_that_differ_between_replicas_or_different_calls_raise_on_every_replica(comm):
    """Feature specs valid on each replica but different on one are named (replica,
    position, both specs); replicas calling different binding calls at the same point
    get the library's collective-mismatch error instead of a deadlock."""
    if comm.size == 1:
        pytest.skip("needs two replicas")
    last = comm.size - 1
    table = plj.TableSpec("differ", T, E)
    width = 4 if comm.rank == last else 3
    specs = [plj.FeatureSpec("a", table, (2,), (2, E)), plj.FeatureSpec("b", table, (2, width), (2, width, E))]
    with pytest.raises(ValueError, match=rf"replica {last} has other feature specs than replica 0: at position 1 "
                                         rf".*\[2, 4\].*replica 0 has feature \('b', 'differ', \[2, 3\]"):
        plj.EmbeddingCollection(specs)
    coll = plj.EmbeddingCollection(specs[:1])
    ids = {"a": np.array([1, 2])}
    with pytest.raises(RuntimeError, match="collective mismatch: replica 0 called EmbeddingCollection.lookup"):
        coll.prepare(ids) if comm.rank == last else coll.lookup(ids)
    full = np.asarray(coll.tables["differ"].get_embedding_tensor())  # every replica still in step
    np.testing.assert_array_equal(coll.lookup(ids)["a"], full[[1, 2]])


@pytest.mark.mpi
def test_table_spec_id_limits(comm, rng):
    """TableSpec's SparseCore limits reach the table: beyond max_ids_per_partition a
    lookup raises IdLimitError on every replica; with minibatching it equals jnp.take."""
    full = rng.standard_normal((T, E)).astype(np.float32)
    # 12 IDs, all owned by replica 0 (TOKEN: row i on replica i % r), each at most 3 times
    ids = np.resize(np.arange(0, T, comm.size), 12).reshape(4, 3)

    def coll(name, **limits):
        table = plj.TableSpec(name, T, E, initializer=full, max_ids_per_partition=4, **limits)
        return plj.EmbeddingCollection([plj.FeatureSpec("seq", table, (4, 3), (4, 3, E))])

    strict = coll("limited")
    with pytest.raises(pl.IdLimitError, match="max ids per partition"):
        strict.lookup({"seq": ids})
    split = coll("minibatched", enable_minibatching=True)
    np.testing.assert_array_equal(split.lookup({"seq": ids})["seq"], jnp.take(jnp.asarray(full), ids, axis=0))


@pytest.mark.mpi
def test_split_api_refuses_traced_ids(comm):
    emb = plj.create_host_embedding("traced", [T, E])
    with pytest.raises(TypeError, match="outside jax.jit"):
        jax.jit(lambda ids: emb.lookup(ids))(jnp.arange(3))


@pytest.mark.mpi
def test_pooled_bags_reach_jax_without_a_copy(comm, rng):
    """Pooled bags are new 64-byte-aligned arrays (JAX shares them), bags of one ID of
    scale 1 are the exchange's own rows; both equal the rows pooled in numpy."""
    from popdist_lite.jax._host import to_jax

    full = rng.standard_normal((T, E)).astype(np.float32)
    emb = plj.create_host_embedding("shared_bags", [T, E], initializer=full)
    for lengths in (np.array([2, 0, 3, 1]), np.full(4, 3), np.ones(5, np.int64)):
        values = rng.integers(0, T, int(lengths.sum()))
        pooled = emb.table.lookup_bags(values, lengths, combiner="mean")
        assert pooled.ctypes.data % 64 == 0 and pooled.flags.c_contiguous
        assert to_jax(pooled).unsafe_buffer_pointer() == pooled.ctypes.data
        starts = np.cumsum(lengths) - lengths
        want = np.array([full[values[s:s + n]].mean(axis=0) if n else np.zeros(E) for s, n in zip(starts, lengths)])
        np.testing.assert_allclose(np.asarray(emb.lookup_bags(values, lengths, combiner="mean")), want,
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("path", ["split", "in-jit"])
def test_disk_table_trains_as_the_in_memory_one(comm, rng, tmp_path, strategy, path):
    """A collection whose table is on local disk (``TableSpec(storage=DiskStorage)``, a
    cache that holds one call's rows and no more: rows are evicted and read back) gives the
    in-memory collection's activations, losses and, after the steps, table and Adam
    state, bit for bit, on the split path and through ``lookup_in_jit``."""
    r, k = comm.size, comm.rank
    full = rng.standard_normal((T, E)).astype(np.float32)
    spec = pl.HostEmbeddingAdamOptimizerSpec(0.05)
    trace = [(per_replica_ids(rng, r, lambda k: (2, 3)), *ragged_bags(rng, r, 2, 3)) for _ in range(10)]

    def owned(ids, j):  # the rows of replica j's partition that a call of these IDs reads
        ids = np.unique(ids)
        return ids[ids % r == j] if strategy == "TOKEN" else ids

    calls = [np.concatenate([x.reshape(-1) for x in seq] + [b for bag in bags for b in bag]).astype(np.int64)
             for seq, bags, _ in trace]
    rows = max(owned(ids, j).size for ids in calls for j in range(r))  # the cache holds one call, no more
    storage = pl.DiskStorage(cache_bytes({"partition_strategy": strategy}, spec, E, r, rows), directory=str(tmp_path))

    def specs(table):
        return [plj.FeatureSpec("seq", table, (2, 3), (2, 3, E)), plj.FeatureSpec("bag", table, (2, 3), (2, E))]

    def make(name, storage):
        table = plj.TableSpec(name, T, E, optimizer=spec, combiner="mean", initializer=full,
                              partition_strategy=strategy, storage=storage)
        return plj.EmbeddingCollection(specs(table))

    memory, disk = make("mem", None), make("disk", storage)
    params = {"w_seq": jnp.asarray(rng.standard_normal((3 * E, 2)), jnp.float32),
              "w_bag": jnp.asarray(rng.standard_normal((E, 2)), jnp.float32)}
    split_grads = jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1)))

    def in_jit_step(coll):
        @jax.jit
        def grads(params, ids, weights, labels):
            def loss(params):
                return dense_loss(params["dense"], coll.lookup_in_jit(params["handle"], ids, weights, loss_scale=r),
                                  labels)

            return jax.value_and_grad(loss)(params)
        return grads

    jitted = {"mem": in_jit_step(memory), "disk": in_jit_step(disk)}
    for step, (seq, bags, weights) in enumerate(trace):
        labels = rng.standard_normal((r, 2, 2)).astype(np.float32)[k]
        features, w = {"seq": seq[k], "bag": bags[k]}, {"bag": weights[k]}
        got = []
        for name, coll in (("mem", memory), ("disk", disk)):
            if path == "split":
                acts = coll.lookup(features, w)
                loss, (_, g_acts) = split_grads(params, acts, labels)
                coll.apply_gradients(features, g_acts, w, loss_scale=r)
                got.append((np.asarray(loss), *(np.asarray(acts[f]) for f in sorted(acts))))
            else:
                ids, padded_w = coll.prepare(features, w)
                loss, g = jitted[name]({"dense": params, "handle": coll.handle()}, ids, padded_w, labels)
                got.append((np.asarray(loss), np.asarray(g["dense"]["w_seq"])))
        for a, b in zip(*got):
            assert a.tobytes() == b.tobytes(), f"step {step}"
    stats = disk.tables["disk"].table.storage_stats
    assert stats["rows_read"] > 0 and stats["hits"] > 0
    if owned(np.concatenate(calls), k).size > rows:  # this replica touched more rows than its cache holds
        assert stats["evictions"] > 0 and stats["rows_written"] > 0
    a, b = memory.tables["mem"].table.state().arrays, disk.tables["disk"].table.state().arrays
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].tobytes() == np.asarray(b[key]).tobytes(), key
