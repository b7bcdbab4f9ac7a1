"""Segment sums and grouping: coalesce rows that share an index (sort, then sum each
run of equal ids with padded block sums; never ``np.add.at``)."""

from __future__ import annotations

import numpy as np


def group(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sort ``ids`` and find the runs of equal ids.

    Args:
        ids: ``int[n]``.

    Returns:
        ``(unique_ids, perm, starts)``: sorted unique ids ``int[u]``; ``perm``, the
        sorting permutation (``ids[perm]`` is sorted); ``starts``, ``int[u]``, the
        position in ``ids[perm]`` where each unique id's run begins.
    """
    perm = np.argsort(ids, kind="stable")  # radix/tim sort: faster than quicksort here
    ordered = ids[perm]
    if ids.size == 0:
        return ordered, perm, perm
    first = np.empty(ids.size, dtype=bool)
    first[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    return ordered[starts], perm, starts


def runs_of(inverse: np.ndarray, u: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`group`'s ``(perm, starts)`` for ids already numbered ``0..u-1`` (an inverse
    map: ``inverse[i]`` is the group of position ``i``, every group non-empty), without
    comparing ids: a stable sort of the group numbers (numpy's radix sort while they fit
    16 bits, so ``O(n)``) and the groups' start positions from their sizes."""
    perm = np.argsort(inverse.astype(np.int16, copy=False) if u <= 2 ** 15 else inverse, kind="stable")
    sizes = np.bincount(inverse, minlength=u)
    return perm, np.cumsum(sizes) - sizes


def inverse_of(perm: np.ndarray, starts: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """For :func:`group`'s result: ``inverse[i]`` = position of ``ids[i]`` in ``unique_ids``."""
    n = perm.size
    run = np.zeros(n, dtype=np.intp)
    run[starts[1:]] = 1
    inverse = np.empty(n, dtype=np.intp) if out is None else out
    inverse[perm] = np.cumsum(run)
    return inverse


def sum_groups(values: np.ndarray, perm: np.ndarray, starts: np.ndarray, dtype=None,
               buffers=None) -> np.ndarray:
    """Sum the rows of ``values`` by group (:func:`group`'s ``perm`` and ``starts``).

    Groups are bucketed by length, rounded up to a power of two ``w``; each bucket is
    one gather into a ``(groups, w, *row)`` block whose padding rows are zeroed, and one
    ``sum(axis=1)``. Single-row groups are a plain gather. That is a Python loop over at
    most ``log2(n) + 1`` length classes, never over indices, and several times faster
    than ``np.add.reduceat`` on rows (strided inner loop) or ``np.add.at``.

    Args:
        values: ``(n, *row)`` array.
        perm, starts: from :func:`group` on the ``n`` ids.
        dtype: accumulation and result dtype (default ``values.dtype``).
        buffers: optional :class:`~._buffers.Buffers` for the scratch blocks (large
            temporaries reused between steps instead of fresh pages every call).

    Returns:
        ``(u, *row)`` array of ``dtype``: row ``j`` sums the rows of group ``j``.
    """
    dtype = np.dtype(dtype or values.dtype)
    n, u = perm.size, starts.size
    row = values.shape[1:]
    if u == n:  # no duplicates: a permutation
        return np.take(values, perm, axis=0).astype(dtype, copy=False)
    lengths = np.diff(starts, append=n)
    classes = np.zeros(u, dtype=np.intp)
    multi = lengths > 1
    classes[multi] = np.ceil(np.log2(lengths[multi])).astype(np.intp)
    order = np.argsort(classes, kind="stable")
    bounds = np.searchsorted(classes[order], np.arange(int(classes.max()) + 2))
    out = np.empty((u, *row), dtype=dtype)
    for c in range(len(bounds) - 1):  # length classes 1, 2, 4, 8, ...: at most log2(n) + 1
        groups = order[bounds[c]:bounds[c + 1]]
        if groups.size == 0:
            continue
        if c == 0:
            out[groups] = np.take(values, perm[starts[groups]], axis=0)
            continue
        offsets = np.arange(1 << c)
        pad = offsets >= lengths[groups, None]
        pos = starts[groups, None] + offsets
        pos[pad] = starts[groups, None].repeat(offsets.size, axis=1)[pad]  # any valid row, zeroed below
        shape = (groups.size, offsets.size, *row)
        block = np.empty(shape, values.dtype) if buffers is None else buffers.get("sum_block", shape, values.dtype)
        np.take(values, perm[pos.reshape(-1)], axis=0, out=block.reshape(-1, *row), mode="clip")
        block[pad] = 0
        out[groups] = block.sum(axis=1, dtype=dtype)
    return out


def segment_sum(ids: np.ndarray, values: np.ndarray, dtype=None) -> tuple[np.ndarray, np.ndarray]:
    """Sum the rows of ``values`` that share an id.

    Args:
        ids: ``int[n]``.
        values: ``(n, *row)``.
        dtype: accumulation dtype (default ``values.dtype``).

    Returns:
        ``(unique_ids, sums)``: sorted unique ids ``int[u]`` and ``(u, *row)`` sums.
    """
    unique, perm, starts = group(ids)
    return unique, sum_groups(values, perm, starts, dtype)
