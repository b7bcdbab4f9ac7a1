"""popdist_lite.jax state in checkpoints at 1-4 replicas: Flax parameters and Optax Adam
state through PytreeState, the binding's tables (EmbeddingCollection, as SparseCoreEmbed
carries it, and HostEmbedding) through pl.save_checkpoint / pl.load_checkpoint.

References: numpy copies of the state taken before saving (a reload must give them back
bit for bit), training that never saw a checkpoint (a resumed run must continue as it
does: exactly at the same replica count, within float32 rounding at another), and
the leaves' own values and types. A different replica count is had in one job as
tests/mpi/test_stateful.py does: the first ``s`` replicas save from a sub-communicator,
all ``r`` load.
"""

import json
from collections import namedtuple

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the JAX binding needs the [jax] extra (pip install '.[jax]')")
optax = pytest.importorskip("optax", reason="the JAX binding's tests need the [jax] extra")
nn = pytest.importorskip("flax.linen", reason="the JAX binding's tests need the [jax] extra")
import jax.numpy as jnp  # noqa: E402

import popdist_lite as pl  # noqa: E402
import popdist_lite.jax as plj  # noqa: E402

T, E, G = 23, 4, 12  # table rows and columns; the global batch (an integer share at 1-4 replicas)
TABLE0 = np.arange(T * E, dtype=np.float32).reshape(T, E) / (T * E) - 0.5  # every table's initial rows


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(jnp.tanh(nn.Dense(5)(x)))


def loss_fn(params, acts, y):
    x = acts["ids"].reshape(acts["ids"].shape[0], -1)
    return jnp.mean((MLP().apply(params, x)[:, 0] - y) ** 2)


def init_params(seed):
    return MLP().init(jax.random.key(seed), jnp.zeros((1, 2 * E)))


def collection(name, replicas, strategy="TOKEN", initializer=TABLE0, comm=None):
    """An Adam table (per-row step counts among its slots) read by one feature of
    ``(G / replicas, 2)`` IDs per replica."""
    table = plj.TableSpec(name, T, E, optimizer=pl.HostEmbeddingAdamOptimizerSpec(0.05), initializer=initializer,
                          partition_strategy=strategy)
    b = G // replicas
    return plj.EmbeddingCollection([plj.FeatureSpec("ids", table, (b, 2), (b, 2, E))], comm=comm)


def global_data(rng, steps):
    return [(rng.integers(0, T, (G, 2)), rng.standard_normal(G).astype(np.float32)) for _ in range(steps)]


def share(data, replicas, k):
    """Replica ``k``'s part of every global batch: rows ``[k*b, (k+1)*b)``."""
    b = G // replicas
    return [({"ids": ids[k * b:(k + 1) * b]}, y[k * b:(k + 1) * b]) for ids, y in data]


def train(step, params, opt_state, batches):
    losses = []
    for features, y in batches:
        params, opt_state, loss = step(params, opt_state, features, y)
        losses.append(float(loss))
    return params, opt_state, losses


def host(tree):
    """numpy copies of every leaf (the reference of what was saved)."""
    return [np.array(x) for x in jax.tree.leaves(tree)]


def same_leaves(tree, reference):
    leaves = jax.tree.leaves(tree)
    assert len(leaves) == len(reference)
    for got, want in zip(leaves, reference):
        assert isinstance(got, jax.Array) and got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), want)


def table_arrays(table) -> dict:
    """This replica's partition of a table: weights and every optimizer slot (copies)."""
    return {name: np.array(a) for name, a in table.table.state().arrays.items()}


def poke(emb, ids):
    """One deterministic update of a plj.HostEmbedding (a function of its rows)."""
    emb.apply_gradients(ids, emb.lookup(ids) * 0.5 + 0.1)


