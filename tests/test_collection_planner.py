"""The sharding planner's choices in one process (a given Topology: no MPI): small
tables replicated, many tables spread whole over the replicas, a table too large for
one replica's share split row-wise, constraints and fixed placements obeyed, memory and
disk capacities respected (a disk table's rows count against the disk), errors naming
the table, the printed plan, and plan records checked as untrusted input."""

import numpy as np
import pytest

import popdist_lite as pl
from popdist_lite.embedding.planner import DATA_PARALLEL_MAX_BYTES

GiB = 1 << 30


def bag(name, t, e=64, **kwargs):
    return pl.EmbeddingBagConfig(t, e, name, feature_names=[name + "_f"],
                                 optimizer=pl.HostEmbeddingOptimizerSpec(0.1), **kwargs)


def plan_of(tables, r=4, memory=64 * GiB, disk=1 << 62, **planner):
    topology = pl.Topology(r, memory_bytes=memory, disk_bytes=disk)
    return pl.EmbeddingShardingPlanner(topology, **planner).plan(tables)


def kinds(plan):
    return {name: (s.sharding_type.value, list(s.ranks)) for name, s in plan.shardings.items()}


def test_small_tables_are_replicated_many_spread_whole_and_a_large_one_split():
    tiny = [bag(f"tiny{i}", 100) for i in range(3)]  # 100 x 64 x 4 bytes: far below 1 MiB
    medium = [bag(f"m{i}", 50_000) for i in range(12)]  # 12.8 MB each
    huge = bag("huge", 2_000_000)
    plan = plan_of(tiny + medium + [huge])
    got = kinds(plan)
    assert got["huge"] == ("row_wise", [0, 1, 2, 3])  # its size alone exceeds a replica's share
    owners = [got[t.name][1][0] for t in medium]
    assert all(got[t.name][0] == "table_wise" for t in medium)
    assert sorted(np.bincount(owners, minlength=4)) == [3, 3, 3, 3]  # balanced: equal tables, equal counts
    for t in tiny:  # beside larger tables, small ones join the others' stack
        assert got[t.name][0] == "table_wise"
    alone = plan_of(tiny)  # every table small: all replicated, lookups exchange no rows
    for t in tiny:
        assert kinds(alone)[t.name] == ("data_parallel", [0, 1, 2, 3])
    assert "data_parallel" in str(alone) and "small" in alone.tables["tiny0"].reason


def test_one_replica_and_a_lone_table():
    assert kinds(plan_of([bag("a", 1000), bag("b", 10)], r=1)) == {"a": ("row_wise", [0]), "b": ("row_wise", [0])}
    assert kinds(plan_of([bag("big", 1_000_000)], r=2)) == {"big": ("row_wise", [0, 1])}


def test_constraints_and_fixed_placements_are_obeyed():
    tables = [bag("a", 100), bag("b", 50_000), bag("c", 50_000), bag("d", 50_000)]
    constraints = {"a": pl.ParameterConstraints(sharding_types=["row_wise"]),
                   "b": pl.ParameterConstraints(sharding_types=["column_wise"]),
                   "c": pl.ParameterConstraints(sharding_types=["table_wise"], ranks=[2])}
    plan = pl.EmbeddingShardingPlanner(pl.Topology(4), constraints=constraints).plan(
        tables, fixed={"d": pl.ParameterSharding("data_parallel")})
    assert kinds(plan) == {"a": ("row_wise", [0, 1, 2, 3]), "b": ("column_wise", [0, 1, 2, 3]),
                           "c": ("table_wise", [2]), "d": ("data_parallel", [0, 1, 2, 3])}
    with pytest.raises(ValueError, match=r"table 'b': placement row_wise is not among its constraint's "
                                         r"\['column_wise'\]"):
        pl.EmbeddingShardingPlanner(pl.Topology(4), constraints=constraints).plan(
            tables, fixed={"b": pl.ParameterSharding("row_wise")})
    with pytest.raises(ValueError, match=r"constraints for unknown tables \['zz'\]"):
        pl.EmbeddingShardingPlanner(pl.Topology(4), constraints={"zz": pl.ParameterConstraints()}).plan(tables)


