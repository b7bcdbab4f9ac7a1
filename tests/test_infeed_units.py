"""Single-process unit tests of the infeed pieces, the launcher's feeder plan and the
report's feeder titles (no MPI job)."""

import numpy as np
import pytest

from popdist_lite.infeed import feed_shard
from popdist_lite.infeed.buffers import BufferPool, shared_pool
from popdist_lite.infeed.local import ThreadSource
from popdist_lite.infeed.structure import (check_same, describe, empty_arrays, encode_shapes, flatten,
                                           layout, unflatten)
from popdist_lite.topology import _feed_layout
from popdist_lite_launcher import cli
from popdist_lite_launcher.core.plan import format_topology, plan_ranks
from popdist_lite_launcher.supervise import report


def test_flatten_roundtrip_dict_tuple_array():
    batch = {"ids": np.arange(6, dtype=np.int32).reshape(2, 3), "w": np.float16(1) * np.ones(2, np.float16)}
    structure, arrays = flatten(batch)
    assert structure == ("dict", (("ids", "<i4", 2), ("w", "<f2", 1)))
    words = np.array(encode_shapes(arrays))
    empty = empty_arrays(layout(structure), words)
    assert [a.shape for a in empty] == [(2, 3), (2,)] and empty[1].dtype == np.float16
    again = unflatten(structure, arrays)
    assert again.keys() == batch.keys() and all(np.array_equal(again[k], batch[k]) for k in batch)
    s, arrays = flatten((np.zeros(3)[::2], np.zeros((0, 4), bool)))
    assert s[0] == "tuple" and arrays[0].flags.c_contiguous and isinstance(unflatten(s, arrays), tuple)
    s, arrays = flatten(np.ones(2))
    assert unflatten(s, arrays) is arrays[0]


@pytest.mark.parametrize("bad, message", [
    ([1, 2], "field 0 is a int"),
    ({1: np.zeros(1)}, "keys must be str"),
    ({"o": np.array([None])}, "dtype object"),
    ("text", "tuple or dict of numpy arrays"),
])
def test_flatten_rejects(bad, message):
    with pytest.raises(TypeError, match=message):
        flatten(bad)


def test_structure_mismatch_message():
    a, _ = flatten({"x": np.zeros(2, np.int32)})
    b, _ = flatten({"x": np.zeros(2, np.float32)})
    check_same(a, a, "batch 1")
    with pytest.raises(TypeError, match=r"batch 3 has structure \{'x': float32 \(1-d\)\}, but "
                                        r"earlier batches have \{'x': int32 \(1-d\)\}"):
        check_same(a, b, "batch 3")
    assert describe(None) == "no batches"


