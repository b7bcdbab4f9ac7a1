"""Collections of tables (EmbeddingBagCollection, EmbeddingCollection) against a
single-process numpy reference at 1-3 replicas: every placement (row-wise,
column-wise, table-wise, data-parallel, and all four in one collection), bags with
every pooling and weights, sequence features, SGD and row-wise Adagrad updates in
backward and through apply_gradients, float16 tables with stochastic rounding, the
collective count of a step (the same for 1 and 26 tables), ID limits, disk tables,
one table's own calls, checkpoints across replica counts and plans (and a hostile plan
record), and bad input raised on every replica.

Every replica builds every replica's batch from the same generator, so each one
computes the whole step in float64 and checks its own part."""

import hashlib
import json

import numpy as np
import pytest

import popdist_lite as pl
from popdist_lite.embedding.id_limits.partitions import keep_mask

#: (rows, dim, pooling, features) of the tables: a table smaller than the replica
#: count, two dims (two stacks per kind), a table read by two features.
TABLES = [(2, 3, "SUM", ["a"]), (7, 3, "MEAN", ["b", "c"]), (23, 5, "SQRTN", ["d"]), (41, 3, "SUM", ["e"])]
PLACEMENTS = {
    "row_wise": lambda r: {f"t{i}": "row_wise" for i in range(4)},
    "column_wise": lambda r: {f"t{i}": "column_wise" for i in range(4)},
    "table_wise": lambda r: {f"t{i}": pl.ParameterSharding("table_wise", [(i + 1) % r]) for i in range(4)},
    "data_parallel": lambda r: {f"t{i}": "data_parallel" for i in range(4)},
    "mixed": lambda r: {"t0": "data_parallel", "t1": pl.ParameterSharding("table_wise", [r - 1]),
                        "t2": "column_wise", "t3": "row_wise"},
}
LR, EPS = 0.4, 1e-7


def initial(rng):
    return [rng.standard_normal((t, e)).astype(np.float32) for t, e, _, _ in TABLES]


def configs(fulls, bags=True, optimizer="sgd", **extra):
    make = pl.EmbeddingBagConfig if bags else pl.EmbeddingConfig
    out = []
    for i, ((t, e, pooling, features), full) in enumerate(zip(TABLES, fulls)):
        spec = pl.HostEmbeddingOptimizerSpec(LR) if optimizer == "sgd" or i % 2 else \
            pl.HostEmbeddingAdagradOptimizerSpec(LR, initial_accumulator_value=0.1, epsilon=EPS, rowwise=True)
        kwargs = dict(num_embeddings=t, embedding_dim=e, name=f"t{i}", feature_names=features, optimizer=spec,
                      initializer=full, **extra)
        out.append(make(**kwargs, pooling=pooling) if bags else make(**kwargs))
    return out


def features_of():
    return [(f, i) for i, (_, _, _, features) in enumerate(TABLES) for f in features]


def step_batches(rng, r, bags=True, batch=3):
    """Every replica's batch: per feature (values, lengths, weights or None); ragged
    bags with empty ones, duplicates, weights on one feature."""
    out = []
    for _ in range(r):
        mine = {}
        for f, i in features_of():
            t = TABLES[i][0]
            lengths = rng.integers(0, 4, size=batch) if bags else np.ones(batch + 2, np.int64)
            values = rng.integers(0, t, size=int(lengths.sum()))
            weights = rng.uniform(0.5, 2.0, size=values.size) if bags and f in ("b", "d") else None
            mine[f] = (values, lengths, weights)
        out.append(mine)
    return out


def reference_outputs(tables, batch, bags=True):
    """Every feature's output of one replica's batch, float64."""
    out = {}
    for f, i in features_of():
        values, lengths, weights = batch[f]
        table, pooling = tables[i], TABLES[i][2]
        if not bags:
            out[f] = table[values]
            continue
        rows = []
        for ids, w in zip(np.split(values, np.cumsum(lengths)[:-1]),
                          np.split(weights if weights is not None else np.ones(values.size), np.cumsum(lengths)[:-1])):
            d = {"SUM": 1.0, "MEAN": w.sum(), "SQRTN": np.sqrt((w * w).sum())}[pooling] if ids.size else 1.0
            rows.append((table[ids] * (w / d)[:, None]).sum(axis=0) if ids.size else np.zeros(table.shape[1]))
        out[f] = np.array(rows).reshape(-1, table.shape[1])
    return out


