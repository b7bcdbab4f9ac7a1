"""The resharding planner against numpy: split a global array as r writers hold it,
reassemble every reader's part at r' readers with plan() + copy_piece(), and compare with
the part sliced directly from the global array."""

import itertools

import numpy as np
import pytest

from popdist_lite.checkpoint.partition import Partition, copy_piece, intersect, plan

PARTITIONS = [Partition("replicated"), Partition("cyclic", 0), Partition("block", 0), Partition("block", 1),
              Partition("cyclic", 1)]


def _local(global_array, partition, replicas, replica):
    """What ``replica`` holds, padded as the owners pad (ceil(n/r) along the axis)."""
    if partition.kind == "replicated":
        return global_array.copy()
    n = global_array.shape[partition.axis]
    padded = list(global_array.shape)
    padded[partition.axis] = -(-n // replicas)
    out = np.full(padded, -1.0)
    index = [slice(None)] * global_array.ndim
    index[partition.axis] = partition.held(n, replicas, replica)
    part = global_array[tuple(index)]
    dest = [slice(None)] * global_array.ndim
    dest[partition.axis] = slice(0, part.shape[partition.axis])
    out[tuple(dest)] = part
    return out


@pytest.mark.parametrize("source,target", list(itertools.product(PARTITIONS, PARTITIONS)))
@pytest.mark.parametrize("shape", [(11, 5), (3, 7), (1, 1)])
def test_reshard_matches_numpy(source, target, shape):
    g = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
    for writers, readers in [(2, 1), (2, 3), (2, 4), (3, 2), (4, 4), (1, 5)]:
        files = {w: source.local_view(_local(g, source, writers, w), shape, writers, w)
                 for w in source.writers(writers)}
        for reader in range(readers):
            want = _local(g, target, readers, reader)
            got = np.full(want.shape, -1.0)
            for w, data in files.items():
                assert data.shape == source.file_shape(shape, writers, w)
                piece = plan(shape, target, readers, reader, source, writers, w)
                if piece is not None:
                    copy_piece(got, data, piece, chunk_bytes=16)  # tiny chunks: many parts
            np.testing.assert_array_equal(got, want, err_msg=f"{source}->{target} {writers}->{readers} #{reader}")


def test_scalar():
    got = np.zeros(())
    piece = plan((), Partition("replicated"), 3, 1, Partition("replicated"), 2, 0)
    copy_piece(got, np.array(4.5), piece, 16)
    assert got == 4.5


def test_intersect_matches_sets():
    """Every pair of small progressions: the shared indices, in each side's local order,
    against Python's set intersection."""
    progressions = [slice(start, stop, step) for step in range(1, 7) for start in range(0, 9)
                    for stop in range(start, 24, 5)]
    for want, have in itertools.product(progressions, progressions):
        w, h = range(want.start, want.stop, want.step), range(have.start, have.stop, have.step)
        common = sorted(set(w) & set(h))
        mine, theirs = intersect(want, have)
        assert [w[i] for i in range(len(w))[mine]] == common, (want, have)
        assert [h[i] for i in range(len(h))[theirs]] == common, (want, have)
