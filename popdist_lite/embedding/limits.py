"""Per-table ID limits (SparseCore's ``max_ids_per_partition`` and
``max_unique_ids_per_partition``): the settings, the per-partition counts, the error
and the deterministic choice of dropped IDs. Pure numpy, no MPI (the collective part is
:mod:`.limiter`).

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

from dataclasses import dataclass

import numpy as np


class IdLimitError(ValueError):
    """A partition holds more IDs (or unique IDs) than the table's limit and neither
    minibatching nor ID dropping may handle it. Raised on every replica."""


@dataclass(frozen=True)
class IdLimits:
    """A table's ID limits (SparseCore ``TableSpec`` names).

    Attributes:
        max_ids_per_partition: most IDs (with duplicates) one replica may send to one
            owner in one call, or ``None`` (no limit).
        max_unique_ids_per_partition: most distinct IDs per partition, or ``None``.
        allow_id_dropping: drop the IDs beyond a limit (see the module docstring)
            instead of raising :class:`IdLimitError`.
        enable_minibatching: split a call whose partitions exceed a limit into
            minibatches (:mod:`.minibatching`, :mod:`.limiter`) instead.
        track_id_stats: observe the per-partition counts (:mod:`popdist_lite.id_stats`)
            even when no limit is set.
    """

    max_ids_per_partition: int | None = None
    max_unique_ids_per_partition: int | None = None
    allow_id_dropping: bool = False
    enable_minibatching: bool = False
    track_id_stats: bool = False

    def __post_init__(self):
        for name in ("max_ids_per_partition", "max_unique_ids_per_partition"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))
                                      or value < 1):
                raise ValueError(f"argument {name}: expected a positive int or None, got {value!r}")

    @property
    def active(self) -> bool:
        """Whether calls must count their partitions (a limit is set or stats are tracked)."""
        return self.limited or self.track_id_stats

    @property
    def limited(self) -> bool:
        return self.max_ids_per_partition is not None or self.max_unique_ids_per_partition is not None

    @property
    def capacity(self) -> int | None:
        """Most unique IDs one partition may carry (sizes the exchange buffers)."""
        caps = [c for c in (self.max_ids_per_partition, self.max_unique_ids_per_partition) if c is not None]
        return min(caps) if caps else None

    def signature(self) -> tuple:
        return (self.max_ids_per_partition or 0, self.max_unique_ids_per_partition or 0,
                bool(self.allow_id_dropping), bool(self.enable_minibatching), bool(self.track_id_stats))


def partition_counts(flat: np.ndarray, r: int, seen: np.ndarray | None = None
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This replica's IDs and unique IDs per owner.

    Args:
        flat: ``int64[n]`` valid indices.
        r: number of replicas.
        seen: optional all-False ``bool[t]`` scratch (left all-False): deduplicate with
            a bitmap, ``O(t + n)``, instead of ``np.unique``; worth it when ``t`` is at
            most a few dozen times ``n``.

    Returns:
        ``(ids int64[r], unique int64[r], unique_values int64[u])`` (unique values sorted).
    """
    if seen is None:
        unique = np.unique(flat)
    else:
        seen[flat] = True
        unique = np.flatnonzero(seen)
        seen[unique] = False
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
