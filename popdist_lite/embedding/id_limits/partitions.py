"""Per-partition ID counts, the message of an exceeded limit and the deterministic
choice of dropped IDs. Pure numpy, no MPI (the collective part is :mod:`.enforcer`).

A *partition* is the set of IDs one replica (the sender) sends to one owner replica in
one lookup or update: for a TOKEN table, the sender's IDs ``i`` with ``i % r == owner``
(the owner itself included, as SparseCore counts a device's own partition too).
``ids`` counts them with duplicates, ``unique ids`` after deduplication (what the
sparse exchange actually transfers).

Dropping (``allow_id_dropping=True``, minibatching off): in each partition, in the
order of this replica's flattened indices,

1. the first ``max_unique_ids_per_partition`` distinct IDs (ordered by their first
   occurrence) are kept, every occurrence of a later distinct ID is dropped;
2. of the occurrences left, the first ``max_ids_per_partition`` are kept.

So the same indices always drop the same positions, on every run and replica count
with the same owner; a lookup and the update of the same indices agree. Dropped
positions read rows of zeros and their gradients are ignored.
"""

from __future__ import annotations

import numpy as np

from ..bitmap import Bitmap
from .settings import IdLimits


def partition_counts(flat: np.ndarray, r: int, bitmap: Bitmap | None = None
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This replica's IDs and unique IDs per owner.

    Args:
        flat: ``int64[n]`` valid indices.
        r: number of replicas.
        bitmap: optional :class:`~popdist_lite.embedding.bitmap.Bitmap` over the table's
            rows: deduplicate with it, ``O(t + n)``, instead of ``np.unique``; worth it
            when ``t`` is at most a few dozen times ``n``.

    Returns:
        ``(ids int64[r], unique int64[r], unique_values int64[u])`` (unique values sorted).
    """
    unique = np.unique(flat) if bitmap is None else bitmap.unique(flat)
    return (np.bincount(flat % r, minlength=r).astype(np.int64),
            np.bincount(unique % r, minlength=r).astype(np.int64), unique)


ADVICE = ("Set enable_minibatching=True or allow_id_dropping=True, or raise the limit; nothing was "
          "looked up or updated")


def exceeded_message(table: str, ids: np.ndarray, unique: np.ndarray, limits: IdLimits,
                     where: str = "", advice: str = ADVICE) -> str:
    """SparseCore-style message for the worst partition of each exceeded limit.

    Args:
        ids, unique: ``(senders, owners)`` counts of every partition.
        where: text after "per partition" (e.g. " in one hash bucket").
        advice: the sentence that ends the message.
    """
    parts = []
    for what, counts, limit in (("ids", ids, limits.max_ids_per_partition),
                                ("unique ids", unique, limits.max_unique_ids_per_partition)):
        if limit is None or counts.max(initial=0) <= limit:
            continue
        s, o = np.unravel_index(int(np.argmax(counts)), counts.shape)
        parts.append(f"Observed max {what} per partition{where}: {int(counts[s, o])} for table: {table} is "
                     f"greater than the set max {what} per partition: {limit} (partition: sender replica {s} "
                     f"-> owner replica {o})")
    return "; ".join(parts) + ". " + advice


def keep_mask(flat: np.ndarray, r: int, limits: IdLimits) -> np.ndarray:
    """Which positions of ``flat`` survive the limits (the rule in the module docstring).

    Args:
        flat: ``int64[n]`` valid indices of this replica.
        r: number of replicas.

    Returns:
        ``bool[n]``, True for the kept positions.
    """
    n = flat.size
    keep = np.ones(n, dtype=bool)
    if n == 0:
        return keep
    owner = flat % r
    max_unique, max_ids = limits.max_unique_ids_per_partition, limits.max_ids_per_partition
    if max_unique is not None:
        values, first, inverse = np.unique(flat, return_index=True, return_inverse=True)
        value_owner = values % r
        order = np.lexsort((first, value_owner))  # by owner, then first occurrence
        rank = np.empty(values.size, dtype=np.intp)
        rank[order] = np.arange(values.size) - np.searchsorted(value_owner[order], value_owner[order])
        keep = (rank < max_unique)[inverse.reshape(-1)]
    if max_ids is not None:
        kept = np.flatnonzero(keep)
        kept_owner = owner[kept]
        order = np.argsort(kept_owner, kind="stable")  # by owner, then position
        sorted_owner = kept_owner[order]
        rank = np.arange(kept.size) - np.searchsorted(sorted_owner, sorted_owner)
        keep[kept[order[rank >= max_ids]]] = False
    return keep
