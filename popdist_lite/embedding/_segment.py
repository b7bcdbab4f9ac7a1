"""Segment sums and grouping: coalesce rows that share an index (sort, then sum each
run of equal ids as a sparse matrix product, scipy's CSR times dense; never ``np.add.at``)."""

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


def sum_groups(values: np.ndarray, perm: np.ndarray, starts: np.ndarray, dtype=None) -> np.ndarray:
    """Sum the rows of ``values`` by group (:func:`group`'s ``perm`` and ``starts``).

    The groups are the rows of a ``(u, n)`` CSR matrix of ones whose columns are
    ``perm`` (indices) split at ``starts`` (row pointers), so the sums are one
    ``scipy.sparse`` matrix product with ``values``: compiled code that adds each
    group's rows in ``perm`` order, as a loop over them would (the same sums, bit for
    bit, as numpy's sequential ``sum`` over a group's rows). On the recommender workload
    (8,192 Zipf(1.1) gradient rows of 64 float32 into about 4,500 groups) it takes
    0.14 ms where padded power-of-two block sums took 0.55 ms, ``np.add.at`` 4.6 ms and
    ``np.add.reduceat`` on rows several ms (docs/performance.md). scipy is imported on
    the first call, so a process that never sums groups never loads it.

    Args:
        values: ``(n, *row)`` array of a float or complex dtype.
        perm, starts: from :func:`group` (or :func:`runs_of`) on the ``n`` ids.
        dtype: accumulation and result dtype (default ``values.dtype``); a float16 one
            accumulates in float32 and rounds the sums (scipy has no float16 products;
            every caller passes float32 for float16 values).

    Returns:
        ``(u, *row)`` array of ``dtype``: row ``j`` sums the rows of group ``j``.
    """
    dtype = np.dtype(dtype or values.dtype)
    n, u = perm.size, starts.size
    row = values.shape[1:]
    if u == n:  # no duplicates: a permutation
        return np.take(values, perm, axis=0).astype(dtype, copy=False)
    from scipy.sparse import csr_array  # 0.17 s to import: only where groups are summed

    acc = np.dtype(np.float32) if dtype == np.float16 else dtype
    dense = values.reshape(n, -1).astype(acc, copy=False)
    groups = csr_array((np.ones(n, acc), perm, np.append(starts, n)), shape=(u, n))
    return (groups @ dense).astype(dtype, copy=False).reshape(u, *row)


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