@pytest.mark.mpi
def test_state_reloads_bit_identical_and_training_continues_identically(shared, comm, rng):
    r, k = comm.size, comm.rank
    data = share(global_data(rng, 6), r, k)
    ids_single = rng.integers(0, T, (r, 5))[k]
    a = collection("dense_and_table", r)
    embed = plj.SparseCoreEmbed(a)  # the Flax layer carries the collection: embed.embeddings is saved
    single = plj.create_host_embedding("single", [T, E], partition_strategy="ENCODING", initializer=TABLE0,
                                       optimizer_spec=pl.HostEmbeddingAdagradOptimizerSpec(0.1))
    step_a = plj.TrainStep(a, loss_fn, optax.adam(0.02))
    params, opt_state, _ = train(step_a, *step_a.init(init_params(0)), data[:3])
    poke(single, ids_single)
    dense = plj.PytreeState({"params": params, "opt_state": opt_state})
    saved = {"dense": host(dense.tree), "tables": table_arrays(a.tables["dense_and_table"]),
             "single": table_arrays(single)}
    pl.save_checkpoint(shared, {"step": 3, "dense": dense, "tables": embed.embeddings, "single": single}, step=3)
    params_a, _, losses_a = train(step_a, params, opt_state, data[3:])
    poke(single, ids_single)
    after_a = (np.asarray(a.tables["dense_and_table"].get_embedding_tensor()), np.asarray(single.get_embedding_tensor()))

    # a fresh job: other initial weights, tables and optimizer state, then the load
    b = collection("dense_and_table", r, initializer=TABLE0 + 1)
    single_b = plj.create_host_embedding("single", [T, E], partition_strategy="ENCODING",
                                         optimizer_spec=pl.HostEmbeddingAdagradOptimizerSpec(0.1))
    step_b = plj.TrainStep(b, loss_fn, optax.adam(0.02))
    live = plj.PytreeState(dict(zip(("params", "opt_state"), step_b.init(init_params(1)))))
    before = host(live.tree)
    old_tree = live.tree
    state = {"step": 0, "dense": live, "tables": b, "single": single_b}
    pl.load_checkpoint(shared / "step-00000003", state)

    assert state["step"] == 3
    same_leaves(live.tree, saved["dense"])  # dtypes too: Adam's count stays int32
    assert jax.tree.structure(live.tree) == jax.tree.structure(dense.tree)
    for got, want in zip(jax.tree.leaves(old_tree), before):  # the arrays held before the load are unchanged
        np.testing.assert_array_equal(np.asarray(got), want)
    for name, want in saved["tables"].items():
        np.testing.assert_array_equal(table_arrays(b.tables["dense_and_table"])[name], want, err_msg=name)
    for name, want in saved["single"].items():
        np.testing.assert_array_equal(table_arrays(single_b)[name], want, err_msg=name)

    params_b, _, losses_b = train(step_b, live.tree["params"], live.tree["opt_state"], data[3:])
    poke(single_b, ids_single)
    assert losses_b == losses_a
    for got, want in zip(jax.tree.leaves(params_b), jax.tree.leaves(params_a)):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(b.tables["dense_and_table"].get_embedding_tensor(), after_a[0])
    np.testing.assert_array_equal(single_b.get_embedding_tensor(), after_a[1])


@pytest.mark.mpi
@pytest.mark.parametrize("fewer", [0, 1])
def test_saved_at_s_replicas_loads_at_r_and_continues_as_training_without_a_checkpoint(shared, comm, rng, fewer):
    """TOKEN tables saved by ``s`` replicas load into ENCODING tables at ``r``; the Adam
    table's slots (per-row step counts included) and the Optax state come along, so two
    more steps give what five uninterrupted steps at ``r`` give."""
    r, k = comm.size, comm.rank
    s = max(1, r - fewer)
    data = global_data(rng, 5)
    sub = comm.Split(0 if k < s else 1, k)
    saved = None
    if k < s:
        c = collection("resharded", s, comm=sub)
        step_s = plj.TrainStep(c, loss_fn, optax.adam(0.02))
        params, opt_state, _ = train(step_s, *step_s.init(init_params(0)), share(data[:3], s, k))
        dense = plj.PytreeState({"params": params, "opt_state": opt_state})
        full = np.asarray(c.tables["resharded"].get_embedding_tensor())
        pl.save_checkpoint(shared, {"dense": dense, "tables": c}, step=3, comm=sub)
        saved = (full, host(dense.tree))
    saved = comm.bcast(saved, root=0)
    comm.Barrier()

    d = collection("resharded", r, strategy="ENCODING", initializer=TABLE0 * 3)
    step_r = plj.TrainStep(d, loss_fn, optax.adam(0.02))
    live = plj.PytreeState(dict(zip(("params", "opt_state"), step_r.init(init_params(2)))))
    pl.load_checkpoint(shared / "step-00000003", {"dense": live, "tables": d})
    np.testing.assert_array_equal(d.tables["resharded"].get_embedding_tensor(), saved[0])
    same_leaves(live.tree, saved[1])
    params, _, losses = train(step_r, live.tree["params"], live.tree["opt_state"], share(data[3:], r, k))

    u = collection("uninterrupted", r)
    step_u = plj.TrainStep(u, loss_fn, optax.adam(0.02))
    params_u, _, losses_u = train(step_u, *step_u.init(init_params(0)), share(data, r, k))
    np.testing.assert_allclose(losses, losses_u[3:], rtol=1e-5)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(params_u)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(d.tables["resharded"].get_embedding_tensor(), u.tables["uninterrupted"].get_embedding_tensor(),
                               rtol=1e-5, atol=1e-6)