def test_memory_decides_whole_or_split_and_refuses_what_does_not_fit():
    t = bag("t", 100_000)  # 25.6 MB: not whole in 20 MB, a quarter of it (6.4 MB) fits
    four = kinds(plan_of([t] + [bag(f"u{i}", 100_000) for i in range(3)], memory=30_000_000))
    assert sorted(owners[1][0] for owners in four.values() if owners[0] == "table_wise") == [0, 1, 2, 3]
    assert kinds(plan_of([t, bag("u", 100_000)], memory=30_000_000))["t"][0] == "row_wise"  # whole: unbalanced
    assert kinds(plan_of([t], memory=20_000_000))["t"] == ("row_wise", [0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"table 't' placed row_wise needs 6.1 MiB of memory and 0 B of disk on "
                                         r"replica 0, which has 4.8 MiB and .* left"):
        plan_of([t], memory=5_000_000)
    # a replica without room for a table whole is skipped; split, the tables would not fit replica 0
    got = kinds(plan_of([bag("w", 100_000), bag("x", 100_000)], memory=[1_000_000, 60_000_000, 60_000_000,
                                                                       60_000_000]))
    assert got["w"][0] == got["x"][0] == "table_wise" and 0 not in (got["w"][1][0], got["x"][1][0])
    # eight such tables in 4 x 60 MB: whole ones leave room for the split ones
    eight = [bag(f"e{i}", 100_000) for i in range(8)]
    plan = plan_of(eight, memory=60_000_000)
    assert max(sum(t.memory[k] for t in plan.tables.values()) for k in range(4)) <= 60_000_000


def test_disk_storage_counts_as_capacity(tmp_path):
    storage = pl.DiskStorage(cache_bytes=1 << 20, directory=str(tmp_path))
    big = bag("big", 400_000, storage=storage)  # 102 MB of rows, 1 MiB of cache
    plan = plan_of([big], r=2, memory=10_000_000, disk=200_000_000)
    assert kinds(plan)["big"] == ("row_wise", [0, 1])
    row = plan.tables["big"]
    assert row.disk == [51_200_000, 51_200_000] and row.memory == [(1 << 20) + 4 * 200_000] * 2
    with pytest.raises(ValueError, match=r"table 'big' placed row_wise needs .* of disk on replica 0"):
        plan_of([big], r=2, memory=10_000_000, disk=10_000_000)
    with pytest.raises(ValueError, match=r"a disk table \(storage=DiskStorage\) cannot be data-parallel"):
        pl.EmbeddingShardingPlanner(pl.Topology(2)).plan([big], fixed={"big": pl.ParameterSharding("data_parallel")})


def test_data_parallel_threshold_counts_optimizer_state():
    rows = DATA_PARALLEL_MAX_BYTES // (64 * 4)  # weights alone at the threshold
    sgd = bag("sgd", rows)
    adam = pl.EmbeddingBagConfig(rows, 64, "adam", feature_names=["f"],
                                 optimizer=pl.HostEmbeddingAdamOptimizerSpec(0.1))
    assert kinds(plan_of([sgd], r=2))["sgd"][0] == "data_parallel"
    assert kinds(plan_of([adam], r=2))["adam"][0] != "data_parallel"  # Adam triples its bytes


def test_printed_plan_and_records():
    plan = plan_of([bag("a", 100), bag("b", 50_000), bag("c", 5_000_000)], r=2)
    text = str(plan)
    lines = text.splitlines()
    assert lines[0] == lines[-1] and set(lines[0]) == {"#"}
    assert "sharding plan: 3 table(s) over 2 replica(s)" in text and "Parameter Info:" in text
    for name, s in plan.shardings.items():
        assert any(line.startswith(f"# {name} ") and s.sharding_type.value in line for line in lines), name
    record = plan.record()
    again = pl.ShardingPlan.from_record(record, ["a", "b", "c"])
    assert again.shardings == plan.shardings and "from a record" in str(again)
    bad = [({"num_replicas": 0, "tables": {}}, "num_replicas"),
           ({"num_replicas": 2, "tables": []}, "tables: expected an object"),
           ({**record, "tables": {**record["tables"], "a": {"sharding": "row_wise", "ranks": ["x"]}}},
            "table 'a': expected sharding and ranks"),
           ({**record, "tables": {**record["tables"], "a": {"sharding": "table_wise", "ranks": [0, 1]}}},
            "table_wise placement needs ranks"),
           ({**record, "tables": {**record["tables"], "a": {"sharding": "sideways", "ranks": [0, 1]}}},
            "expected a sharding type"),
           ([1, 2], "expected an object")]
    for value, message in bad:
        with pytest.raises(ValueError, match=message):
            pl.ShardingPlan.from_record(value, ["a", "b", "c"])
    with pytest.raises(ValueError, match="holds the tables"):
        pl.ShardingPlan.from_record(record, ["a", "b"])
