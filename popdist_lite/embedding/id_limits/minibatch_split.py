"""Minibatching split: IDs to 64 hash buckets, the bottom-up binary-tree split over
the buckets, and the minibatches a split mask describes. Pure numpy, no MPI.

Source: the SparseCore minibatching guide of jax-tpu-embedding ("Bucketization",
"Minibatch creation") and jax-tpu-embedding's ``ComputeMinibatchingSplit``. The collective part (the OR all-reduce of the mask) is in
:mod:`.enforcer`.

Bucket of an ID
    ``splitmix64(id) & 63``: the SplitMix64 finaliser (Steele, Lea and Flood, 2014)
    on the ID as a ``uint64``, computed with numpy's wrapping ``uint64`` arithmetic.
    It depends on nothing but the ID, so it is the same on every process, platform
    and run (unlike Python's ``hash``). Each ID falls in exactly one bucket.

Split mask (bit numbering)
    For ``N`` buckets (64, or any power of two) there are ``N - 1`` tree nodes,
    numbered bottom-up and left to right: bits ``0 .. N/2-1`` are the pairs of
    buckets ``{0,1}, {2,3}, ...``; the next ``N/4`` bits the pairs of pairs; the last
    bit (``N - 2``) the root. For 64 buckets: bits 0-31, 32-47, 48-55, 56-59, 60-61
    and 62. At each node the loads of its two halves are compared with the limit: if
    ``left + right > limit`` the bit is set (the halves go to different minibatches)
    and the node carries ``max(left, right)`` upwards; otherwise the halves merge and
    the node carries ``left + right``. SparseCore's worked example: loads
    ``{2,5,1,6,3,4,2,0}`` with limit 7 give ``0b1110000`` (bits 4, 5 and 6: the two
    nodes of the second level and the root).

    With loads per *partition* (a 2-D ``(P, N)`` array), the test is made for every
    partition and a node splits when any partition exceeds the limit; each partition
    carries its own value. That is what :mod:`.enforcer` uses: the limits hold per
    ``(sender, owner)`` partition, not for the sum over partitions.

Minibatches of a mask
    Bit ``j`` of level ``L`` (subtrees of ``s = 2**(L+1)`` buckets) is the boundary
    between buckets ``j*s + s/2 - 1`` and ``j*s + s/2``; every position between two
    adjacent buckets is exactly one node's boundary. The minibatches are the runs of
    buckets between set boundaries, so ``popcount(mask) + 1`` of them. A minibatch's
    load is at most the limit for every partition unless one bucket alone exceeds it
    (then no split can help; :mod:`.enforcer` raises or drops). OR-ing masks (across
    replicas) only adds boundaries, so it keeps every replica's minibatches within
    the limit.
"""

from __future__ import annotations

import numpy as np

NUM_BUCKETS = 64

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def splitmix64(ids) -> np.ndarray:
    """SplitMix64 finaliser of each ID, ``uint64`` (IDs are taken modulo ``2**64``).

    Args:
        ids: integer array of any shape.

    Returns:
        ``uint64`` array of ``ids.shape``.
    """
    z = np.asarray(ids).astype(np.int64, copy=False).view(np.uint64) + _GOLDEN
    z ^= z >> np.uint64(30)
    z *= _MIX1
    z ^= z >> np.uint64(27)
    z *= _MIX2
    z ^= z >> np.uint64(31)
    return z


def bucket_of(ids, num_buckets: int = NUM_BUCKETS) -> np.ndarray:
    """Bucket of each ID: ``splitmix64(id) & (num_buckets - 1)``, ``intp`` of ``ids.shape``."""
    return (splitmix64(ids) & np.uint64(num_buckets - 1)).astype(np.intp)


def _check_buckets(n: int) -> None:
    if n < 2 or n & (n - 1):
        raise ValueError(f"number of buckets: expected a power of two >= 2, got {n}")


def split_mask(loads, limit: int) -> int:
    """The bottom-up binary-tree split of ``N`` buckets (see the module docstring).

    Args:
        loads: ``(N,)`` loads per bucket, or ``(P, N)`` loads per partition and bucket;
            ``N`` a power of two (64 in the library), non-negative integers.
        limit: the largest load a minibatch may have (per partition).

    Returns:
        the split mask, a Python ``int`` of ``N - 1`` bits (bit numbering in the module
        docstring). ``split_mask([2, 5, 1, 6, 3, 4, 2, 0], 7) == 0b1110000``.

    Raises:
        ValueError: ``N`` is not a power of two.
    """
    v = np.array(loads, dtype=np.int64, ndmin=2)
    v = v.reshape(-1, v.shape[-1])
    n = v.shape[1]
    _check_buckets(n)
    mask, first = 0, 0
    size = 2
    while size <= n:  # log2(N) levels
        left, right = v[:, 0::size], v[:, size // 2::size]
        total = left + right
        split = (total > limit).any(axis=0)
        v[:, 0::size] = np.where(split, np.maximum(left, right), total)
        for j in np.flatnonzero(split):  # at most N/2 nodes per level
            mask |= 1 << (first + int(j))
        first += n // size
        size *= 2
    return mask


def boundaries(num_buckets: int = NUM_BUCKETS) -> np.ndarray:
    """``intp[N - 1]``: the bucket position (1..N-1) each mask bit separates from its left
    neighbour (bit ``b`` splits buckets ``boundaries()[b] - 1`` and ``boundaries()[b]``)."""
    _check_buckets(num_buckets)
    out, size = [], 2
    while size <= num_buckets:
        out.extend(range(size // 2, num_buckets, size))
        size *= 2
    return np.array(out, dtype=np.intp)


def minibatch_of_bucket(mask: int, num_buckets: int = NUM_BUCKETS) -> np.ndarray:
    """``intp[N]``: the minibatch (0-based, in bucket order) of each bucket under ``mask``;
    ``minibatch_of_bucket(mask).max() + 1 == popcount(mask) + 1`` minibatches."""
    cut = np.zeros(num_buckets, dtype=np.intp)
    bits = np.array([(int(mask) >> b) & 1 for b in range(num_buckets - 1)], dtype=np.intp)
    cut[boundaries(num_buckets)] = bits
    return np.cumsum(cut)


def minibatch_ranges(mask: int, num_buckets: int = NUM_BUCKETS) -> list[tuple[int, int]]:
    """The minibatches of ``mask`` as half-open bucket ranges ``[(lo, hi), ...]`` in order.
    ``minibatch_ranges(0b1110000, 8) == [(0, 2), (2, 4), (4, 6), (6, 8)]``."""
    of = minibatch_of_bucket(mask, num_buckets)
    starts = np.flatnonzero(np.diff(of, prepend=-1))
    ends = np.append(starts[1:], num_buckets)
    return [(int(a), int(b)) for a, b in zip(starts, ends)]