def reference_step(tables, state, batches, grads, optimizer, bags=True):
    """One update of every replica's gradients (lazy: touched rows only), in place."""
    for i, table in enumerate(tables):
        acc, touched = np.zeros_like(table), np.zeros(table.shape[0], bool)
        for batch, g in zip(batches, grads):
            for f, j in features_of():
                if j != i:
                    continue
                values, lengths, weights = batch[f]
                pooling = TABLES[i][2]
                if not bags:
                    np.add.at(acc, values, g[f])
                    touched[values] = True
                    continue
                w_all = weights if weights is not None else np.ones(values.size)
                for b, (ids, w) in enumerate(zip(np.split(values, np.cumsum(lengths)[:-1]),
                                                 np.split(w_all, np.cumsum(lengths)[:-1]))):
                    if not ids.size:
                        continue
                    d = {"SUM": 1.0, "MEAN": w.sum(), "SQRTN": np.sqrt((w * w).sum())}[pooling]
                    np.add.at(acc, ids, g[f][b] * (w / d)[:, None])
                    touched[ids] = True
        if optimizer == "sgd" or i % 2:
            table[touched] -= LR * acc[touched]
        else:
            state[i][touched] += (acc[touched] ** 2).mean(axis=1)
            table[touched] -= LR * acc[touched] / (np.sqrt(state[i][touched])[:, None] + EPS)


def grads_of(rng, outputs):
    return {f: rng.standard_normal(out.shape).astype(np.float32) for f, out in outputs.items()}


def output_dict(coll, out):
    if isinstance(out, pl.KeyedArray):
        return out.to_dict()
    return {f: (v.values if isinstance(v, pl.JaggedArray) else v) for f, v in out.items()}


def run_steps(comm, rng, coll, fulls, steps=3, bags=True, optimizer="sgd", use_backward=True):
    r, k = comm.size, comm.rank
    tables = [f.astype(np.float64) for f in fulls]
    state = [np.full(f.shape[0], 0.1) for f in fulls]
    for _ in range(steps):
        batches = step_batches(rng, r, bags)
        want = [reference_outputs(tables, b, bags) for b in batches]
        grads = [grads_of(rng, w) for w in want]
        mine = {f: tuple(x for x in v if x is not None) if v[2] is None else v for f, v in batches[k].items()}
        if use_backward:
            out, ctx = coll.forward(mine)
        else:
            out, ctx = coll.lookup(mine), None
        got = output_dict(coll, out)
        for f in want[k]:
            np.testing.assert_allclose(got[f], want[k][f], rtol=1e-5, atol=1e-5, err_msg=f)
        if use_backward:
            coll.backward(ctx, grads[k])
        else:
            coll.apply_gradients(mine, grads[k])
        reference_step(tables, state, batches, grads, optimizer, bags)
    for i in range(len(fulls)):
        np.testing.assert_allclose(coll.tables[f"t{i}"].get_embedding_tensor(), tables[i], rtol=1e-5, atol=1e-5,
                                   err_msg=f"t{i}")
    return tables, state


# -- placements ---------------------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("kind", ["bags", "sequence"])
def test_every_placement_matches_numpy(comm, rng, placement, kind):
    """Outputs of three steps and the tables after them; bags update with SGD and
    row-wise Adagrad (whose row sum crosses replicas column-wise), the sequence
    features with SGD through apply_gradients."""
    bags = kind == "bags"
    fulls = initial(rng)
    optimizer = "adagrad" if bags else "sgd"
    make = pl.EmbeddingBagCollection if bags else pl.EmbeddingCollection
    plan = PLACEMENTS[placement](comm.size)
    coll = make(configs(fulls, bags, optimizer), plan=plan)
    for name, given in plan.items():
        want = given if isinstance(given, pl.ParameterSharding) else pl.ParameterSharding(given)
        assert coll.plan.shardings[name].sharding_type == want.sharding_type
    run_steps(comm, rng, coll, fulls, bags=bags, optimizer=optimizer, use_backward=bags)


