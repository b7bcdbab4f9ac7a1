"""Segment sum: coalesce values that share an index (sort + ``np.add.reduceat``)."""

from __future__ import annotations

import numpy as np


def segment_sum(ids: np.ndarray, values: np.ndarray, dtype=None) -> tuple[np.ndarray, np.ndarray]:
    """Sum the rows of ``values`` that share an id.

    Args:
        ids: ``int[n]``.
        values: ``(n, *row)``.
        dtype: accumulation dtype (default ``values.dtype``).

    Returns:
        ``(unique_ids, sums)``: sorted unique ids ``int[u]`` and ``(u, *row)`` sums.
    """
    values = values.astype(dtype or values.dtype, copy=False)
    if ids.size == 0:
        return ids[:0], values[:0]
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    starts = np.flatnonzero(np.concatenate(([True], sorted_ids[1:] != sorted_ids[:-1])))
    return sorted_ids[starts], np.add.reduceat(values[order], starts, axis=0)
