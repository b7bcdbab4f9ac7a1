"""popdist_lite.jax dense data parallelism and training steps at 1-4 replicas, against
single-process JAX references: all_reduce_gradients / cross_replica_mean against the
gradient of the global batch, broadcast_parameters, TrainStep against a step written out
by hand (with and without the next step's lookup overlapped), and the Flax
SparseCoreEmbed (split and in-jit) against jnp.take and the combiners' definition."""

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the JAX binding needs the [jax] extra (pip install '.[jax]')")
optax = pytest.importorskip("optax", reason="the JAX binding's tests need the [jax] extra")
nn = pytest.importorskip("flax.linen", reason="the JAX binding's tests need the [jax] extra")
import jax.numpy as jnp  # noqa: E402

import popdist_lite as pl  # noqa: E402
import popdist_lite.jax as plj  # noqa: E402

T, E, B = 19, 4, 3  # rows, columns, samples per replica


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(jnp.tanh(nn.Dense(5)(x)))


def mse(params, x, y):
    return jnp.mean((MLP().apply(params, x)[:, 0] - y) ** 2)


def global_batch(rng, r):
    """The global batch: replica k's rows are ``[k*B, (k+1)*B)``."""
    return rng.standard_normal((r * B, 3)).astype(np.float32), rng.standard_normal(r * B).astype(np.float32)


@pytest.mark.mpi
def test_broadcast_params_gives_every_replica_the_roots(comm, rng):
    r, k = comm.size, comm.rank
    every = [MLP().init(jax.random.key(j), jnp.zeros((1, 3))) for j in range(r)]
    every = [{**p, "count": np.int64(7 + j)} for j, p in enumerate(every)]
    root = r - 1
    got = plj.broadcast_parameters(every[k], root=root)
    assert jax.tree.structure(got) == jax.tree.structure(every[root])
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(every[root])):
        assert a.dtype == jnp.asarray(b).dtype
        np.testing.assert_array_equal(a, b)