# -- refusals --------------------------------------------------------------------------------
def tree_of(w_shape=(3, 4)):
    return {"params": {"w": jnp.ones(w_shape), "b": jnp.zeros(4, jnp.bfloat16), "lr": 0.5},
            "opt_state": optax.adam(0.1).init({"w": jnp.ones(w_shape)})}


MISMATCHES = {  # the last replica's live tree -> the error every replica raises
    "another shape": (lambda: tree_of((3, 5)), r"array 'dense/opt_state/0/mu/w': the checkpoint holds float32\[3, 4\], "
                                               r"the state being loaded has float32\[3, 5\]"),
    "a leaf missing from the live tree": (lambda: {**tree_of(), "params": {"w": jnp.ones((3, 4)), "lr": 0.5}},
                                          r"pytree 'dense': the checkpoint has the leaves 'params/b' the live tree "
                                          r"does not"),
    "a leaf missing from the checkpoint": (lambda: {**tree_of(), "extra": jnp.ones(2)},
                                           r"checkpoint .* has no array 'dense/extra'"),
    "an int for a float": (lambda: {**tree_of(), "params": {**tree_of()["params"], "lr": 1}},
                           r"pytree 'dense': leaf 'params/lr' was saved as 'float', the live leaf is 'int'"),
    "float32 for bfloat16": (lambda: {**tree_of(), "params": {**tree_of()["params"], "b": jnp.zeros(4)}},
                             r"pytree 'dense': leaf 'params/b' was saved as 'bits:bfloat16', the live leaf is 'array'"),
}


@pytest.mark.mpi
@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_mismatched_pytree_on_one_replica_raises_on_every_replica_and_changes_nothing(shared, comm, case):
    last = comm.size - 1
    saved_table = collection("refused", comm.size)
    pl.save_checkpoint(shared, {"dense": plj.PytreeState(tree_of()), "tables": saved_table}, step=1)
    make, message = MISMATCHES[case]
    live = plj.PytreeState(make() if comm.rank == last else jax.tree.map(lambda x: x * 2, tree_of()))
    tree, leaves = live.tree, host(live.tree)
    table = collection("refused", comm.size, initializer=TABLE0 + 7)
    before = table_arrays(table.tables["refused"])
    with pytest.raises(pl.CheckpointError, match=rf"replica {last}: {message}"):
        pl.load_checkpoint(shared / "step-00000001", {"dense": live, "tables": table})
    assert live.tree is tree
    for got, want in zip(jax.tree.leaves(live.tree), leaves):
        np.testing.assert_array_equal(np.asarray(got), want)
    for name, want in before.items():
        np.testing.assert_array_equal(table_arrays(table.tables["refused"])[name], want, err_msg=name)


@pytest.mark.mpi
def test_collection_with_other_tables_is_refused(shared, comm):
    def tables(*names):
        return plj.EmbeddingCollection([plj.FeatureSpec(n, plj.TableSpec(n, T, E), (2,), (2, E)) for n in names])

    pl.save_checkpoint(shared, {"tables": tables("kept", "dropped")}, step=1)
    with pytest.raises(pl.CheckpointError, match=r"collection 'tables': the checkpoint holds the tables "
                                                 r"\['dropped', 'kept'\], this collection has \['kept'\]"):
        pl.load_checkpoint(shared / "step-00000001", {"tables": tables("kept")})
    with pytest.raises(pl.CheckpointError, match=r"has no state 'tables/added'"):
        pl.load_checkpoint(shared / "step-00000001", {"tables": tables("kept", "dropped", "added")})