@pytest.mark.mpi
def test_keyed_output_is_torchrecs_layout(comm, rng):
    """A KeyedJaggedArray in any key order gives the KeyedArray of the collection's
    features in table order, (B, sum of dims), each feature's columns together."""
    fulls = initial(rng)
    coll = pl.EmbeddingBagCollection(configs(fulls), plan=PLACEMENTS["mixed"](comm.size))
    batch = step_batches(rng, comm.size)[comm.rank]
    keys = list(reversed([f for f, _ in features_of()]))
    kja = pl.KeyedJaggedArray.from_lengths(keys, np.concatenate([batch[f][0] for f in keys]),
                                           np.concatenate([batch[f][1] for f in keys]))
    out = coll.lookup(kja)
    assert out.keys == [f for f, _ in features_of()] and out.length_per_key == [3, 3, 3, 5, 3]
    assert out.values.shape == (3, 17) and out.values.dtype == np.float32 and out.values.ctypes.data % 64 == 0
    unweighted = {f: (v[0], v[1], None) for f, v in batch.items()}
    want = reference_outputs([f.astype(np.float64) for f in fulls], unweighted)
    for f, got in out.to_dict().items():
        np.testing.assert_allclose(got, want[f], rtol=1e-5, atol=1e-6, err_msg=f)


@pytest.mark.mpi
def test_apply_gradients_equals_backward_bit_for_bit(comm, rng):
    fulls = initial(rng)
    a = pl.EmbeddingBagCollection(configs(fulls, optimizer="adagrad"), plan=PLACEMENTS["mixed"](comm.size))
    b = pl.EmbeddingBagCollection(configs(fulls, optimizer="adagrad"), plan=PLACEMENTS["mixed"](comm.size))
    for _ in range(2):
        batch = step_batches(rng, comm.size)[comm.rank]
        mine = {f: v if v[2] is not None else v[:2] for f, v in batch.items()}
        out, ctx = a.forward(mine)
        grads = grads_of(rng, out.to_dict())
        a.backward(ctx, grads)
        b.apply_gradients(mine, out.__class__(out.keys, out.length_per_key,
                                              np.concatenate([grads[f] for f in out.keys], axis=1)))
    for name in a.tables:
        assert a.tables[name].get_embedding_tensor().tobytes() == b.tables[name].get_embedding_tensor().tobytes()


@pytest.mark.mpi
def test_float16_tables_round_stochastically_and_replicas_stay_identical(comm, rng):
    """float16 tables (data-parallel and row-wise) with stochastic rounding: the
    replicated one stays bit-identical on every replica (the replica-identical stream),
    both follow the float64 reference to float16 precision."""
    r = comm.size
    full = (rng.standard_normal((6, 4)) * 0.1).astype(np.float16)
    made = [pl.EmbeddingBagConfig(6, 4, name, feature_names=[name + "_f"], data_type=np.float16,
                                  optimizer=pl.HostEmbeddingOptimizerSpec(0.01), initializer=full,
                                  stochastic_rounding="ON") for name in ("dp", "rw")]
    coll = pl.EmbeddingBagCollection(made, plan={"dp": "data_parallel", "rw": "row_wise"})
    reference = full.astype(np.float64)
    for _ in range(20):
        ids = [rng.integers(0, 6, size=5) for _ in range(r)]
        mine = {f: (ids[comm.rank], np.ones(5, np.int64)) for f in ("dp_f", "rw_f")}
        out, ctx = coll.forward(mine)
        assert out.values.dtype == np.float16
        coll.backward(ctx, np.full((5, 8), 0.3, np.float16))
        for j in range(r):
            np.subtract.at(reference, ids[j], 0.01 * 0.3)
    local = coll.tables["dp"].local_shard
    every = comm.allgather(local.tobytes())
    assert all(x == every[0] for x in every)
    for name in ("dp", "rw"):
        np.testing.assert_allclose(coll.tables[name].get_embedding_tensor().astype(np.float64), reference,
                                   rtol=0, atol=5e-3)


def uniform_reference(shape, seed, low=-0.05, high=0.05):
    """The default initial table: block i of 2**15 rows uniform in [low, high) from
    default_rng([seed, i]) (float32 draws)."""
    t, e = shape
    blocks = [np.random.default_rng([seed, i]).random((min(1 << 15, t - first), e), dtype=np.float32)
              * (high - low) + low for i, first in enumerate(range(0, t, 1 << 15))]
    return np.concatenate(blocks).astype(np.float32)


def seed_of_name(name):
    """The documented seed of a table left at seed=None: 2**128 + the first 16 bytes of
    the SHA-256 of its name, little-endian."""
    return (1 << 128) + int.from_bytes(hashlib.sha256(name.encode()).digest()[:16], "little")