@pytest.mark.mpi
def test_allreduce_gradients_equals_the_global_batch_gradient(comm, rng):
    r, k = comm.size, comm.rank
    x, y = global_batch(rng, r)
    params = plj.broadcast_parameters(MLP().init(jax.random.key(k), jnp.zeros((1, 3))))  # replica 0's everywhere
    mine = slice(k * B, (k + 1) * B)
    local = jax.jit(jax.grad(mse))(params, x[mine], y[mine])
    reduced = plj.all_reduce_gradients(local)
    expected = jax.grad(mse)(params, x, y)  # one process, the whole batch
    for a, b in zip(jax.tree.leaves(reduced), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
    summed = plj.all_reduce_gradients(local, op="sum")
    for a, b in zip(jax.tree.leaves(summed), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, r * b, rtol=2e-5, atol=1e-6)


@pytest.mark.mpi
@pytest.mark.parametrize("jitted", [False, True])
def test_cross_replica_mean_in_an_optax_chain(comm, rng, jitted):
    """SGD through optax.chain(cross_replica_mean(), sgd) equals SGD on the global batch."""
    r, k = comm.size, comm.rank
    x, y = global_batch(rng, r)
    params = plj.broadcast_parameters(MLP().init(jax.random.key(0), jnp.zeros((1, 3))))
    reference = params
    opt = optax.chain(plj.cross_replica_mean(), optax.sgd(0.1))
    state = opt.init(params)
    update = jax.jit(opt.update) if jitted else opt.update
    mine = slice(k * B, (k + 1) * B)
    for _ in range(3):
        updates, state = update(jax.grad(mse)(params, x[mine], y[mine]), state)
        params = optax.apply_updates(params, updates)
        reference = jax.tree.map(lambda w, g: w - 0.1 * g, reference, jax.grad(mse)(reference, x, y))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
def test_allreduce_gradients_with_a_different_tree_raises_on_every_replica(comm):
    last = comm.size - 1
    grads = {"w": jnp.ones(3)}
    if comm.rank == last:
        grads = {"w": jnp.ones(4)}
    if comm.size == 1:
        pytest.skip("needs two replicas")
    with pytest.raises(ValueError, match="replica"):
        plj.all_reduce_gradients(grads)
    assert pl.all_reduce(np.array([1.0]))[0] == comm.size  # still in step


# -- TrainStep ------------------------------------------------------------------------------
def specs(frozen_init):
    """A trainable table read by a sequence and a bag feature, a frozen table by one."""
    hot = plj.TableSpec("hot", T, E, optimizer=pl.HostEmbeddingAdagradOptimizerSpec(0.2), combiner="mean")
    cold = plj.TableSpec("cold", T, E, initializer=frozen_init)
    return [plj.FeatureSpec("seq", hot, (B, 2), (B, 2, E)), plj.FeatureSpec("bag", hot, (B, 3), (B, E)),
            plj.FeatureSpec("side", cold, (B,), (B, E))]


def loss_fn(params, acts, labels):
    x = jnp.concatenate([acts["seq"].reshape(B, -1), acts["bag"], acts["side"]], axis=1)
    return jnp.mean((jnp.tanh(x @ params["w"]) - labels) ** 2)


def batches(rng, r, k, steps):
    out = []
    for _ in range(steps):
        seq = rng.integers(0, T, (r, B, 2))
        bag = rng.integers(-1, T, (r, B, 3))  # -1: padding
        side = rng.integers(0, T, (r, B))
        labels = rng.standard_normal((r, B, 1)).astype(np.float32)
        out.append(({"seq": seq[k], "bag": bag[k], "side": side[k]}, labels[k]))
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("prefetch", [False, True])
def test_train_step_equals_the_step_written_out(comm, rng, prefetch):
    r = comm.size
    cold = rng.standard_normal((T, E)).astype(np.float32)
    params = {"w": jnp.asarray(rng.standard_normal((4 * E, 1)), jnp.float32)}
    data = batches(rng, r, comm.rank, 4)
    # TrainStep, optionally told the next step's features
    a = plj.EmbeddingCollection(specs(cold))
    train = plj.TrainStep(a, loss_fn, optax.adam(0.01))
    state, losses_a, overlapped = train.init(params), [], []
    for s, (features, labels) in enumerate(data):
        upcoming = data[s + 1][0] if prefetch and s + 1 < len(data) else None
        *state, loss = train(*state, features, labels, next_features=upcoming)
        losses_a.append(float(loss))
        overlapped.append(train.overlapped)
    # the same steps written out: lookup, grads, mean of dense grads, Adam, update / r
    b = plj.EmbeddingCollection(specs(cold))
    opt = optax.adam(0.01)
    p, opt_state, losses_b = plj.broadcast_parameters(params), None, []
    opt_state = opt.init(p)
    grad_fn = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))
    for features, labels in data:
        acts = b.lookup(features)
        loss, (g_p, g_acts) = grad_fn(p, acts, labels)
        updates, opt_state = opt.update(plj.all_reduce_gradients(g_p), opt_state, p)
        p = optax.apply_updates(p, updates)
        b.apply_gradients(features, {n: g / r for n, g in g_acts.items()})
        losses_b.append(float(loss))
    np.testing.assert_allclose(losses_a, losses_b, rtol=1e-6)
    np.testing.assert_allclose(state[0]["w"], p["w"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(a.tables["hot"].get_embedding_tensor(), b.tables["hot"].get_embedding_tensor(),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(a.tables["cold"].get_embedding_tensor(), cold)  # frozen: never updated
    # the frozen table's next lookup ran during the dense step; the trainable one's after its update
    assert overlapped == ([("side",)] * 3 + [()] if prefetch else [()] * 4)


@pytest.mark.mpi
def test_train_step_checks_next_features_before_updating(comm, rng):
    last = comm.size - 1
    cold = rng.standard_normal((T, E)).astype(np.float32)
    coll = plj.EmbeddingCollection(specs(cold))
    train = plj.TrainStep(coll, loss_fn, optax.sgd(0.1))
    state = train.init({"w": jnp.zeros((4 * E, 1))})
    (features, labels), (upcoming, _) = batches(rng, comm.size, comm.rank, 2)
    if comm.rank == last:
        upcoming = {**upcoming, "side": upcoming["side"][:1]}
    before = np.asarray(coll.tables["hot"].get_embedding_tensor())
    with pytest.raises(ValueError, match=rf"next_features: replica {last}: feature 'side'"):
        train(*state, features, labels, next_features=upcoming)
    np.testing.assert_array_equal(coll.tables["hot"].get_embedding_tensor(), before)


# -- Flax ----------------------------------------------------------------------------------------
class Recommender(nn.Module):
    embeddings: plj.EmbeddingCollection
    in_jit: bool = False
    loss_scale: float = 1.0

    @nn.compact
    def __call__(self, inputs):
        acts = plj.SparseCoreEmbed(self.embeddings, in_jit=self.in_jit, loss_scale=self.loss_scale)(inputs)
        x = jnp.concatenate([acts["user"], acts["items"].reshape(B, -1)], axis=1)
        return nn.Dense(1)(x)[:, 0]


def flax_specs(name, init):
    table = plj.TableSpec(name, T, E, optimizer=pl.HostEmbeddingAdamOptimizerSpec(0.05, epsilon=1e-3),
                          combiner="sqrtn", initializer=init)
    return [plj.FeatureSpec("user", table, (B, 4), (B, E)), plj.FeatureSpec("items", table, (B, 2), (B, 2, E))]


@pytest.mark.mpi
def test_sparsecore_embed_split_and_in_jit(comm, rng):
    """Activations against jnp.take and the sqrtn combiner's definition; three steps of
    the split module and the in-jit module give the same losses, dense weights and table."""
    r, k = comm.size, comm.rank
    full = rng.standard_normal((T, E)).astype(np.float32)
    split = plj.EmbeddingCollection(flax_specs("flax_split", full))
    in_jit = plj.EmbeddingCollection(flax_specs("flax_in_jit", full))
    model_a, model_b = Recommender(split, loss_scale=r), Recommender(in_jit, in_jit=True, loss_scale=r)
    embed_a = plj.SparseCoreEmbed(split, loss_scale=r)
    embed_b = plj.SparseCoreEmbed(in_jit, in_jit=True, loss_scale=r)
    assert embed_a.feature_specs == split.feature_specs

    users = [[rng.integers(0, T, rng.integers(0, 5)) for _ in range(B)] for _ in range(r)]
    items = rng.integers(0, T, (r, B, 2))
    weights = [[rng.uniform(0.5, 2, u.size) for u in replica] for replica in users]
    features, w = {"user": users[k], "items": items[k]}, {"user": weights[k]}

    inputs_a = embed_a.preprocess_inputs(features, w)
    acts = inputs_a.activations
    np.testing.assert_array_equal(acts["items"], jnp.take(jnp.asarray(full), items[k], axis=0))
    for b, (ids, wb) in enumerate(zip(users[k], weights[k])):
        expected = (full[ids] * wb[:, None]).sum(0) / np.sqrt((wb * wb).sum()) if ids.size else np.zeros(E)
        np.testing.assert_allclose(acts["user"][b], expected, rtol=2e-6, atol=1e-6)

    params_a = plj.broadcast_parameters(model_a.init(jax.random.key(k), inputs_a))
    assert jax.tree.structure(params_a) == jax.tree.structure({"params": {"Dense_0": {"bias": 0, "kernel": 0}}})
    inputs_b = embed_b.preprocess_inputs(features, w)
    params_b = {"params": {**params_a["params"], "SparseCoreEmbed_0": {plj.HANDLE_PARAM_NAME: in_jit.handle()}}}
    assert jax.tree.structure(model_b.init(jax.random.key(0), inputs_b)) == jax.tree.structure(params_b)

    def loss(model, params, inputs, labels):
        return jnp.mean((model.apply(params, inputs) - labels) ** 2)

    grads_a = jax.jit(jax.value_and_grad(lambda p, i, y: loss(model_a, p, i, y), argnums=(0, 1)))
    grads_b = jax.jit(jax.value_and_grad(lambda p, i, y: loss(model_b, p, i, y)))
    sgd = jax.jit(lambda p, g: jax.tree.map(lambda a, b: a - 0.1 * b, p, g))
    for step in range(3):
        labels = rng.standard_normal((r, B)).astype(np.float32)[k]
        if step:
            inputs_a, inputs_b = embed_a.preprocess_inputs(features, w), embed_b.preprocess_inputs(features, w)
        value_a, (g_params, g_inputs) = grads_a(params_a, inputs_a, labels)
        embed_a.apply_gradient(g_inputs, inputs_a)
        params_a = sgd(params_a, plj.all_reduce_gradients(g_params))
        value_b, g = grads_b(params_b, inputs_b, labels)
        params_b = sgd(params_b, plj.all_reduce_gradients(g))
        np.testing.assert_allclose(value_b, value_a, rtol=1e-5)
    np.testing.assert_allclose(params_b["params"]["Dense_0"]["kernel"], params_a["params"]["Dense_0"]["kernel"],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(in_jit.tables["flax_in_jit"].get_embedding_tensor(),
                               split.tables["flax_split"].get_embedding_tensor(), rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="updated in the backward pass"):
        embed_b.apply_gradient(g, inputs_b)


def test_earlier_spellings_are_aliases():
    assert plj.allreduce_gradients is plj.all_reduce_gradients
    assert plj.broadcast_params is plj.broadcast_parameters
