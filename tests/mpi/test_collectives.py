"""Collectives against a numpy reference built from every replica's (known) input."""

import numpy as np
import pytest

import popdist_lite as pl

DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]


def inputs(rng, r, shape, dtype):
    """Every replica's input, shape (r, *shape), drawn identically on every rank."""
    data = rng.integers(-50, 50, size=(r, *shape))
    return data.astype(dtype) if np.dtype(dtype).kind in "iu" else (data / 8).astype(dtype)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES + [np.bool_, np.uint8])
@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (0, 2)])
def test_all_gather(comm, rng, dtype, shape):
    x = inputs(rng, comm.size, shape, dtype)
    out = pl.all_gather(x[comm.rank])
    assert out.dtype == np.dtype(dtype) and out.shape == (comm.size, *shape)
    np.testing.assert_array_equal(out, x)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather_v_ragged(comm, rng, dtype):
    rows = [(3 * k + 1) % 4 for k in range(comm.size)]  # 1, 0, 3, 2: includes an empty replica
    parts = [inputs(rng, 1, (n, 3), dtype)[0] for n in rows]
    values, counts = pl.all_gather_v(parts[comm.rank])
    np.testing.assert_array_equal(counts, rows)
    np.testing.assert_array_equal(values, np.concatenate(parts))


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter_sum(comm, rng, dtype):
    r = comm.size
    x = inputs(rng, r, (r, 4, 3), dtype)
    out = pl.reduce_scatter_sum(x[comm.rank])
    expected = x.astype(np.float64).sum(axis=0)[comm.rank].astype(dtype)
    assert out.dtype == np.dtype(dtype) and out.shape == (4, 3)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.mpi
def test_float16_sums_rounded_once(comm):
    # 2048 + 1 + ... : float16 accumulation would lose every +1; one rounding keeps them
    # once they add up to a representable step.
    r = comm.size
    base = np.float16(2048) if comm.rank == 0 else np.float16(1)
    out = pl.all_reduce(np.array([base], np.float16))
    assert out[0] == np.float16(2048.0 + (r - 1))


@pytest.mark.mpi
@pytest.mark.parametrize("split_axis,concat_axis", [(0, 0), (0, 1), (1, 0), (-1, 1), (2, 0)])
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.float16])
def test_all_to_all(comm, rng, split_axis, concat_axis, dtype):
    r = comm.size
    shape = [2 * r, 3, 2 * r]
    shape[split_axis] = 2 * r
    x = inputs(rng, r, tuple(shape), dtype)
    out = pl.all_to_all(x[comm.rank], split_axis=split_axis, concat_axis=concat_axis)
    chunks = [np.split(x[j], r, axis=split_axis)[comm.rank] for j in range(r)]
    np.testing.assert_array_equal(out, np.concatenate(chunks, axis=concat_axis))


@pytest.mark.mpi
def test_all_to_all_v(comm, rng):
    r = comm.size
    splits = rng.integers(0, 4, size=(r, r))  # splits[i, j]: rows replica i sends to j
    data = [inputs(rng, 1, (int(splits[i].sum()), 2), np.float32)[0] for i in range(r)]
    out, got = pl.all_to_all_v(data[comm.rank], splits[comm.rank])
    np.testing.assert_array_equal(got, splits[:, comm.rank])
    pieces = [np.split(data[i], np.cumsum(splits[i])[:-1])[comm.rank] for i in range(r)]
    np.testing.assert_array_equal(out, np.concatenate(pieces))


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce(comm, rng, op, dtype):
    x = inputs(rng, comm.size, (3, 5), dtype)
    out = pl.all_reduce(x[comm.rank], op=op)
    wide = x.astype(np.float64)
    expected = {"sum": wide.sum(0), "mean": wide.mean(0), "max": wide.max(0), "min": wide.min(0)}[op]
    if op == "mean" and np.dtype(dtype).kind in "iu":
        assert out.dtype == np.float64
    else:
        assert out.dtype == np.dtype(dtype)
        expected = expected.astype(dtype)
    np.testing.assert_allclose(out, expected, rtol=1e-6 if dtype != np.float16 else 1e-3)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast(comm, rng, dtype):
    x = inputs(rng, comm.size, (4, 2), dtype)
    for root in range(comm.size):
        np.testing.assert_array_equal(pl.broadcast(x[comm.rank], root=root), x[root])


# -- bad input: the same error on every replica, never a hang; the runtime keeps working --

def last_rank_differs(comm, good, bad):
    return bad if comm.rank == comm.size - 1 and comm.size > 1 else good


@pytest.mark.mpi(min_size=2)
def test_shape_mismatch_raises_everywhere(comm):
    x = last_rank_differs(comm, np.zeros((2, 3), np.float32), np.zeros((3, 3), np.float32))
    with pytest.raises(ValueError, match=rf"all_gather: argument x: replica {comm.size - 1} passed shape \(3, 3\)"):
        pl.all_gather(x)
    assert pl.all_reduce(np.array([1.0]))[0] == comm.size  # still in step