def test_feed_shard_keeps_a_replica_data_for_any_f():
    # with a strided dataset, replica r's j-th batch is r + R*j for every F
    R, total = 3, 60
    for F in (0, 1, 2, 4):
        for r in range(R):
            shards = [range(*(lambda i, n: (i, total, n))(*feed_shard(r, R, F, k))) for k in range(max(F, 1))]
            order = [shards[j % len(shards)][j // len(shards)] for j in range(total // R // max(F, 1) * max(F, 1))]
            assert order == list(range(r, total, R))[:len(order)]
    assert feed_shard(1, 2, 0) == (1, 2) and feed_shard(1, 2, 1, 0) == (1, 2)
    assert feed_shard(1, 2, 3, 2) == (5, 6)


def test_buffer_pool_reuses_only_dropped_arrays():
    pool = BufferPool(4)
    a = pool.empty((8,), np.dtype("f4"))
    address = a.ctypes.data
    b = pool.empty((8,), np.dtype("f4"))
    assert b.ctypes.data != address  # a still alive
    view = a[2:]
    del a
    c = pool.empty((8,), np.dtype("f4"))
    assert c.ctypes.data != address  # a view keeps it
    del view
    assert pool.empty((8,), np.dtype("f4")).ctypes.data == address
    assert pool.empty((9,), np.dtype("f4")).shape == (9,)


def test_shared_pool_outlives_a_session_and_keeps_the_newest_arrays():
    pool = shared_pool(3)
    first = pool.empty((16,), np.dtype("u1"))
    address = first.ctypes.data
    del first  # the session ended and dropped its batches
    assert shared_pool(3) is pool  # the next session's pool is the same
    assert pool.empty((16,), np.dtype("u1")).ctypes.data == address
    held = [pool.empty((4,), np.dtype("u1")) for _ in range(3)]
    shrunk = shared_pool(2)
    assert shrunk is pool and [a.ctypes.data for a in shrunk.arrays] == [a.ctypes.data for a in held[1:]]
    shared_pool(1).arrays.clear()


def test_feed_layout_checks():
    rep = lambda: ("replica", None, None, None, None)  # noqa: E731
    fd = lambda r, k=None, f=None: ("feeder", r, k, f, None)  # noqa: E731
    assert _feed_layout([rep(), rep()]) == (0, {})
    assert _feed_layout([rep(), rep(), fd(1), fd(0), fd(0), fd(1)]) == (2, {2: 0, 3: 0, 4: 1, 5: 1})
    assert _feed_layout([rep(), fd(0, 1), fd(0, 0)]) == (2, {1: 1, 2: 0})
    assert "same number of feeders" in _feed_layout([rep(), rep(), fd(0)])
    assert "is not a replica" in _feed_layout([rep(), fd(3)])
    assert "expected each of 0..1 once" in _feed_layout([rep(), fd(0, 1), fd(0, 1)])
    assert "FEEDERS_PER_REPLICA=2" in _feed_layout([rep(), fd(0, 0, 2)])


def test_plan_with_feeders_and_topology_table():
    opts = cli.parse_args(["--num-replicas", "2", "--feeders-per-replica", "2", "-H", "h0,h1",
                           "--instance-mpi-local-args", '1:-x A=1', "python3", "train.py"])
    ranks = plan_ranks(opts)
    assert [(r.role, r.replica, r.host) for r in ranks] == [
        ("replica", 0, "h0"), ("replica", 1, "h1"), ("feeder", 0, "h0"), ("feeder", 0, "h0"),
        ("feeder", 1, "h1"), ("feeder", 1, "h1")]
    for r in ranks[:2]:  # replicas: PopDist variables unchanged
        assert r.env["POPDIST_LITE_ROLE"] == "replica" and "POPDIST_LITE_FEEDER_OF" not in r.env
    f = ranks[5].env
    assert (f["POPDIST_LITE_ROLE"], f["POPDIST_LITE_FEEDER_OF"], f["POPDIST_LITE_FEEDER_INDEX"]) == ("feeder", "1", "1")
    assert f["POPDIST_REPLICA_INDEX_OFFSET"] == "1" and f["POPDIST_LITE_FEEDERS_PER_REPLICA"] == "2"
    assert ranks[5].mpi_args == ["-x", "A=1"]
    lines = format_topology(ranks).splitlines()
    assert lines[1].split() == ["0", "0", "0", "h0", "replica"]
    assert lines[5].split() == ["1", "1", "4", "h1", "feeder", "0", "of", "replica", "1"]
    with pytest.raises(SystemExit):
        cli.parse_args(["--feeders-per-replica", "-1", "p"])


def test_report_names_the_feeder():
    record = {"kind": "exit", "rank": 5, "replica": 1, "role": "feeder", "feeder": 1, "host": "h",
              "pid": 9, "time": 1.0, "exitcode": None, "signal": "SIGKILL", "stderr_tail": "x",
              "terminated": False}
    text = report.format_report(report.merge_records([record]), 137)
    assert "root cause: feeder 1 of replica 1 (rank 5, host h, pid 9): signal SIGKILL" in text


@pytest.mark.parametrize("raised", [SystemExit(0), KeyboardInterrupt(), ValueError("bad batch")])
def test_thread_source_hands_every_base_exception_to_the_training_loop(raised):
    """F = 0: what the dataset raises in the feed thread reaches the loop; an Exception
    as it is, SystemExit/KeyboardInterrupt as the cause of a RuntimeError (which the
    failure hook reports, where a SystemExit would end the replica quietly)."""
    def make_dataset(shard, shards):
        yield np.zeros(2)
        raise raised
    source = ThreadSource(make_dataset, 1, 2, depth=2, replica=1)
    source.start()
    assert np.array_equal(source.fetch(), np.zeros(2))
    if isinstance(raised, Exception):
        with pytest.raises(ValueError, match="bad batch"):
            source.fetch()
    else:
        with pytest.raises(RuntimeError, match=f"dataset of replica 1 raised {type(raised).__name__}") as info:
            source.fetch()
        assert info.value.__cause__ is raised
    assert source.fetch() is None  # ended
    source.finish()