@pytest.mark.mpi
def test_initial_values_are_each_tables_own(comm):
    """Tables left at seed=None start from values of their own (a seed from the name),
    so two tables of one shape differ; an explicit seed is used as given; the values do
    not depend on the replica count, the placement or the table's position (two
    collections, the tables in other orders and placements). A table past one block of
    2**15 rows checks the blocks."""
    r = comm.size
    made = [pl.EmbeddingBagConfig(40_000, 2, "a", feature_names=["fa"]),
            pl.EmbeddingBagConfig(40_000, 2, "b", feature_names=["fb"]),
            pl.EmbeddingBagConfig(40_000, 2, "c", feature_names=["fc"], seed=0),
            pl.EmbeddingBagConfig(5, 3, "d", feature_names=["fd"], seed=7, weight_init_min=-1.0,
                                  weight_init_max=1.0)]
    want = {"a": uniform_reference((40_000, 2), seed_of_name("a")),
            "b": uniform_reference((40_000, 2), seed_of_name("b")),
            "c": uniform_reference((40_000, 2), 0), "d": uniform_reference((5, 3), 7, -1.0, 1.0)}
    assert not np.array_equal(want["a"], want["b"]) and not np.array_equal(want["a"], want["c"])
    plans = [{"a": "row_wise", "b": "column_wise", "c": pl.ParameterSharding("table_wise", [r - 1]),
              "d": "data_parallel"},
             {"a": pl.ParameterSharding("table_wise", [0]), "b": "row_wise", "c": "column_wise",
              "d": "row_wise"}]
    for tables, plan in ((made, plans[0]), (made[::-1], plans[1])):
        coll = pl.EmbeddingBagCollection(tables, plan=plan)
        for name, table in want.items():
            np.testing.assert_array_equal(coll.tables[name].get_embedding_tensor(), table, err_msg=name)


def reference_round(v, rng):
    """Unbiased stochastic rounding to float16 (float64 arithmetic): v between the
    neighbours lo <= v < hi becomes hi with probability (v - lo) / (hi - lo), one draw
    of rng per element."""
    v = np.asarray(v, np.float64)
    lo = v.astype(np.float16)
    lo = np.where(lo.astype(np.float64) > v, np.nextafter(lo, np.float16(-np.inf)), lo)
    hi = np.nextafter(lo, np.float16(np.inf))
    p = (v - lo.astype(np.float64)) / (hi.astype(np.float64) - lo.astype(np.float64))
    return np.where(rng.random(v.shape) < p, hi, lo)


@pytest.mark.mpi
def test_float16_tables_of_other_seeds_share_a_stack_each_rounding_with_its_own_streams(comm, rng, shared):
    """float16 row-wise tables with stochastic rounding and other seeds (3, 8 and the
    name's) are one stack, yet each rounds its updated rows with its own per-replica
    stream (default_rng([seed, 0x5EED, 1, replica]), one draw per element of its rows
    in ascending order), as the numpy reference does table by table; each table's
    streams come back from a checkpoint (a loaded copy continues bit for bit)."""
    r, k = comm.size, comm.rank
    t, e, lr = 11, 4, 0.25
    seeds = {"s3": 3, "s8": 8, "named": None}
    fulls = {name: (rng.standard_normal((t, e)) * 0.1).astype(np.float16) for name in seeds}

    def make(initial):
        return pl.EmbeddingCollection(
            [pl.EmbeddingConfig(t, e, name, feature_names=[name + "_f"], data_type=np.float16, seed=seed,
                                initializer=initial[name], optimizer=pl.HostEmbeddingOptimizerSpec(lr),
                                stochastic_rounding="ON") for name, seed in seeds.items()],
            plan={name: "row_wise" for name in seeds})

    coll = make(fulls)
    assert len(coll.stacks) == 1
    streams = {(name, j): np.random.default_rng([seed if seed is not None else seed_of_name(name), 0x5EED, 1, j])
               for name, seed in seeds.items() for j in range(r)}
    reference = {name: full.copy() for name, full in fulls.items()}

    def step(collection, ids, grads):
        mine = {name + "_f": (ids[name][k], np.ones(ids[name][k].size, np.int64)) for name in seeds}
        out, ctx = collection.forward(mine)
        collection.backward(ctx, {name + "_f": grads[name][k] for name in seeds})

    def batch():
        # gradients in multiples of 1/8 (sums exact in float32, whatever the order)
        ids = {name: [rng.integers(0, t, size=6) for _ in range(r)] for name in seeds}
        grads = {name: [(rng.integers(-8, 9, size=(6, e)) / 8).astype(np.float16) for _ in range(r)]
                 for name in seeds}
        return ids, grads

    for _ in range(2):
        ids, grads = batch()
        step(coll, ids, grads)
        for name in seeds:
            sums = np.zeros((t, e), np.float32)
            for j in range(r):
                np.add.at(sums, ids[name][j], grads[name][j].astype(np.float32))
            touched = np.unique(np.concatenate(ids[name]))
            for j in range(r):  # replica j updates its rows i % r == j, ascending
                rows = touched[touched % r == j]
                values = reference[name][rows].astype(np.float32) - np.float32(lr) * sums[rows]
                reference[name][rows] = reference_round(values, streams[name, j])
        for name in seeds:
            np.testing.assert_array_equal(coll.tables[name].get_embedding_tensor(), reference[name], err_msg=name)
    pl.save_checkpoint(shared, {"emb": coll}, step=2)
    copy = make({name: np.zeros((t, e), np.float16) for name in seeds})
    pl.load_checkpoint(shared / "step-00000002", {"emb": copy})
    ids, grads = batch()
    step(coll, ids, grads)
    step(copy, ids, grads)
    for name in seeds:
        assert copy.tables[name].get_embedding_tensor().tobytes() == coll.tables[name].get_embedding_tensor().tobytes()


