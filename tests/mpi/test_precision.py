"""Reduced precision at 1-4 ranks: float16 collectives against float64 references,
replica-identical stochastic rounding, loss scaling with an overflow on one replica,
dense optimizers (SGD, momentum, Adam) with and without replicated tensor sharding."""

import numpy as np
import pytest

import popdist_lite as pl

F16 = np.float16


def wide_range_f16(rng, shape):
    """float16 values spread over many binades (subnormals to thousands), both signs."""
    mant = rng.standard_normal(shape)
    return (mant * 2.0 ** rng.integers(-26, 12, size=shape)).astype(F16)


# -- float16 collectives: float16 on the wire, one rounding of the exact sum --------------

@pytest.mark.mpi
@pytest.mark.parametrize("shape", [(7,), (3, 5), (0, 2)])
def test_f16_reduce_scatter_is_the_rounding_of_the_exact_sum(comm, rng, shape):
    r = comm.size
    x = wide_range_f16(rng, (r, r) + shape)  # x[j]: replica j's input
    out = pl.reduce_scatter_sum(x[comm.rank])
    expected = x.astype(np.float64).sum(axis=0)[comm.rank].astype(F16)
    assert out.dtype == F16 and out.shape == shape
    np.testing.assert_array_equal(out, expected)


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
@pytest.mark.parametrize("shape", [(), (1,), (11,), (4, 6)])
def test_f16_all_reduce_against_float64(comm, rng, op, shape):
    x = wide_range_f16(rng, (comm.size,) + shape)
    out = pl.all_reduce(x[comm.rank], op=op)
    wide = x.astype(np.float64)
    expected = {"sum": wide.sum(0), "mean": wide.sum(0) / comm.size, "max": wide.max(0), "min": wide.min(0)}[op]
    assert out.dtype == F16 and out.shape == shape
    np.testing.assert_array_equal(out, expected.astype(F16))


@pytest.mark.mpi(min_size=2)
def test_f16_sum_is_not_an_accumulation_of_f16_roundings(comm):
    """2048 + 1 + 1 + ...: float16 running sums lose every +1 (2049 ties to 2048), the
    exact sum keeps them. With a third replica adding 2**-24, a float32 accumulator
    would land exactly on the tie 2049 and round to 2048; the exact sum rounds up."""
    r, k = comm.size, comm.rank
    values = np.zeros(r, np.float64)
    values[0], values[1:] = 2048.0, 1.0
    if r >= 3:
        values[2] = 2.0 ** -24
    mine = np.array([values[k]], F16)
    total = pl.all_reduce(mine)[0]
    exact = np.float16(values.sum())
    assert total == exact
    running = np.float16(0)
    for v in values.astype(F16):
        running = np.float16(running + v)
    if r >= 3:
        assert running == 2048 and exact == 2050  # the oracle distinguishes the two
    if r == 3:
        assert np.float16(np.float32(2048) + np.float32(1) + np.float32(2.0 ** -24)) == 2048


@pytest.mark.mpi
def test_f16_collectives_send_half_the_bytes(comm, rng):
    r, n = comm.size, 12 * comm.size
    x32 = rng.standard_normal(n).astype(np.float32)
    pl.comm_stats(reset=True)
    pl.all_reduce(x32)
    b32 = pl.comm_stats(reset=True)["payload_bytes"]
    pl.all_reduce(x32.astype(F16))
    b16 = pl.comm_stats(reset=True)["payload_bytes"]
    assert b32 == 2 * (r - 1) * n * 4 // r  # ring-algorithm figure for MPI's all-reduce
    assert b16 * 2 == b32
    pl.reduce_scatter_sum(x32.reshape(r, -1))
    rs32 = pl.comm_stats(reset=True)["payload_bytes"]
    pl.reduce_scatter_sum(x32.reshape(r, -1).astype(F16))
    rs16 = pl.comm_stats(reset=True)["payload_bytes"]
    assert rs16 * 2 == rs32 == (r - 1) * n * 4 // r


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["TOKEN", "ENCODING"])
def test_f16_table_lookup_moves_f16(comm, rng, strategy):
    t, e, r = 13, 6, comm.size
    full = rng.standard_normal((t, e)).astype(F16)
    emb = pl.create_host_embedding("f16wire", shape=[t, e], dtype=F16, partition_strategy=strategy, initializer=full)
    idx = rng.integers(0, t, size=(r, 9))
    pl.comm_stats(reset=True)
    out = emb.lookup(idx[comm.rank])
    stats = pl.comm_stats(reset=True)
    assert out.dtype == F16
    np.testing.assert_array_equal(out, full[idx[comm.rank]])
    index_bytes = 9 * 8 * (r - 1)  # the int64 index all-gather
    row_bytes = stats["payload_bytes"] - index_bytes
    if strategy == "TOKEN":  # each replica sends the other replicas' positions: (r-1) * 9 rows of e float16
        assert row_bytes == (r - 1) * 9 * e * 2
    else:  # ENCODING: r-1 column slices of c = ceil(e/r) float16 per index
        assert row_bytes == (r - 1) * 9 * (-(-e // r)) * 2
