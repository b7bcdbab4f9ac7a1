"""A host embedding table's state on one replica: :class:`TableState`.

What a checkpoint of a table needs, in one place: this replica's partition of the
master weights, its optimizer state, the layout of each array (so a reader can tell
which arrays are partitioned like the table, one value per row, or the same on every
replica) and the states of the stochastic-rounding random streams. Returned by
:meth:`HostEmbedding.state() <popdist_lite.HostEmbedding.state>` and written back by
:meth:`HostEmbedding.load_state() <popdist_lite.HostEmbedding.load_state>`;
:meth:`TableState.state_dict` is the table's checkpoint form (the ``Stateful`` protocol
of :mod:`popdist_lite.checkpoint.stateful`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..checkpoint.partition import Partition
from ..checkpoint.stateful import Partitioned, PerReplica

#: The layouts an array of a :class:`TableState` may have.
LAYOUTS = ("table", "row", "replicated")


@dataclass
class TableState:
    """One replica's state of a ``(t, e)`` host embedding table.

    Attributes:
        name: the table's name.
        shape: ``(t, e)``.
        dtype: the lookup dtype.
        master_dtype: the storage dtype of the weights.
        partition_strategy: ``"TOKEN"`` or ``"ENCODING"``.
        num_replicas: ``r``, the replicas the table is partitioned over.
        replica: this replica's index ``k``.
        arrays: live references (no copies) to this replica's arrays: ``"weights"``,
            the master partition (``local_shard``), and ``"optimizer/<slot>"`` for every
            slot of the optimizer state.
        layouts: each array's layout, one of

            - ``"table"``: partitioned like the table. TOKEN ``(ceil(t/r), e)``, local
              row ``j`` is table row ``j*r + k`` (rows ``i`` with ``i % r == k``);
              ENCODING ``(t, ceil(e/r))``, columns ``[k*c, (k+1)*c)``, ``c = ceil(e/r)``.
              Padding rows/columns past ``t``/``e`` are part of the array.
            - ``"row"``: one value per table row. TOKEN ``(ceil(t/r),)``, partitioned
              like the table's rows; ENCODING ``(t,)``, every replica holds all rows
              (the same values).
            - ``"replicated"``: identical on every replica, any shape.
        generators: ``Generator.bit_generator.state`` (JSON-able dicts) of the
            stochastic-rounding streams: ``"per_replica"`` (differs per replica) and
            ``"replica_identical"`` (the same on every replica).
        partitions: how ``"table"`` and ``"row"`` arrays are split when the table's
            placement is not a strategy's (a collection's table-wise or data-parallel
            table: :meth:`~popdist_lite.embedding.placement.TableLayout.table_partition`),
            else empty.
    """

    name: str
    shape: tuple[int, int]
    dtype: np.dtype
    master_dtype: np.dtype
    partition_strategy: str
    num_replicas: int
    replica: int
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    layouts: dict[str, str] = field(default_factory=dict)
    generators: dict[str, dict] = field(default_factory=dict)
    partitions: dict[str, Partition] = field(default_factory=dict)

    def partition(self, key: str) -> tuple[Partition, tuple]:
        """How array ``key`` is split over the replicas and its whole shape: ``table``
        arrays TOKEN ``cyclic`` on rows / ENCODING ``block`` on columns of ``(t, e)``;
        ``row`` arrays TOKEN ``cyclic`` of ``(t,)`` / ENCODING replicated;
        ``replicated`` arrays as they are."""
        layout, local = self.layouts[key], self.arrays[key]
        if layout in self.partitions:
            return self.partitions[layout], tuple(self.shape) if layout == "table" else (self.shape[0],)
        token = self.partition_strategy == "TOKEN"
        if layout == "table":
            return (Partition("cyclic", 0) if token else Partition("block", 1)), tuple(self.shape)
        if layout == "row":
            return (Partition("cyclic", 0), (self.shape[0],)) if token else (Partition("replicated"), local.shape)
        if layout == "replicated":
            return Partition("replicated"), local.shape
        raise ValueError(f"unknown table array layout {layout!r}")

    def state_dict(self) -> dict:
        """The checkpoint form: ``{"weights": ..., "optimizer": {slot: ...}, "generators":
        {"per_replica": PerReplica(...), "replica_identical": ...}}``, arrays as
        :class:`~popdist_lite.checkpoint.stateful.Partitioned` live references."""
        tree: dict = {"optimizer": {}}
        for key in self.arrays:
            partition, shape = self.partition(key)
            array = Partitioned(self.arrays[key], shape, partition,
                                {"strategy": self.partition_strategy, "layout": self.layouts[key]})
            if key.startswith("optimizer/"):
                tree["optimizer"][key[len("optimizer/"):]] = array
            else:
                tree[key] = array
        if not tree["optimizer"]:
            del tree["optimizer"]
        tree["generators"] = {kind: PerReplica(state) if kind == "per_replica" else state
                              for kind, state in self.generators.items()}
        return tree


def check_arrays(table: str, current: dict[str, np.ndarray], given: dict[str, np.ndarray]) -> None:
    """Raise ``ValueError`` unless every array of ``given`` names an array of ``current``
    and has its shape and dtype (checked before anything is written).

    Raises:
        ValueError: naming the table, the slot, what was expected and what came.
    """
    for key, value in given.items():
        if key not in current:
            raise ValueError(f"host embedding {table!r}: load_state: unknown array {key!r}, expected one of "
                             f"{sorted(current)}")
        want = current[key]
        if not isinstance(value, np.ndarray) or value.shape != want.shape or value.dtype != want.dtype:
            got = f"{value.dtype}{list(value.shape)}" if isinstance(value, np.ndarray) else type(value).__name__
            raise ValueError(f"host embedding {table!r}: load_state: array {key!r}: expected "
                             f"{want.dtype}{list(want.shape)}, got {got}")


def layout_of(array: np.ndarray, shard_shape: tuple[int, int]) -> str:
    """The layout of an optimizer slot its spec does not declare, from its shape."""
    return "table" if array.shape == shard_shape else "row" if array.shape == shard_shape[:1] else "replicated"