# -- one exchange for every table ------------------------------------------------------------------
@pytest.mark.mpi
def test_collective_count_does_not_grow_with_tables(comm, rng):
    """A step (forward + backward) and a stateless update make the same collectives for
    1 table as for 26 tables of every placement: one agreement and two all-to-alls per
    lookup, one agreement and one all-to-all per update in backward, one agreement and
    two all-to-alls per apply_gradients."""
    r = comm.size
    spec = pl.HostEmbeddingOptimizerSpec(0.1)
    kinds = ["row_wise", "column_wise", "data_parallel"] + [pl.ParameterSharding("table_wise", [j % r])
                                                           for j in range(3)]
    counts = {}
    for n in (1, 26):
        made = [pl.EmbeddingBagConfig(11 + i, 4, f"n{n}_{i}", feature_names=[f"f{i}"], optimizer=spec)
                for i in range(n)]
        plan = {c.name: kinds[i % len(kinds)] for i, c in enumerate(made)} if n > 1 else None
        coll = pl.EmbeddingBagCollection(made, plan=plan)
        mine = {f"f{i}": (rng.integers(0, 11, size=6), np.full(3, 2)) for i in range(n)}
        pl.reset_stats()
        out, ctx = coll.forward(mine)
        coll.backward(ctx, np.ones_like(out.values))
        step = pl.stats()["collectives"]
        pl.reset_stats()
        coll.apply_gradients(mine, np.ones_like(out.values))
        stateless = pl.stats()["collectives"]
        counts[n] = ({k: v["calls"] for k, v in step.items()}, {k: v["calls"] for k, v in stateless.items()})
    assert counts[1] == counts[26], counts
    assert counts[1] == ({"agree": 2, "all_to_all_v": 3}, {"agree": 1, "all_to_all_v": 2})