@pytest.mark.mpi(min_size=2)
def test_dtype_mismatch_raises_everywhere(comm):
    x = last_rank_differs(comm, np.zeros(4, np.float32), np.zeros(4, np.float64))
    with pytest.raises(TypeError, match=rf"replica {comm.size - 1} passed dtype float64, expected float32"):
        pl.all_reduce(x)


@pytest.mark.mpi
def test_reduce_scatter_wrong_first_dim_raises_everywhere(comm):
    x = last_rank_differs(comm, np.zeros((comm.size, 2)), np.zeros((comm.size + 1, 2)))
    if comm.size == 1:
        x = np.zeros((2, 2))
    with pytest.raises(ValueError, match=rf"reduce_scatter_sum: replica {comm.size - 1}: argument x: "
                                         rf"expected x.shape\[0\] == {comm.size}"):
        pl.reduce_scatter_sum(x)


@pytest.mark.mpi
def test_bad_op_and_root(comm):
    with pytest.raises(ValueError, match="argument op: expected one of"):
        pl.all_reduce(np.zeros(2), op=last_rank_differs(comm, "sum", "prod") if comm.size > 1 else "prod")
    with pytest.raises(ValueError, match="argument root"):
        pl.broadcast(np.zeros(2), root=comm.size)
    if comm.size > 1:
        with pytest.raises(ValueError, match="argument op: replica"):
            pl.all_reduce(np.zeros(2), op=last_rank_differs(comm, "sum", "max"))


@pytest.mark.mpi
def test_unsupported_dtype(comm):
    with pytest.raises(TypeError, match="expected one of the dtypes"):
        pl.all_gather(np.array(["a", "b"]))
    with pytest.raises(TypeError, match="numeric dtype"):
        pl.all_reduce(np.array([True]))


@pytest.mark.mpi(min_size=2)
def test_different_collectives_are_named_not_deadlocked(comm):
    x = np.zeros(4, np.float32)
    with pytest.raises(RuntimeError, match="collective mismatch: replica 0 called all_reduce .* but replica 1 called broadcast"):
        if comm.rank == 0:
            pl.all_reduce(x)
        else:
            pl.broadcast(x)
    np.testing.assert_array_equal(pl.all_gather(np.array([comm.rank])).ravel(), np.arange(comm.size))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", ["shape", "op", "collective"])
def test_mismatch_after_the_same_call_agreed(comm, case):
    """A call that agreed before takes a cached fast path on the replicas that repeat it;
    a replica that deviates from it is still named, with the same error everywhere."""
    x = np.ones(5, np.float32)
    for _ in range(2):
        assert pl.all_reduce(x)[0] == comm.size  # agreed, so now a repeat on every replica
    deviating, last = comm.rank == comm.size - 1, comm.size - 1
    if case == "shape":
        with pytest.raises(ValueError, match=rf"all_reduce: argument x: replica {last} passed shape \(6,\), "
                                             rf"expected the same shape as replica 0, which passed \(5,\)"):
            pl.all_reduce(np.ones(6, np.float32) if deviating else x)
    elif case == "op":
        with pytest.raises(ValueError, match=rf"all_reduce: argument op: replica {last} passed 'max', "
                                             rf"expected 'sum' as on replica 0"):
            pl.all_reduce(x, op="max" if deviating else "sum")
    else:
        with pytest.raises(RuntimeError, match=rf"collective mismatch: replica 0 called all_reduce .* "
                                               rf"but replica {last} called broadcast"):
            pl.broadcast(x) if deviating else pl.all_reduce(x)
    assert pl.all_reduce(x)[0] == comm.size  # still in step


@pytest.mark.mpi(min_size=2)
def test_a_replica_that_skipped_a_call_is_named(comm):
    """The last replica's call number runs one ahead, as if it had skipped a collective:
    its next all_reduce meets the others' and every replica raises, naming both call
    numbers, instead of summing two different calls."""
    from popdist_lite.collectives import next_call_number

    work, last = comm.Dup(), comm.size - 1
    x = np.ones(3, np.float32)
    for _ in range(2):  # calls #0 and #1, agreed: the next is a repeat (the fast path)
        assert pl.all_reduce(x, comm=work)[0] == comm.size
    if comm.rank == last:
        next_call_number(work, "all_reduce")  # call #2 taken, never made
    with pytest.raises(RuntimeError, match=rf"collective mismatch: replica 0 called all_reduce \(collective call "
                                           rf"#2\) but replica {last} called all_reduce \(call #3\)"):
        pl.all_reduce(x, comm=work)
    work.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("call", ["all_gather_v", "all_to_all_v"])
