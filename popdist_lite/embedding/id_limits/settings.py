"""A table's ID limits (SparseCore's ``max_ids_per_partition`` and
``max_unique_ids_per_partition``, with what to do beyond them) and the error raised
when a call exceeds them. What a partition is and which IDs are dropped:
:mod:`.partitions`; how a call is kept within the limits: :mod:`.enforcer`.
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
        allow_id_dropping: drop the IDs beyond a limit (the rule is in :mod:`.partitions`)
            instead of raising :class:`IdLimitError`.
        enable_minibatching: split a call whose partitions exceed a limit into
            minibatches (:mod:`.minibatch_split`, :mod:`.enforcer`) instead.
        track_id_stats: observe the per-partition counts (:mod:`.stats`)
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