# -- errors --------------------------------------------------------------------------------------------------
@pytest.mark.mpi
def test_bad_input_on_one_replica_raises_on_every_replica_and_changes_nothing(comm, rng):
    last = comm.size - 1
    fulls = initial(rng)
    coll = pl.EmbeddingBagCollection(configs(fulls), plan=PLACEMENTS["mixed"](comm.size))
    good = {f: v[:2] for f, v in step_batches(rng, comm.size)[comm.rank].items()}
    before = {name: t.get_embedding_tensor() for name, t in coll.tables.items()}

    def bad(**change):
        return {**good, **change} if comm.rank == last else good

    with pytest.raises(IndexError, match=rf"EmbeddingBagCollection: replica {last}: feature 'b' \(table 't1'\): "
                                         rf"argument values: expected IDs in \[0, 7\), got 9"):
        coll.lookup(bad(b=(np.array([1, 9, 2]), np.array([1, 1, 1]))))
    with pytest.raises(IndexError, match=rf"replica {last}: feature 'e' \(table 't3'\).*got -1"):
        coll.apply_gradients(bad(e=(np.array([-1, 0, 0]), np.array([1, 1, 1]))), np.ones((3, 17), np.float32))
    missing = {f: v for f, v in good.items() if f != "c"}
    with pytest.raises(KeyError, match=rf"replica {last}: argument features: no batch for feature 'c'"):
        coll.lookup(missing if comm.rank == last else good)
    with pytest.raises(ValueError, match=rf"replica {last}: feature 'a': argument lengths: expected non-negative "
                                         rf"integer lengths adding up to values.size = 2"):
        coll.lookup(bad(a=(np.array([0, 1]), np.array([1, 2, 0]))))
    with pytest.raises(ValueError, match=rf"replica {last}: argument features: expected the same number of bags"):
        coll.lookup(bad(a=(np.array([0, 1]), np.array([1, 1]))))
    with pytest.raises(TypeError, match=rf"replica {last}: feature 'd': argument values: expected 1-D integer IDs"):
        coll.lookup(bad(d=(np.array([0.5]), np.array([1, 0, 0]))))
    out, ctx = coll.forward(good)
    g = np.ones((3, 17 + (comm.rank == last)), np.float32)
    with pytest.raises(ValueError, match=rf"EmbeddingBagCollection.backward: replica {last}: argument grads: "
                                         rf"expected a floating array of shape \[3, 17\], got float32\[3, 18\]"):
        coll.backward(ctx, g)
    for name, t in coll.tables.items():
        np.testing.assert_array_equal(t.get_embedding_tensor(), before[name], err_msg=name)
    coll.backward(ctx, np.zeros((3, 17), np.float32))  # the context is still good: nothing was sent
    with pytest.raises(ValueError, match="argument context: expected the LookupContext of a forward"):
        coll.backward(ctx, np.zeros((3, 17), np.float32))  # but only once


@pytest.mark.mpi
def test_bad_configs_or_plans_raise_on_every_replica(comm, rng):
    last, r = comm.size - 1, comm.size
    fulls = initial(rng)
    made = configs(fulls)
    if r > 1:
        with pytest.raises(ValueError, match=rf"replica {last} passed other tables or another plan than replica 0"):
            pl.EmbeddingBagCollection(made[:3] if comm.rank == last else made)
    with pytest.raises(ValueError, match=rf"replica {last}: argument tables: table name 't1' appears twice"):
        pl.EmbeddingBagCollection(made + [made[1]] if comm.rank == last else made)
    with pytest.raises(ValueError, match=rf"replica {last}: argument plan: no table 'nope'"):
        pl.EmbeddingBagCollection(made, plan={"nope": "row_wise"} if comm.rank == last else None)
    with pytest.raises(ValueError, match=rf"replica {last}: argument plan: table 't0': a table_wise placement needs "
                                         rf"ranks=\[k\] with k in \[0, {r}\)"):
        pl.EmbeddingBagCollection(made, plan={"t0": pl.ParameterSharding("table_wise", [r])}
                                  if comm.rank == last else None)
    with pytest.raises(TypeError, match=rf"replica {last}: argument tables: an EmbeddingBagCollection takes "
                                        rf"EmbeddingBagConfig s"):
        pl.EmbeddingBagCollection(configs(fulls, bags=comm.rank != last))
    topology = pl.Topology(r, memory_bytes=10 if comm.rank == last else 1 << 30)  # another planner there
    with pytest.raises(ValueError, match=rf"EmbeddingBagCollection: plan: replica {last}: EmbeddingShardingPlanner: "
                                         rf"table 't\d' placed .* needs"):
        pl.EmbeddingBagCollection(made, planner=pl.EmbeddingShardingPlanner(topology))
    assert pl.all_reduce(np.array([1.0]))[0] == r  # every replica still in step