def test_ragged_collectives_refuse_another_trailing_shape(comm, call):
    """Replica 0 passes shape (2, 3), the others (3, 4): the first dimensions may
    differ, the trailing ones may not; the same ValueError, naming replica 1, on every
    replica, before any data moves."""
    x = np.zeros((2, 3) if comm.rank == 0 else (3, 4), np.float32)
    with pytest.raises(ValueError, match=rf"{call}: argument x: replica 1 passed shape \(3, 4\), expected the "
                                         rf"same shape after axis 0 as replica 0, which passed \(2, 3\)"):
        if call == "all_gather_v":
            pl.all_gather_v(x)
        else:
            pl.all_to_all_v(x, [len(x)] + [0] * (comm.size - 1))
    assert pl.all_reduce(np.array([1.0]))[0] == comm.size  # still in step


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int64])
def test_out_receives_the_result(comm, rng, dtype):
    """``out=`` on every collective, float16 (whose reductions take their own path) included."""
    r, k = comm.size, comm.rank
    x = inputs(rng, r, (r, 3), dtype)  # x[j]: replica j's input, (r, 3)
    mine = x[k].copy()
    for op in ("sum", "mean", "max"):
        if op == "mean" and np.dtype(dtype).kind in "iu":
            continue  # float64 result: out= is refused (tested below)
        out = np.empty_like(mine)
        assert pl.all_reduce(mine, op=op, out=out) is out
        np.testing.assert_array_equal(out, pl.all_reduce(mine, op=op))
        inplace = mine.copy()
        assert pl.all_reduce(inplace, op=op, out=inplace) is inplace
        np.testing.assert_array_equal(inplace, out)
    exact = x.astype(np.float64).sum(axis=0)
    if np.dtype(dtype) == np.float16:  # float16: the one rounding of the exact sum, into out as well
        np.testing.assert_array_equal(pl.all_reduce(mine, out=np.empty_like(mine)), exact.astype(dtype))
    out = np.empty(3, dtype)
    assert pl.reduce_scatter_sum(mine, out=out) is out
    np.testing.assert_array_equal(out, pl.reduce_scatter_sum(mine))
    np.testing.assert_allclose(out.astype(np.float64), exact[k], rtol=1e-3)
    out = np.empty((r, r, 3), dtype)
    assert pl.all_gather(mine, out=out) is out
    np.testing.assert_array_equal(out, x)
    out = np.empty((r, 3), dtype)
    assert pl.all_to_all(mine, out=out) is out
    np.testing.assert_array_equal(out, x[:, k])
    out = np.empty((r, 3), dtype)
    got = pl.broadcast(mine, root=r - 1, out=out)
    assert got is (mine if k == r - 1 else out)
    np.testing.assert_array_equal(got, x[r - 1])
    with pytest.raises(ValueError, match=rf"all_reduce: replica {r - 1}: argument out: expected a writeable"):
        pl.all_reduce(mine, out=np.empty((r, 4), dtype) if k == r - 1 else None)
    with pytest.raises(ValueError, match=rf"reduce_scatter_sum: replica {r - 1}: argument out"):
        pl.reduce_scatter_sum(mine, out=np.empty(3, np.float64 if dtype != np.float64 else np.float32)
                              if k == r - 1 else None)
    if np.dtype(dtype).kind in "iu":
        with pytest.raises(ValueError, match="argument out: not supported for the mean of integers"):
            pl.all_reduce(mine, op="mean", out=np.empty_like(mine))


@pytest.mark.mpi
def test_unchecked_collectives_match_checked(comm, rng):
    """set_collective_checks(False) skips the signature exchange, same results."""
    x = inputs(rng, comm.size, (comm.size, 3), np.float32)
    checked = [pl.all_gather(x[comm.rank]), pl.all_reduce(x[comm.rank]), pl.reduce_scatter_sum(x[comm.rank]),
               pl.all_to_all(x[comm.rank]), pl.broadcast(x[comm.rank], root=comm.size - 1)]
    before = pl.stats()["collectives"].get("agree", {}).get("calls", 0)
    previous = pl.set_collective_checks(False)
    try:
        unchecked = [pl.all_gather(x[comm.rank]), pl.all_reduce(x[comm.rank]), pl.reduce_scatter_sum(x[comm.rank]),
                     pl.all_to_all(x[comm.rank]), pl.broadcast(x[comm.rank], root=comm.size - 1)]
        with pytest.raises(ValueError, match=f"replica {comm.rank}: argument root"):
            pl.broadcast(x[comm.rank], root=comm.size)  # a local error is still raised locally
    finally:
        pl.set_collective_checks(previous)
    assert previous is True
    assert pl.stats()["collectives"].get("agree", {}).get("calls", 0) == before
    for a, b in zip(checked, unchecked):
        np.testing.assert_array_equal(a, b)


