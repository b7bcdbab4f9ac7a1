"""HostEmbedding.state() and load_state() at 1-4 replicas: the arrays are this replica's
partition of full tables computed by a numpy reference (weights after one training
step, every optimizer spec's slots from its formulas), for TOKEN (sparse and dense
exchange) and ENCODING; load_state round trips; bad arrays raise and write nothing."""

import numpy as np
import pytest

import popdist_lite as pl

pytestmark = pytest.mark.mpi

STRATEGIES = ["TOKEN", "TOKEN/dense", "ENCODING"]
T, E = 11, 5  # neither divisible by 2, 3 or 4: padding rows (TOKEN) and columns (ENCODING)
LR = 0.25
SPECS = {
    "none": lambda: None,
    "sgd": lambda: pl.HostEmbeddingOptimizerSpec(LR),
    "sgd_ga": lambda: pl.HostEmbeddingSGDGAOptimizerSpec(LR, accumulation_factor=2),
    "momentum": lambda: pl.HostEmbeddingMomentumOptimizerSpec(LR, momentum=0.5),
    "adagrad": lambda: pl.HostEmbeddingAdagradOptimizerSpec(LR, initial_accumulator_value=0.1, epsilon=1e-7),
    "adagrad_rowwise": lambda: pl.HostEmbeddingAdagradOptimizerSpec(LR, initial_accumulator_value=0.1,
                                                                    epsilon=1e-7, rowwise=True),
    "adam": lambda: pl.HostEmbeddingAdamOptimizerSpec(LR, beta1=0.9, beta2=0.99, epsilon=1e-8),
}


def create(name, strategy, spec, table, **kw):
    strat, _, exchange = strategy.partition("/")
    return pl.create_host_embedding(name, [T, E], np.float32, strat, optimizer_spec=spec, initializer=table,
                                    **({"exchange": exchange} if exchange else {}), **kw)


