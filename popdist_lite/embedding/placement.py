"""Where a table's rows live: its placement over the replicas (TorchRec's sharding types).

=================  ==============================  ==========================================
sharding type      replica ``k`` of ``r`` holds    an ID's row comes from
=================  ==============================  ==========================================
``row_wise``       rows ``i`` with ``i % r == k``  replica ``i % r``, local row ``i // r``
                   (``ceil(t/r)`` rows: TOKEN)     (the TF-IPU guide's TOKEN strategy)
``column_wise``    columns ``[k*c, (k+1)*c)`` of   every replica (its ``c`` columns),
                   every row, ``c = ceil(e/r)``    ``c = ceil(e/r)`` (ENCODING)
``table_wise``     the whole table if ``k`` is     replica ``ranks[0]``
                   its rank, else nothing
``data_parallel``  the whole table                 this replica (no exchange); updates
                                                   reach every replica (an all-reduce)
=================  ==============================  ==========================================

TorchRec's row-wise sharding cuts contiguous blocks; popdist-lite's is cyclic (the
TOKEN strategy of the TF-IPU host-embedding guide, SparseCore's mod sharding), which
spreads hot low IDs of a Zipf-distributed feature over every replica. Aliases:
``"TOKEN"`` (row-wise), ``"ENCODING"`` (column-wise), ``"replicated"`` (data-parallel).
In a checkpoint the placements are the partitions of :mod:`popdist_lite.checkpoint.partition`
(cyclic on rows, block on columns, one replica's, replicated), so a table saved under
one placement and replica count loads under any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from ..checkpoint.partition import Partition


class ShardingType(str, Enum):
    """TorchRec's sharding type names (``torchrec.distributed.types.ShardingType``)."""

    ROW_WISE = "row_wise"
    COLUMN_WISE = "column_wise"
    TABLE_WISE = "table_wise"
    DATA_PARALLEL = "data_parallel"


_ALIASES = {"TOKEN": ShardingType.ROW_WISE, "ENCODING": ShardingType.COLUMN_WISE,
            "REPLICATED": ShardingType.DATA_PARALLEL}


def sharding_type_of(value) -> ShardingType:
    """A :class:`ShardingType` from itself, its value (``"row_wise"``), its name
    (``"ROW_WISE"``), an alias (``"TOKEN"``, ``"ENCODING"``, ``"replicated"``) or an enum
    member with such a name (TorchRec's own ``ShardingType.ROW_WISE``).

    Raises:
        ValueError: anything else.
    """
    name = getattr(value, "value", value)
    if isinstance(name, str):
        if name.upper() in _ALIASES:
            return _ALIASES[name.upper()]
        try:
            return ShardingType(name.lower())
        except ValueError:
            pass
    raise ValueError(f"expected a sharding type (row_wise, column_wise, table_wise, data_parallel; or TOKEN, "
                     f"ENCODING, replicated), got {value!r}")


@dataclass(frozen=True)
class ParameterSharding:
    """One table's placement (TorchRec's ``ParameterSharding``, without compute kernels).

    Attributes:
        sharding_type: a :class:`ShardingType`.
        ranks: the replicas holding the table: ``(owner,)`` for ``table_wise``; every
            replica for the others (``None`` is read as every replica).
    """

    sharding_type: ShardingType
    ranks: tuple | None = None

    def __post_init__(self):
        object.__setattr__(self, "sharding_type", sharding_type_of(self.sharding_type))
        if self.ranks is not None:
            object.__setattr__(self, "ranks", tuple(int(k) for k in self.ranks))

    @property
    def owner(self) -> int:
        """The replica of a table-wise table."""
        return self.ranks[0]

    def check(self, num_replicas: int, what: str) -> "ParameterSharding":
        """This placement completed for ``num_replicas`` (ranks filled in).

        Raises:
            ValueError: a table-wise placement without exactly one rank in
                ``[0, num_replicas)``, or ranks that are not every replica for the others.
        """
        every = tuple(range(num_replicas))
        if self.sharding_type is ShardingType.TABLE_WISE:
            if self.ranks is None or len(self.ranks) != 1 or not 0 <= self.ranks[0] < num_replicas:
                raise ValueError(f"{what}: a table_wise placement needs ranks=[k] with k in [0, {num_replicas}), "
                                 f"got ranks={self.ranks}")
            return self
        if self.ranks is not None and self.ranks != every:
            raise ValueError(f"{what}: a {self.sharding_type.value} placement is on every replica (ranks "
                             f"{list(every)}), got ranks={list(self.ranks)}")
        return ParameterSharding(self.sharding_type, every)