# -- one table's own calls, disk tables, ID limits -------------------------------------------------------
@pytest.mark.mpi
def test_a_collection_table_is_a_host_embedding(comm, rng):
    """tables[name].lookup / apply_gradients / lookup_bags through the collection's
    exchange give what a HostEmbedding of the same table gives."""
    fulls = initial(rng)
    coll = pl.EmbeddingBagCollection(configs(fulls), plan=PLACEMENTS["mixed"](comm.size))
    for i, (t, e, _, _) in enumerate(TABLES):
        table = coll.tables[f"t{i}"]
        host = pl.create_host_embedding(f"h{i}", [t, e], initializer=fulls[i],
                                        optimizer_spec=pl.HostEmbeddingOptimizerSpec(LR))
        ids = rng.integers(0, t, size=(comm.size, 2, 3))[comm.rank]
        np.testing.assert_array_equal(table.lookup(ids), host.lookup(ids))
        g = rng.standard_normal((2, 3, e)).astype(np.float32)
        table.apply_gradients(ids, g)
        host.apply_gradients(ids, g)
        values, lengths = ids.reshape(-1), np.array([2, 0, 4])
        np.testing.assert_allclose(table.lookup_bags(values, lengths, combiner="mean"),
                                   host.lookup_bags(values, lengths, combiner="mean"), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(table.get_embedding_tensor(), host.get_embedding_tensor(), rtol=1e-6, atol=1e-6)


@pytest.mark.mpi
def test_disk_table_gives_the_in_memory_results(comm, rng, tmp_path):
    fulls = initial(rng)
    storage = pl.DiskStorage(cache_bytes=4096, directory=str(tmp_path))
    memory = pl.EmbeddingBagCollection(configs(fulls, optimizer="adagrad"), plan=PLACEMENTS["row_wise"](comm.size))
    on_disk = pl.EmbeddingBagCollection(configs(fulls, optimizer="adagrad", storage=storage),
                                        plan={"t0": "table_wise", "t1": "row_wise", "t2": "column_wise",
                                              "t3": "row_wise"})
    for _ in range(3):
        mine = {f: v[:2] for f, v in step_batches(rng, comm.size)[comm.rank].items()}
        grads = rng.standard_normal((3, 17)).astype(np.float32)
        for coll in (memory, on_disk):
            out, ctx = coll.forward(mine)
            coll.backward(ctx, grads)
        np.testing.assert_allclose(on_disk.lookup(mine).values, memory.lookup(mine).values, rtol=1e-5, atol=1e-6)
    for name in memory.tables:
        np.testing.assert_allclose(on_disk.tables[name].get_embedding_tensor(),
                                   memory.tables[name].get_embedding_tensor(), rtol=1e-5, atol=1e-6)
    assert on_disk.tables["t3"].storage_stats["rows_read"] > 0


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["error", "minibatching", "dropping"])
def test_id_limits_of_one_table_among_others(comm, rng, mode):
    """A limited row-wise table beside unlimited ones: beyond its limit a call raises
    IdLimitError on every replica, runs in minibatches that equal one pass, or drops
    the IDs keep_mask chooses (their rows read zeros, their gradients ignored)."""
    r = comm.size
    full = rng.standard_normal((40, 3)).astype(np.float32)
    other = rng.standard_normal((9, 3)).astype(np.float32)
    limits = {"error": {}, "minibatching": {"enable_minibatching": True}, "dropping": {"allow_id_dropping": True}}
    made = [pl.EmbeddingConfig(40, 3, "limited", feature_names=["x"], initializer=full, max_ids_per_partition=4,
                               optimizer=pl.HostEmbeddingOptimizerSpec(1.0), **limits[mode]),
            pl.EmbeddingConfig(9, 3, "free", feature_names=["y"], initializer=other,
                               optimizer=pl.HostEmbeddingOptimizerSpec(1.0))]
    coll = pl.EmbeddingCollection(made, plan={"limited": "row_wise", "free": "row_wise"})
    ids = [np.resize(np.arange(j, 40, 3), 12) for j in range(r)]  # 12 IDs, up to 12 per owner: over 4
    y = rng.integers(0, 9, size=5)
    mine = {"x": (ids[comm.rank], np.ones(12, np.int64)), "y": (y, np.ones(5, np.int64))}
    if mode == "error":
        with pytest.raises(pl.IdLimitError, match=r"table 'limited'.*max ids per partition"):
            coll.lookup(mine)
        return
    out, ctx = coll.forward(mine)
    want = full[ids[comm.rank]].copy()
    if mode == "dropping":
        keep = keep_mask(ids[comm.rank], r, made[0].spec.id_limits)
        want[~keep] = 0
    np.testing.assert_array_equal(out["x"].values, want)
    np.testing.assert_array_equal(out["y"].values, other[y])
    coll.backward(ctx, {"x": np.ones((12, 3), np.float32), "y": np.ones((5, 3), np.float32)})
    reference = full.astype(np.float64)
    for j in range(r):
        keep = keep_mask(ids[j], r, made[0].spec.id_limits) if mode == "dropping" else np.ones(12, bool)
        np.subtract.at(reference, ids[j][keep], 1.0)
    np.testing.assert_allclose(coll.tables["limited"].get_embedding_tensor(), reference, rtol=1e-6, atol=1e-6)