def partition(full, strategy, layout, r, k):
    """This replica's part of a full array in the table's padded index space: TOKEN
    ``(ceil(t/r)*r, ...)`` rows, ENCODING ``(t, r*c)`` columns (see TableState)."""
    if layout == "replicated":
        return full
    if strategy.startswith("TOKEN"):
        return full[k::r]  # local row j is table row j*r + k
    if layout == "row":
        return full  # every replica holds all rows
    c = -(-E // r)
    return full[:, k * c:(k + 1) * c]


def padded(strategy, r, value, per_row=False):
    """A full array of the padded index space filled with ``value``."""
    rows = -(-T // r) * r if strategy.startswith("TOKEN") else T
    cols = E if strategy.startswith("TOKEN") else -(-E // r) * r
    return np.full((rows,) if per_row else (rows, cols), value, dtype=np.float64)


def reference(kind, strategy, r, table, indices, grads):
    """Full weights and optimizer slots after one apply_gradients of every replica's
    ``indices``/``grads`` from the formulas (float64), in the padded index space."""
    g = padded(strategy, r, 0.0)
    touched = np.zeros(g.shape[0], bool)
    for idx, gr in zip(indices, grads):
        np.add.at(g, (idx, slice(0, E)), gr)
        touched[idx] = True
    w = padded(strategy, r, 0.0)
    w[:T, :E] = table
    slots, layouts = {}, {}
    if kind == "sgd":
        w -= LR * g
    elif kind == "sgd_ga":  # first of two accumulation steps: weights unchanged
        slots = {"accumulator": g, "touched": touched, "calls": np.array([1])}
        layouts = {"accumulator": "table", "touched": "row", "calls": "replicated"}
    elif kind == "momentum":
        w -= LR * g
        slots, layouts = {"velocity": g}, {"velocity": "table"}
    elif kind == "adagrad":
        acc = 0.1 + g * g
        w -= np.where(touched[:, None], LR * g / (np.sqrt(acc) + 1e-7), 0)
        slots, layouts = {"accumulator": acc}, {"accumulator": "table"}
    elif kind == "adagrad_rowwise":
        acc = 0.1 + (g * g).sum(axis=1) / E
        w -= np.where(touched[:, None], LR * g / (np.sqrt(acc)[:, None] + 1e-7), 0)
        slots, layouts = {"accumulator": acc}, {"accumulator": "row"}
    elif kind == "adam":
        m, v = 0.1 * g, 0.01 * g * g
        w -= np.where(touched[:, None], LR * (m / 0.1) / (np.sqrt(v / 0.01) + 1e-8), 0)
        slots = {"m": m, "v": v, "steps": touched.astype(np.int64)}
        layouts = {"m": "table", "v": "table", "steps": "row"}
    return w, slots, layouts


def one_step(emb, rng, r, k):
    """One apply_gradients with different indices per replica; returns every replica's."""
    indices = [rng.integers(0, T, size=6 + j) for j in range(r)]
    grads = [rng.standard_normal((6 + j, E)) for j in range(r)]
    emb.apply_gradients(indices[k], grads[k].astype(np.float32))
    return indices, grads


@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_state_is_the_reference_partition(comm, rng, strategy, kind):
    r, k = comm.size, comm.rank
    table = rng.standard_normal((T, E)).astype(np.float32)
    emb = create(f"state_{kind}_{strategy}", strategy, SPECS[kind](), table)
    indices, grads = one_step(emb, rng, r, k)
    w, slots, layouts = reference(kind, strategy, r, table, indices, grads)
    state = emb.state()
    assert (state.name, state.shape, state.partition_strategy) == (emb.name, (T, E), strategy.partition("/")[0])
    assert (state.dtype, state.master_dtype, state.num_replicas, state.replica) == (
        np.float32, np.float32, r, k)
    assert set(state.arrays) == {"weights"} | {f"optimizer/{s}" for s in slots}
    assert state.layouts == {"weights": "table", **{f"optimizer/{s}": lay for s, lay in layouts.items()}}
    want = partition(w, strategy, "table", r, k)
    assert state.arrays["weights"].shape == want.shape
    np.testing.assert_allclose(state.arrays["weights"], want, rtol=1e-5, atol=1e-6)
    for slot, full in slots.items():
        got = state.arrays[f"optimizer/{slot}"]
        want = partition(full, strategy, layouts[slot], r, k)
        assert got.shape == want.shape, slot
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-5, atol=1e-6, err_msg=slot)
    assert state.arrays["weights"] is emb.local_shard  # live references, no copies
    for slot, array in emb.optimizer_state.items():
        assert state.arrays[f"optimizer/{slot}"] is array
    assert set(state.generators) == {"per_replica", "replica_identical"}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_load_state_round_trip(comm, rng, strategy):
    """Arrays built from new full tables load into place: state() returns them, lookups
    serve the new weights (also through the float16 serving copy), training goes on
    from the loaded optimizer state exactly as from the reference."""
    r, k = comm.size, comm.rank
    emb = pl.create_host_embedding(f"load_{strategy}", [T, E], np.float16, strategy.partition("/")[0],
                                   optimizer_spec=SPECS["momentum"](), master_weights=np.float32,
                                   **({"exchange": "dense"} if strategy.endswith("/dense") else {}))
    new_w = padded(strategy, r, 0.0)
    new_w[:T, :E] = rng.standard_normal((T, E))
    new_v = padded(strategy, r, 0.0)
    new_v[:T, :E] = rng.standard_normal((T, E))
    arrays = {"weights": partition(new_w, strategy, "table", r, k).astype(np.float32),
              "optimizer/velocity": partition(new_v, strategy, "table", r, k).astype(np.float32)}
    emb.load_state(arrays)
    state = emb.state()
    for key, value in arrays.items():
        np.testing.assert_array_equal(state.arrays[key], value)
    ids = np.arange(T)
    np.testing.assert_array_equal(emb.lookup(ids), new_w[:T, :E].astype(np.float32).astype(np.float16))
    g = rng.standard_normal((T, E)).astype(np.float16)
    emb.apply_gradients(ids, g)
    v = 0.5 * new_v[:T, :E].astype(np.float32) + r * g.astype(np.float32)
    want = new_w[:T, :E].astype(np.float32) - LR * v
    np.testing.assert_allclose(emb.get_embedding_tensor(master=True), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_load_state_restores_generators(comm, rng, strategy):
    """float16 storage with stochastic rounding: after loading a saved state (arrays and
    generator states) the same update rounds the same way as the first time."""
    emb = pl.create_host_embedding(f"gen_{strategy}", [T, E], np.float16, strategy.partition("/")[0],
                                   optimizer_spec=pl.HostEmbeddingOptimizerSpec(LR), stochastic_rounding="ON",
                                   seed=7, **({"exchange": "dense"} if strategy.endswith("/dense") else {}))
    ids = np.arange(T)
    g = (rng.standard_normal((T, E)) * 1e-3).astype(np.float16)
    emb.apply_gradients(ids, g)  # advance the streams
    saved = emb.state()
    arrays = {key: a.copy() for key, a in saved.arrays.items()}
    generators = saved.generators
    emb.apply_gradients(ids, g)
    first = emb.local_shard.copy()
    emb.apply_gradients(ids, g)
    changed = not np.array_equal(emb.local_shard, first)  # a shard of padding only never changes
    assert pl.all_reduce(np.array(int(changed)), "max", comm=comm) == 1
    emb.load_state(arrays, generators)
    np.testing.assert_array_equal(emb.local_shard, arrays["weights"])
    emb.apply_gradients(ids, g)
    np.testing.assert_array_equal(emb.local_shard, first)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_load_state_rejects_bad_arrays_and_writes_nothing(comm, rng, strategy):
    emb = create(f"bad_{strategy}", strategy, SPECS["adam"](), rng.standard_normal((T, E)).astype(np.float32))
    before = {key: a.copy() for key, a in emb.state().arrays.items()}
    shard = emb.local_shard
    good_m = np.ones_like(emb.optimizer_state["m"])
    cases = [
        ({"optimizer/m": good_m, "weights": np.zeros((shard.shape[0] + 1, shard.shape[1]), np.float32)},
         "'weights'.*expected float32"),
        ({"optimizer/m": good_m, "weights": shard.astype(np.float64)}, "'weights'.*got float64"),
        ({"optimizer/m": good_m, "optimizer/steps": np.zeros(shard.shape[0], np.int32)}, "'optimizer/steps'"),
        ({"optimizer/m": good_m, "optimizer/velocity": good_m}, "unknown array 'optimizer/velocity'"),
    ]
    for arrays, match in cases:
        with pytest.raises(ValueError, match=match):
            emb.load_state(arrays)
        for key, a in emb.state().arrays.items():
            np.testing.assert_array_equal(a, before[key], err_msg=key)
    with pytest.raises(ValueError, match="generator 'other'"):
        emb.load_state({"optimizer/m": good_m}, {"other": {}})
    np.testing.assert_array_equal(emb.optimizer_state["m"], before["optimizer/m"])