# -- leaves and names -----------------------------------------------------------------------
Pair = namedtuple("Pair", "first second")


def odd_tree():
    """Every kind of leaf, namedtuples, lists, and keys that are not plain names."""
    return {"params": {"Dense_0": {"kernel": jnp.arange(6.0).reshape(2, 3), "bias": jnp.ones(3, jnp.bfloat16)}},
            "mlp/~/linear": [jnp.zeros(2, jnp.float16), np.arange(3, dtype=np.int64)],
            "": Pair(np.float32(2.5), jnp.asarray(7, jnp.int32)),
            "rng": jax.random.key(3), "steps": 12, "lr": 0.25, "done": False, "name": "run-1"}


@pytest.mark.mpi
def test_every_kind_of_leaf_comes_back_with_its_type_and_a_readable_name(shared, comm):
    pl.save_checkpoint(shared, {"state": plj.PytreeState(odd_tree())}, step=1)
    manifest = json.loads((shared / "step-00000001" / "manifest.json").read_text())
    assert sorted(manifest["arrays"]) == [
        "state/-/first", "state/-/second", "state/mlp-2F-7E-2Flinear/0", "state/mlp-2F-7E-2Flinear/1",
        "state/params/Dense_0/bias", "state/params/Dense_0/kernel", "state/rng"]
    assert {n: v for n, v in manifest["values"].items()} == {
        "state/steps": 12, "state/lr": 0.25, "state/done": False, "state/name": "run-1"}
    assert manifest["arrays"]["state/params/Dense_0/bias"]["dtype"] == "<u2"  # bfloat16's bits

    live = plj.PytreeState(jax.tree.map(lambda x: x, {**odd_tree(), "rng": jax.random.key(9), "steps": 0, "lr": 1.0,
                                                       "done": True, "name": "x"}))
    live.tree["params"]["Dense_0"]["kernel"] = jnp.zeros((2, 3))
    pl.load_checkpoint(shared / "step-00000001", {"state": live})
    got, want = live.tree, odd_tree()
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert (got["steps"], got["lr"], got["done"], got["name"]) == (12, 0.25, False, "run-1")
    assert type(got["steps"]) is int and type(got["lr"]) is float
    assert type(got[""].first) is np.float32 and got[""].first == np.float32(2.5)
    assert type(got["mlp/~/linear"][1]) is np.ndarray
    np.testing.assert_array_equal(jax.random.key_data(got["rng"]), jax.random.key_data(jax.random.key(3)))
    for path in (("params", "Dense_0", "kernel"), ("params", "Dense_0", "bias")):
        a, b = got[path[0]][path[1]][path[2]], want[path[0]][path[1]][path[2]]
        assert isinstance(a, jax.Array) and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    a = got["mlp/~/linear"][0]
    assert isinstance(a, jax.Array) and a.dtype == jnp.float16 and a.devices() == want["mlp/~/linear"][0].devices()
    assert isinstance(got[""].second, jax.Array) and got[""].second.dtype == jnp.int32 and int(got[""].second) == 7


class Key:
    """A dict key whose str() another key shares."""

    def __init__(self, order):
        self.order = order

    def __lt__(self, other):
        return self.order < other.order

    def __str__(self):
        return "same"


@pytest.mark.mpi
def test_unsupported_or_clashing_leaves_on_one_replica_refuse_the_save_on_every_replica(shared, comm):
    last = comm.size - 1
    bad = {"w": jnp.ones(2), "fn": (lambda: None) if comm.rank == last else 1.0}
    with pytest.raises(TypeError, match=rf"replica {last}: PytreeState: leaf \['fn'\] is a function"):
        pl.save_checkpoint(shared, {"state": plj.PytreeState(bad)}, step=1)
    clash = {Key(0): jnp.ones(2), Key(1): jnp.zeros(2)} if comm.rank == last else {"same": jnp.ones(2)}
    with pytest.raises(ValueError, match=rf"replica {last}: PytreeState: the leaves at .* have the same name 'same'"):
        pl.save_checkpoint(shared, {"state": plj.PytreeState(clash)}, step=1)
    assert pl.latest_checkpoint(shared) is None  # nothing was written