# -- checkpoints ------------------------------------------------------------------------------------------------
def gathered_slot(comm, coll, name, slot):
    """A table's optimizer slot, whole (one value per row), from every replica's part."""
    table = coll.tables[name]
    pieces = comm.allgather(np.array(table.state().arrays[f"optimizer/{slot}"]))
    kind = table.sharding.sharding_type.value
    if kind == "row_wise":
        t = table.shape[0]
        out = np.empty(t, pieces[0].dtype)
        for k, p in enumerate(pieces):
            out[k::comm.size] = p[:len(range(k, t, comm.size))]
        return out
    if kind == "table_wise":
        return pieces[table.sharding.ranks[0]]
    return pieces[0]


@pytest.mark.mpi
@pytest.mark.parametrize("fewer", [0, 1])
def test_checkpoint_reshards_across_replica_counts_and_plans(shared, comm, rng, fewer):
    """Saved by s replicas under one plan, loaded by r under another (each table in
    another placement): weights and row-wise Adagrad accumulators come back exactly,
    and training continues as the numpy reference does."""
    r, k = comm.size, comm.rank
    s = max(1, r - fewer)
    fulls = initial(rng)
    sub = comm.Split(0 if k < s else 1, k)
    plan_a = {"t0": "row_wise", "t1": "column_wise", "t2": pl.ParameterSharding("table_wise", [s - 1]),
              "t3": "data_parallel"}
    plan_b = {"t0": pl.ParameterSharding("table_wise", [r - 1]), "t1": "data_parallel", "t2": "row_wise",
              "t3": "column_wise"}
    saved = None
    if k < s:
        a = pl.EmbeddingBagCollection(configs(fulls, optimizer="adagrad"), plan=plan_a, comm=sub)
        tables, state = run_steps(sub, np.random.default_rng(5), a, fulls, steps=2, optimizer="adagrad")
        pl.save_checkpoint(shared, {"emb": a}, step=2, comm=sub)
        saved = (tables, state, {n: gathered_slot(sub, a, n, "accumulator") for n in ("t0", "t2")})
    tables, state, slots = comm.bcast(saved, root=0)
    comm.Barrier()
    b = pl.EmbeddingBagCollection(configs([f * 0 for f in fulls], optimizer="adagrad"), plan=plan_b)
    pl.load_checkpoint(shared / "step-00000002", {"emb": b})
    for i in range(4):
        np.testing.assert_allclose(b.tables[f"t{i}"].get_embedding_tensor(), tables[i], rtol=1e-5, atol=1e-5)
    for name, want in slots.items():
        np.testing.assert_array_equal(gathered_slot(comm, b, name, "accumulator"), want)
    np.testing.assert_allclose(gathered_slot(comm, b, "t0", "accumulator"), state[0], rtol=1e-5)
    # a HostEmbedding saved TOKEN loads into a collection's table
    host = pl.create_host_embedding("h", [23, 5], initializer=tables[2].astype(np.float32))
    pl.save_checkpoint(shared / "host", {"t": host}, step=0)
    c = pl.EmbeddingBagCollection(configs([f * 0 for f in fulls]), plan=plan_b)
    pl.load_checkpoint(shared / "host" / "step-00000000", {"t": c.tables["t2"]})
    np.testing.assert_array_equal(c.tables["t2"].get_embedding_tensor(), host.get_embedding_tensor())


@pytest.mark.mpi
def test_checkpoint_with_a_hostile_plan_record_is_refused_before_anything_changes(shared, comm, rng):
    fulls = initial(rng)
    a = pl.EmbeddingBagCollection(configs(fulls), plan=PLACEMENTS["mixed"](comm.size))
    pl.save_checkpoint(shared, {"emb": a}, step=1)
    comm.Barrier()
    if comm.rank == 0:
        path = shared / "step-00000001" / "manifest.json"
        manifest = json.loads(path.read_text())
        manifest["objects"]["emb"]["plan"]["tables"]["t1"]["ranks"] = ["../../etc"]
        path.write_text(json.dumps(manifest))
    comm.Barrier()
    b = pl.EmbeddingBagCollection(configs([f + 1 for f in fulls]), plan=PLACEMENTS["row_wise"](comm.size))
    before = {n: t.get_embedding_tensor() for n, t in b.tables.items()}
    with pytest.raises(pl.CheckpointError, match=r"plan record: table 't1'"):
        pl.load_checkpoint(shared / "step-00000001", {"emb": b})
    for n, t in b.tables.items():
        np.testing.assert_array_equal(t.get_embedding_tensor(), before[n])