class TableLayout:
    """One table's rows on replica ``k`` of ``r`` under a placement: the local array's
    shape, how the initial table is cut, the checkpoint partitions, the whole table back.

    Args:
        sharding: the table's :class:`ParameterSharding` (completed).
        shape: ``(t, e)``.
        num_replicas, replica: ``r`` and ``k``.
    """

    def __init__(self, sharding: ParameterSharding, shape: tuple, num_replicas: int, replica: int):
        self.sharding, self.kind = sharding, sharding.sharding_type
        self.t, self.e = shape
        self.r, self.k = num_replicas, replica
        kind = self.kind
        if kind is ShardingType.ROW_WISE:
            self.local_shape = (-(-self.t // self.r), self.e)
        elif kind is ShardingType.COLUMN_WISE:
            self.local_shape = (self.t, -(-self.e // self.r))
        elif kind is ShardingType.TABLE_WISE:
            self.local_shape = (self.t if sharding.owner == replica else 0, self.e)
        else:
            self.local_shape = (self.t, self.e)

    @property
    def width(self) -> int:
        """Columns of the local array (``ceil(e/r)`` column-wise, else ``e``)."""
        return self.local_shape[1]

    def rows_on(self, replica: int) -> int:
        """Local rows of replica ``replica``."""
        if self.kind is ShardingType.TABLE_WISE:
            return self.t if self.sharding.owner == replica else 0
        return self.local_shape[0]

    def shard_from_block(self, block: np.ndarray, first_row: int, local: np.ndarray) -> None:
        """Copy this replica's part of rows ``first_row...`` of the table (``block``) into
        ``local`` (its local array)."""
        kind, r, k = self.kind, self.r, self.k
        if kind is ShardingType.ROW_WISE:
            start = (k - first_row) % r
            mine = block[start::r]
            at = (first_row + start) // r
            local[at:at + len(mine)] = mine
        elif kind is ShardingType.COLUMN_WISE:
            c = self.width
            mine = block[:, k * c:(k + 1) * c]
            local[first_row:first_row + len(block), :mine.shape[1]] = mine
        elif kind is ShardingType.DATA_PARALLEL or self.sharding.owner == k:
            local[first_row:first_row + len(block)] = block

    def table_partition(self) -> Partition:
        """The checkpoint partition of the ``(t, e)`` weights (and table-shaped slots)."""
        kind = self.kind
        if kind is ShardingType.ROW_WISE:
            return Partition("cyclic", 0)
        if kind is ShardingType.COLUMN_WISE:
            return Partition("block", 1)
        if kind is ShardingType.TABLE_WISE:
            return Partition("single", 0, self.sharding.owner)
        return Partition("replicated")

    def row_partition(self) -> Partition:
        """The checkpoint partition of one-value-per-row ``(t,)`` slots."""
        kind = self.kind
        if kind is ShardingType.ROW_WISE:
            return Partition("cyclic", 0)
        if kind is ShardingType.TABLE_WISE:
            return Partition("single", 0, self.sharding.owner)
        return Partition("replicated")  # column-wise: every replica holds every row's value

    def assemble(self, pieces: list[np.ndarray]) -> np.ndarray:
        """The ``(t, e)`` table from every replica's local array (in replica order)."""
        kind = self.kind
        if kind is ShardingType.ROW_WISE:
            stacked = np.stack(pieces)
            return stacked.transpose(1, 0, 2).reshape(-1, self.e)[:self.t]
        if kind is ShardingType.COLUMN_WISE:
            return np.concatenate(pieces, axis=1)[:, :self.e]
        if kind is ShardingType.TABLE_WISE:
            return pieces[self.sharding.owner]
        return pieces[0]