@pytest.mark.mpi
def test_call_numbers_live_on_the_mpi_communicator(comm):
    """Call numbers (the collective checks' order) belong to the MPI communicator, not to
    a Python object: a communicator made after another was freed starts at 0 even when
    its Python object takes the freed one's address (which happened on some replicas
    only, so their checks disagreed), two Python objects of one communicator share
    theirs, a duplicate has its own, and collectives on the new one agree."""
    from mpi4py import MPI

    from popdist_lite.collectives import next_call_number

    old = comm.Dup()
    for _ in range(3):
        next_call_number(old, "probe")
    old.Free()
    del old
    new = comm.Dup()
    assert next_call_number(new, "probe") == 0
    assert next_call_number(MPI.Intracomm(new), "probe") == 1  # another Python object, the same communicator
    dup = new.Dup()
    assert next_call_number(dup, "probe") == 0
    x = np.arange(4.0)
    np.testing.assert_array_equal(pl.all_reduce(x, op="sum", comm=new), x * comm.size)
    dup.Free()
    new.Free()


@pytest.mark.mpi
def test_agree_objects_gathers_every_replicas_value(comm):
    from popdist_lite.collectives import agree_objects

    values = [{"replica": k, "pad": "x" * (7 * k)} for k in range(comm.size)]  # pickles of different lengths
    assert agree_objects("probe", values[comm.rank], comm) == values
    last = comm.size - 1
    problem = pl.collectives.Problem(KeyError, "no such table") if comm.rank == last else None
    with pytest.raises(KeyError, match=rf"probe: replica {last}: no such table"):
        agree_objects("probe", 1, comm, problem=problem)
    with pytest.raises(TypeError, match=rf"probe: replica {last}: argument value: cannot be pickled"):
        agree_objects("probe", (lambda: 0) if comm.rank == last else 1, comm)
    assert agree_objects("probe", comm.rank, comm) == list(range(comm.size))  # still in step


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("other", ["all_reduce", "broadcast"])
def test_pickled_agreement_meeting_a_buffer_agreement_is_a_mismatch(comm, other):
    """agree_objects carries its operation and call number: against a checked collective
    on another replica, every replica raises 'collective mismatch' (it used to gather
    pickles into the other replica's signature buffer)."""
    from popdist_lite.collectives import agree_objects

    x = np.ones(4, np.float32)
    pl.all_reduce(x)  # agreed before: the other replica takes the cached fast path
    last = comm.size - 1
    with pytest.raises(RuntimeError, match=rf"collective mismatch: replica 0 called agree_objects .* "
                                           rf"but replica {last} called {other}"):
        if comm.rank == last:
            getattr(pl, other)(x)
        else:
            agree_objects("probe", {"big": "y" * 1000}, comm)
    assert pl.all_reduce(x)[0] == comm.size  # still in step


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_all_reduce_complex(comm, rng, dtype, op):
    r = comm.size
    x = (inputs(rng, r, (3, 4), np.float64) + 1j * inputs(rng, r, (3, 4), np.float64)).astype(dtype)
    out = pl.all_reduce(x[comm.rank], op=op)
    expected = x.astype(np.complex128).sum(axis=0) / (r if op == "mean" else 1)
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    with pytest.raises(TypeError, match="complex dtypes have no order"):
        pl.all_reduce(x[comm.rank], op="max")


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int64, np.complex64])
@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_all_reduce_start_matches_all_reduce(comm, rng, dtype, op):
    """The non-blocking all-reduce gives all_reduce's result in place (float16: the same
    one rounding), numbered when waited for, on the communicator it is told to."""
    from popdist_lite import calls
    from popdist_lite.collectives import all_reduce_start

    if (op == "mean" and np.dtype(dtype).kind == "i") or (op == "max" and np.dtype(dtype).kind == "c"):
        with pytest.raises(TypeError, match="all_reduce_start: argument x: cannot reduce"):
            all_reduce_start(np.zeros(2, dtype), op, comm=comm)
        return
    x = inputs(rng, comm.size, (7,), np.float64) * (1 + 1j if np.dtype(dtype).kind == "c" else 1)
    x = x.astype(dtype)
    mine = x[comm.rank].copy()
    dup = comm.Dup()
    try:
        numbers = calls.comm_cache(comm).get(calls._CALLS, 0)
        pending = all_reduce_start(mine, op, comm=dup, numbered_on=comm)
        pending.test()
        assert calls.comm_cache(comm).get(calls._CALLS, 0) == numbers  # not yet: numbered at the wait
        assert pending.wait() is mine
        assert calls.comm_cache(comm)[calls._CALLS] == numbers + 1
        assert calls.comm_cache(dup).get(calls._CALLS, 0) == 0
    finally:
        dup.Free()
    np.testing.assert_array_equal(mine, pl.all_reduce(x[comm.rank], op=op))
