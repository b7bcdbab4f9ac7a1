"""Tables of one kind stacked into one array per replica (FBGEMM's table-batched
embeddings): :class:`Stack` and :func:`build_stacks`.

A collection's tables are grouped by what their exchange and update share: the kind
of placement (``routed``: row-wise and table-wise; ``column``: column-wise;
``replicated``: data-parallel), the row width, the dtypes, the optimizer spec, the
rounding mode and the storage. Each group is one :class:`~popdist_lite.embedding.shard.Shard`
per replica, so a lookup gathers each group's rows with one ``take`` and an update
runs each group's optimizer once, whatever the number of tables in it. The seed is not
shared: each table keeps its own stochastic-rounding streams (seeded by its own seed)
inside the stack (:class:`~popdist_lite.embedding.shard.RowRounding`), so a float16
table rounds its updated rows as it would alone, whatever else its stack holds.

Rows of a replica's shard, table after table (``r`` replicas, table ``i`` of ``t_i``
rows):

- ``routed``: first the row-wise tables, ``ceil(t_i/r)`` rows each (the same offsets
  on every replica), then the table-wise tables this replica holds, ``t_i`` rows each.
  An ID of a row-wise table becomes the stack ID ``r * offset_i + id`` (so ``g % r`` is
  its replica and ``g // r`` its local row, as for one TOKEN table of the stacked
  rows); an ID of a table-wise table ``first_i + id``, past the row-wise IDs.
- ``column``: every table's ``t_i`` rows of ``ceil(e/r)`` columns; stack ID
  ``offset_i + id``.
- ``replicated``: every table's ``t_i`` rows; stack ID ``offset_i + id``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..collectives.all_reduce import all_reduce
from ..stochastic_rounding import StochasticRounding
from .configs import EmbeddingConfig
from .placement import ParameterSharding, ShardingType, TableLayout
from .shard import RowRounding, Shard
from .sparse import COLUMN, REPLICATED, ROUTED, ExchangeStack, StackRouter

KINDS = {ShardingType.ROW_WISE: ROUTED, ShardingType.TABLE_WISE: ROUTED, ShardingType.COLUMN_WISE: COLUMN,
         ShardingType.DATA_PARALLEL: REPLICATED}


@dataclass
class Slot:
    """Where one table lives in its stack.

    Attributes:
        index: the table's position in the collection.
        config: its config.
        layout: its :class:`~popdist_lite.embedding.placement.TableLayout` on this replica.
        offset: its first row in the stack's shard on this replica.
        gid_offset: what an ID of the table is shifted by to make its stack ID (for a
            row-wise table, multiplied first: ``r * offset``).
        rounding: the table's own :class:`~popdist_lite.StochasticRounding` (its
            streams; set by :func:`build_stacks`).
    """

    index: int
    config: EmbeddingConfig
    layout: TableLayout
    offset: int
    gid_offset: int
    rounding: StochasticRounding | None = None

    @property
    def rows(self) -> slice:
        """The table's rows of the stack's shard on this replica."""
        return slice(self.offset, self.offset + self.layout.local_shape[0])


class Stack:
    """The tables of one kind stacked on this replica.

    Attributes:
        index: the stack's position (message-key order).
        kind: ``ROUTED``, ``COLUMN`` or ``REPLICATED``.
        slots: its tables' :class:`Slot` s.
        shard: this replica's :class:`Shard` of the stack.
        exchange_stack: what the exchange knows of it.
        rows_on: the stack's local rows on every replica.
        trainable, dtype, e: as its tables'.
    """

    def __init__(self, index: int, kind: str, slots: list, shard: Shard, exchange_stack: ExchangeStack,
                 rows_on: list):
        self.index, self.kind, self.slots, self.shard = index, kind, slots, shard
        self.exchange_stack, self.rows_on = exchange_stack, rows_on
        config = slots[0].config
        self.trainable, self.dtype, self.e = config.trainable, config.data_type, config.embedding_dim

    @property
    def name(self) -> str:
        return self.shard.name


def stack_key(config: EmbeddingConfig, kind: str) -> tuple:
    """What the tables of one stack share (see the module docstring)."""
    spec = config.spec
    optimizer = spec.optimizer_spec.signature() if spec.trainable else None
    return (kind, config.embedding_dim, str(spec.dtype), str(spec.master_dtype), optimizer,
            spec.stochastic_rounding.mode.name, config.storage)


def build_stacks(configs: list, plan: dict, comm, name: str) -> list[Stack]:
    """Group ``configs`` into stacks under ``plan`` (table name -> completed
    :class:`ParameterSharding`) and make each replica's shards (zeros: the caller
    writes the initial rows). Collective when a disk shard is made.

    Returns:
        the stacks, replicated and column-wise ones first (their message keys start at
        the same place on every replica), then the routed ones.
    """
    r, k = comm.size, comm.rank
    groups: dict[tuple, list] = {}
    for i, config in enumerate(configs):
        sharding: ParameterSharding = plan[config.name]
        kind = KINDS[sharding.sharding_type]
        groups.setdefault(stack_key(config, kind), []).append((i, config, sharding))
    order = sorted(groups.values(), key=lambda g: (KINDS[g[0][2].sharding_type] == ROUTED, g[0][0]))
    layouts = []
    for members in order:
        kind = KINDS[members[0][2].sharding_type]
        layouts.append((kind, members, _offsets(kind, members, r, k)))
    # message keys: each replica's stacks one after another (routed stacks hold other rows on each replica)
    rows_on = [rows for _, _, (_, rows, _, _) in layouts]
    keys_on = np.zeros((len(layouts) + 1, r), np.int64)
    keys_on[1:] = np.cumsum(np.array(rows_on, np.int64).reshape(len(layouts), r), axis=0)
    id_dtype = np.dtype(np.int32 if keys_on[-1].max(initial=0) < 2 ** 31 else np.int64)
    stacks = []
    for g, (kind, members, (slots, rows, space, routing)) in enumerate(layouts):
        config = members[0][1]
        spec = config.spec
        e = config.embedding_dim
        width = slots[0].layout.width
        for slot in slots:  # each table's own streams, of its own seed
            given, own = slot.config.stochastic_rounding, slot.config.spec
            slot.rounding = given if isinstance(given, StochasticRounding) else \
                StochasticRounding(own.stochastic_rounding.mode, seed=own.seed, replica=k)
        rounding = RowRounding([(s.offset, s.layout.local_shape[0], s.rounding) for s in slots])
        names = [m[1].name for m in members]
        shard_name = names[0] if len(names) == 1 else f"{name}.{'+'.join(names)}"[:80]
        row_sum = (lambda x: all_reduce(np.ascontiguousarray(x.sum(axis=1)), comm=comm)) if kind == COLUMN else None
        shard = Shard(shard_name, (rows[k], width), spec.dtype, spec.master_dtype, spec.optimizer_spec, rounding,
                      comm, config.storage, replicated=kind == REPLICATED, row_sum=row_sum, full_width=e)
        router = StackRouter(kind, space, r, k, row_wise_rows=routing[0], single=routing[1], rows_on=rows,
                             shard_bytes=rows[k] * width * 4, id_dtype=id_dtype)
        acc = np.dtype(np.float32) if spec.dtype == np.float16 else spec.dtype
        exchange_stack = ExchangeStack(kind, router, width, e, spec.dtype, acc, keys_on[g].copy(), config.trainable)
        stacks.append(Stack(g, kind, slots, shard, exchange_stack, rows))
    return stacks


def _offsets(kind: str, members: list, r: int, k: int):
    """``(slots, rows on every replica, stack ID space, (row-wise rows, table-wise
    tables))`` of one stack's tables."""
    slots = []
    if kind != ROUTED:
        offset = 0
        for i, config, sharding in members:
            layout = TableLayout(sharding, config.shape, r, k)
            slots.append(Slot(i, config, layout, offset, offset))
            offset += config.num_embeddings
        return slots, [offset] * r, offset, (0, ())
    row_wise = [m for m in members if m[2].sharding_type is ShardingType.ROW_WISE]
    table_wise = [m for m in members if m[2].sharding_type is ShardingType.TABLE_WISE]
    rw_rows = 0
    for i, config, sharding in row_wise:
        layout = TableLayout(sharding, config.shape, r, k)
        slots.append(Slot(i, config, layout, rw_rows, r * rw_rows))
        rw_rows += layout.local_shape[0]
    rows = [rw_rows] * r
    first, single = r * rw_rows, []
    for i, config, sharding in table_wise:
        layout = TableLayout(sharding, config.shape, r, k)
        owner = sharding.owner
        slots.append(Slot(i, config, layout, rows[k], first))  # no rows here unless owner == k
        single.append((first, config.num_embeddings, owner, rows[owner]))
        rows[owner] += config.num_embeddings
        first += config.num_embeddings
    slots.sort(key=lambda s: s.index)
    return slots, rows, first, (rw_rows, tuple(single))
