"""infeed without feeders (F = 0, the replica's thread) under plain mpirun at 1-4 ranks."""

import numpy as np
import pytest

import popdist_lite as pl


def strided(n, log=None):
    def make_dataset(i, k):
        for b in range(i, n, k):
            yield (np.array([b], dtype=np.int32), np.full((b % 3, 2), b, dtype=np.float64))
    return make_dataset


@pytest.mark.mpi
@pytest.mark.parametrize("extra", [0, 1])
def test_uneven_shards_stop_together(comm, extra):
    r = comm.size
    n = 3 * r + extra * (r - 1)  # with extra: some replicas hold one more batch
    feed = pl.infeed(strided(n), prefetch_depth=2)
    got = [int(x[0]) for x, _ in feed]
    assert got == list(range(comm.rank, 3 * r, r)) and feed.steps == 3
    assert next(feed, None) is None  # stays exhausted
    assert pl.all_gather(np.array([feed.steps]))[:, 0].tolist() == [3] * r  # nobody left behind


@pytest.mark.mpi
def test_ragged_shapes_and_tuple_structure(comm):
    for x, y in pl.infeed(strided(4 * comm.size)):
        b = int(x[0])
        assert y.shape == (b % 3, 2) and y.dtype == np.float64 and np.all(y == b)


@pytest.mark.mpi
def test_new_feed_after_early_close_restarts_the_data(comm):
    feed = pl.infeed(strided(10 * comm.size))
    first = [int(next(feed)[0][0]) for _ in range(2)]
    again = pl.infeed(strided(10 * comm.size))
    assert [int(next(again)[0][0]) for _ in range(2)] == first  # starting it closed the first
    assert next(feed, None) is None
    again.close()


@pytest.mark.mpi
def test_dataset_exception_is_raised_in_the_training_loop(comm):
    def broken(i, k):
        yield (np.zeros(1),)
        raise KeyError("bad record")

    feed = pl.infeed(broken)
    next(feed)
    with pytest.raises(KeyError, match="bad record"):
        next(feed)


@pytest.mark.mpi
def test_structure_change_within_a_stream(comm):
    def changing(i, k):
        yield {"a": np.zeros(2, np.int32)}
        yield {"a": np.zeros(2, np.int64)}

    feed = pl.infeed(changing)
    next(feed)
    with pytest.raises(TypeError, match=r"batch 1 of replica \d+'s dataset has structure"):
        next(feed)
