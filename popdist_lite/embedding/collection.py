"""Collections of host embedding tables at TorchRec's names: :class:`EmbeddingBagCollection`
(pooled features, a :class:`~.jagged.KeyedArray` out) and :class:`EmbeddingCollection`
(sequence features, a :class:`~.jagged.JaggedArray` per feature out), both on
:class:`TableCollection`, the numpy core the PyTorch and JAX bindings wrap.

A collection holds several tables, each placed by a plan (row-wise, column-wise,
table-wise or data-parallel: :mod:`.placement`, chosen by :mod:`.planner`), read by
features keyed by name. Its tables are stacked by kind (:mod:`.stacks`), and one call
moves the IDs, rows and gradients of every table in the same collectives
(:mod:`.sparse`): a lookup is one agreement, one all-to-all of IDs and one of rows, an
update in backward (:meth:`TableCollection.backward`, with the lookup's context) one
agreement and one all-to-all of gradients, whatever the number of tables. Outputs
come from each stack's unique rows with one sparse product (:mod:`.pooling`); the
update applies each table's optimizer spec (:mod:`.optimizer_specs`) on the replicas
holding each row, as :class:`popdist_lite.HostEmbedding` does: TorchRec's fused
optimizer in backward (FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen``, which
updates the weights in backward and returns no gradient), and the TF-IPU
host-embedding guide's host-side update.

Every call is a collective: every replica calls it in the same order, each with its
own batch (the sizes may differ). Bad input on any replica raises the same error on
every replica (naming the replica, the feature, the argument, what was expected and
what came) before anything moves or changes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from time import perf_counter

import numpy as np

from .. import counters, progress, topology
from ..collectives import Problem, agree_objects
from ..collectives.all_gather import gather_rows
from ._buffers import aligned_empty
from .configs import EmbeddingBagConfig, EmbeddingConfig
from .id_limits.batched import BatchLimits, LimitedTable
from .jagged import JaggedArray, KeyedArray, KeyedJaggedArray
from .placement import ParameterSharding, ShardingType, sharding_type_of
from .pooling import FeatureRows, OutputMap
from .shard import default_blocks, different_table, initial_table
from .sparse import SparseExchange
from .stacks import Stack, build_stacks
from .state import TableState

_ESCAPE = re.compile(r"[^A-Za-z0-9_.-]")


def checkpoint_key(name: str) -> str:
    """A table's name as one checkpoint name component (no ``/``: written ``-2F``)."""
    return _ESCAPE.sub(lambda m: "".join(f"-{b:02X}" for b in m.group().encode()), name) or "-"


@dataclass
class _Feature:
    """One feature of the collection: its name, table, and whether it is pooled."""

    name: str
    table: int
    pooled: bool
    combiner: str | None


@dataclass
class _Batch:
    """One call's input on this replica, checked: every feature's IDs concatenated in
    the collection's feature order (``ids``), where each feature's start
    (``starts``, ``len(features) + 1``), its bags (``lengths``, pooled features) and
    weights (``weights``, ``float64`` or ``None``)."""

    ids: np.ndarray
    starts: np.ndarray
    lengths: list
    weights: list


@dataclass
class _Call:
    """One call's IDs as the exchange takes them: the raw IDs, their stack IDs, the
    positions of each stack's IDs in stack order (``None``: all of them, one stack) and
    of each limited table's."""

    ids: np.ndarray
    gid: np.ndarray
    stack_pos: list
    table_pos: dict


@dataclass
class LookupContext:
    """What a :meth:`TableCollection.forward` keeps for its :meth:`TableCollection.backward`
    (opaque to callers): the exchange's contexts (one per minibatch), every stack's
    output map, the batch's shapes (to check the gradients)."""

    exchange: list
    maps: list
    batch_sizes: list
    counts: list
    keyed: bool
    offsets: list = field(default_factory=list)
    used: bool = False


class ShardedTable:
    """One table of a collection (``collection.tables[name]``): its config, placement and
    state, and lookups and updates of this table alone (through the collection's
    exchange). Checkpoints see it as a host embedding table (the manifest's type is
    ``HostEmbedding``), so a table saved from a collection loads into a
    :class:`popdist_lite.HostEmbedding` or another collection's table and back, at any
    replica count and placement.

    Attributes:
        name, shape (``(t, e)``), dtype (lookup dtype), master_dtype, config, sharding
        (its :class:`~.placement.ParameterSharding`), optimizer_spec, trainable,
        stochastic_rounding (the table's own streams, of its seed, also inside a stack).
    """

    def __init__(self, collection: "TableCollection", stack: Stack, slot):
        self._collection, self._stack, self._slot = collection, stack, slot
        config = slot.config
        self.config, self.name, self.shape = config, config.name, config.shape
        self.dtype, self.master_dtype = config.spec.dtype, config.spec.master_dtype
        self.sharding: ParameterSharding = slot.layout.sharding
        self.optimizer_spec, self.trainable = config.spec.optimizer_spec, config.trainable
        self.stochastic_rounding = slot.rounding

    @property
    def partition_strategy(self) -> str:
        """The placement's name (``"row_wise"``, ...)."""
        return self.sharding.sharding_type.value

    @property
    def local_shard(self) -> np.ndarray:
        """This replica's rows of the table (a view of its stack's master weights):
        row-wise ``(ceil(t/r), e)``, column-wise ``(t, ceil(e/r))``, table-wise ``(t, e)``
        on its replica (``(0, e)`` elsewhere), data-parallel ``(t, e)``."""
        return self._stack.shard.weights[self._slot.rows]

    @property
    def storage_stats(self) -> dict | None:
        """The counters of the disk shard holding this table (and the other tables of its
        stack), as :attr:`popdist_lite.HostEmbedding.storage_stats`; ``None`` in memory."""
        disk = self._stack.shard.disk
        if disk is None:
            return None
        return {**disk.stats, "cache_rows": disk.cache.capacity, "file_bytes": disk.file_bytes}

    def state(self) -> TableState:
        """This replica's state of the table: live views of its rows of the stack's
        weights and optimizer slots (a disk stack first writes its cache back), their
        layouts and the states of the table's stochastic-rounding streams. Local."""
        shard = self._stack.shard
        shard.sync()
        arrays, layouts = shard.arrays()
        rows = self._slot.rows
        mine = {key: (a[rows] if layouts[key] in ("table", "row") else a) for key, a in arrays.items()}
        strategy = {ShardingType.ROW_WISE: "TOKEN", ShardingType.COLUMN_WISE: "ENCODING"}.get(
            self.sharding.sharding_type, self.partition_strategy)
        layout = self._slot.layout
        return TableState(name=self.name, shape=self.shape, dtype=self.dtype, master_dtype=self.master_dtype,
                          partition_strategy=strategy, num_replicas=self._collection.comm.size,
                          replica=self._collection.comm.rank, arrays=mine, layouts=layouts,
                          generators=self.stochastic_rounding.generator_states(),
                          partitions={"table": layout.table_partition(), "row": layout.row_partition()})

    def get_embedding_tensor(self, master: bool = False) -> np.ndarray:
        """The whole ``(t, e)`` table on every replica. Collective (an all-gather of
        every replica's rows; a disk stack writes its cache back first).

        Args:
            master: the master weights (``master_dtype``) instead of the served values."""
        shard = self._stack.shard
        problem = None
        try:
            shard.sync()
        except (OSError, RuntimeError) as exc:  # a full disk, a truncated file: raised on every replica
            problem = Problem.of(exc)
        if shard.disk is not None:
            agree_objects(f"table {self.name!r}: get_embedding_tensor", None, self._collection.comm, problem=problem)
        mine = np.ascontiguousarray(shard.weights[self._slot.rows], dtype=self.master_dtype if master else self.dtype)
        gathered, counts = gather_rows(mine, self._collection.comm, name="rows")
        pieces = np.split(gathered, np.cumsum(counts)[:-1])
        return self._slot.layout.assemble(pieces)

    # -- lookups and updates of this table alone ----------------------------------------------
    def lookup(self, indices, clip_indices: bool = False) -> np.ndarray:
        """Rows of ``indices`` (any integer array): ``indices.shape + (e,)``. Collective
        (the collection's exchange with this table's IDs only). Errors as
        :meth:`popdist_lite.HostEmbedding.lookup`."""
        return self._collection._table_call(self, "lookup", indices, None, clip_indices)

    def apply_gradients(self, indices, grads, clip_indices: bool = False, *, loss_scale: float = 1.0) -> None:
        """Update the rows of ``indices`` with ``grads`` (``indices.shape + (e,)``).
        Collective; as :meth:`popdist_lite.HostEmbedding.apply_gradients`."""
        self._collection._table_call(self, "update", indices, grads, clip_indices, loss_scale=loss_scale)

    def lookup_bags(self, values, lengths=None, weights=None, combiner: str = "sum", padding_id=None,
                    clip_indices: bool = False) -> np.ndarray:
        """Pooled bags (:meth:`popdist_lite.HostEmbedding.lookup_bags`'s arguments and
        results). Collective."""
        return self._collection._table_call(self, "lookup", values, None, clip_indices,
                                            bags=(lengths, weights, combiner, padding_id))

    def apply_bag_gradients(self, values, grads, lengths=None, weights=None, combiner: str = "sum",
                            padding_id=None, clip_indices: bool = False, *, loss_scale: float = 1.0) -> None:
        """The update of :meth:`lookup_bags` (:meth:`popdist_lite.HostEmbedding.apply_bag_gradients`).
        Collective."""
        self._collection._table_call(self, "update", values, grads, clip_indices, loss_scale=loss_scale,
                                     bags=(lengths, weights, combiner, padding_id))

    # -- checkpoints (the Stateful protocol of popdist_lite.checkpoint) ------------------------
    def checkpoint_info(self) -> dict:
        """The manifest's entry, a host embedding table's (shape, dtypes, placement, arrays)."""
        arrays = sorted(self._stack.shard.arrays()[0])
        return {"type": "HostEmbedding", "shape": list(self.shape), "dtype": str(np.dtype(self.dtype)),
                "master_dtype": str(np.dtype(self.master_dtype)), "partition_strategy": self.state().partition_strategy,
                "sharding": self.sharding.sharding_type.value, "arrays": arrays}

    def state_dict(self) -> dict:
        """Live views of this replica's rows (weights, optimizer slots) as
        :class:`~popdist_lite.checkpoint.Partitioned` arrays split as the placement
        splits them (row-wise cyclic, column-wise block, table-wise one replica's,
        data-parallel replicated), and the rounding streams' states
        (:meth:`TableState.state_dict`). Local."""
        return self.state().state_dict()

    def validate_state_dict(self, state_dict: dict, saved) -> None:
        """Refuse a checkpoint of a table of another shape, or generator states its streams
        cannot take (before anything changes).

        Raises:
            ValueError: naming the table, what the checkpoint holds and what this table is.
        """
        shape = saved.info.get("shape")
        if not isinstance(shape, list) or tuple(shape) != tuple(self.shape):
            raise ValueError(f"table {saved.name!r} has shape {shape!r:.60}, the table being loaded has "
                             f"{tuple(self.shape)}")
        generators = (state_dict or {}).get("generators", {})
        try:
            self.stochastic_rounding.check_generator_states(generators if isinstance(generators, dict) else {})
        except ValueError as exc:
            raise ValueError(f"table {saved.name!r}: {exc}") from None

    def load_state_dict(self, state_dict: dict) -> None:
        """Finish a load: the arrays were filled in place; restore the table's rounding
        streams and refresh the served rows. Local."""
        generators = (state_dict or {}).get("generators") or {}
        if generators:
            self.stochastic_rounding.set_generator_states(generators)
        self._stack.shard.loaded(self._slot.rows)

    def __repr__(self) -> str:
        return (f"ShardedTable({self.name!r}, shape={list(self.shape)}, dtype={self.dtype}, "
                f"sharding={self.sharding.sharding_type.value}, ranks={list(self.sharding.ranks)})")


class TableCollection:
    """Tables placed over the replicas, read by named features: the core of
    :class:`EmbeddingBagCollection`, :class:`EmbeddingCollection` and the bindings'
    collections. Collective.

    Args:
        tables: :class:`~.configs.EmbeddingBagConfig` (pooled features) and
            :class:`~.configs.EmbeddingConfig` (sequence features), the same on every
            replica; table and feature names unique.
        plan: each table's placement: a :class:`~.planner.ShardingPlan`, or a mapping of
            table name to a :class:`~.placement.ParameterSharding` or sharding type name
            (``"row_wise"``, ``"column_wise"``, ``"table_wise"``, ``"data_parallel"``;
            a table-wise table's rank in its ``ParameterSharding(ranks=[k])``, else the
            planner's); tables it leaves out are placed by the planner. ``None``: the
            planner places every table.
        planner: the :class:`~.planner.EmbeddingShardingPlanner` (default: one for this
            replica count and the replicas' memory).
        comm: the replica communicator (default: the library's).

    Attributes:
        tables: table name -> :class:`ShardedTable`.
        features: the feature names, in output order (the tables' order, then each
            table's ``feature_names``).
        plan: the :class:`~.planner.ShardingPlan` in force (``print(collection.plan)``).
        stacks: the :class:`~.stacks.Stack` s.

    Raises:
        ValueError, TypeError: on every replica, for any replica's bad configs or plan,
            or configs or plans that differ between replicas (naming the replica).
    """

    _name = "TableCollection"

    def __init__(self, tables, *, plan=None, planner=None, comm=None):
        from .planner import EmbeddingShardingPlanner, ShardingPlan

        topology.init()
        self.comm = comm = topology.replica_comm() if comm is None else comm
        r = comm.size
        problem, configs = None, []
        try:
            configs = self._check_configs(tables)
            given = self._check_plan(plan, configs, r)
        except (ValueError, TypeError) as exc:
            problem, given = Problem.of(exc), {}
        signature = None if problem else [c.signature() for c in configs]
        seen = agree_objects(f"{self._name}", (signature, sorted((k, v.sharding_type.value, v.ranks)
                                                                 for k, v in given.items())), comm, problem=problem)
        for j, item in enumerate(seen):
            if item != seen[0]:
                raise ValueError(f"{self._name}: replica {j} passed other tables or another plan than replica 0: "
                                 f"{str(item)[:300]} against {str(seen[0])[:300]}; every replica must pass the same")
        if planner is None:
            planner = EmbeddingShardingPlanner()
        problem = None
        try:  # a replica's own planning error (another planner, say) is raised on every replica
            self.plan: ShardingPlan = planner.plan(configs, comm=comm, fixed=given)
        except (ValueError, TypeError) as exc:
            problem = Problem.of(exc)
        seen = agree_objects(f"{self._name}: plan", None if problem else self.plan.record(), comm, problem=problem)
        for j, item in enumerate(seen):
            if item != seen[0]:
                raise ValueError(f"{self._name}: replica {j} planned another placement than replica 0 (give every "
                                 f"replica the same planner and topology): {str(item)[:300]} against "
                                 f"{str(seen[0])[:300]}")
        code = _code([c.name for c in configs])
        limited = []
        for i, c in enumerate(configs):
            if c.spec.id_limits.limited:
                sharding = self.plan.shardings[c.name]
                if sharding.sharding_type not in (ShardingType.ROW_WISE, ShardingType.TABLE_WISE):
                    raise ValueError(f"{self._name}: table {c.name!r}: ID limits apply to row-wise and table-wise "
                                     f"tables, its placement is {sharding.sharding_type.value}")
                limited.append(LimitedTable(i, c.name, c.spec.id_limits, sharding.owner
                                            if sharding.sharding_type is ShardingType.TABLE_WISE else None))
        self._limits = BatchLimits(limited, comm, self._name, code) if limited else None
        self.configs = configs
        self.features = [name for c in configs for name in c.feature_names]
        self._features = [_Feature(name, i, isinstance(c, EmbeddingBagConfig),
                                   c.combiner if isinstance(c, EmbeddingBagConfig) else None)
                          for i, c in enumerate(configs) for name in c.feature_names]
        self.stacks = build_stacks(configs, self.plan.shardings, comm, self._name)
        self._initialize(configs)
        self.tables: dict[str, ShardedTable] = {}
        self._slot_of = {}
        for stack in self.stacks:
            for slot in stack.slots:
                self._slot_of[slot.index] = (stack, slot)
        for i, c in enumerate(configs):
            stack, slot = self._slot_of[i]
            self.tables[c.name] = ShardedTable(self, stack, slot)
        self._exchange = SparseExchange([s.exchange_stack for s in self.stacks], comm, self._name, code,
                                        self._bad_index, self._other_collection)
        self._code = code
        # per feature: its stack, and what its IDs are shifted by to become stack IDs
        self._stack_of_feature = np.array([self._slot_of[f.table][0].index for f in self._features], np.intp)
        self._gid_offset = np.array([self._slot_of[f.table][1].gid_offset for f in self._features], np.int64)
        self._rows_of_feature = np.array([configs[f.table].num_embeddings for f in self._features], np.int64)
        self._stack_features = [[j for j, f in enumerate(self._features) if self._stack_of_feature[j] == s.index]
                                for s in self.stacks]
        # a stack's output rows: its pooled features' bags, then its sequence features' IDs (pooling.OutputMap)
        self._row_order = [[j for j in m if self._features[j].pooled] + [j for j in m if not self._features[j].pooled]
                           for m in self._stack_features]

    # -- construction -----------------------------------------------------------------------------
    def _check_configs(self, tables) -> list:
        configs = list(tables.values()) if isinstance(tables, Mapping) else list(tables)
        if not configs:
            raise ValueError("argument tables: expected at least one table config, got none")
        names, features = set(), set()
        for c in configs:
            if not isinstance(c, EmbeddingConfig):
                raise TypeError(f"argument tables: expected EmbeddingBagConfig or EmbeddingConfig, got "
                                f"{type(c).__name__}")
            if c.name in names:
                raise ValueError(f"argument tables: table name {c.name!r} appears twice")
            names.add(c.name)
            for f in c.feature_names:
                if f in features:
                    raise ValueError(f"argument tables: feature {f!r} is read from two tables; a feature reads one")
                features.add(f)
        return configs

    @staticmethod
    def _check_plan(plan, configs: list, r: int) -> dict:
        """The placements ``plan`` fixes: table name -> completed ParameterSharding."""
        if plan is None:
            return {}
        shardings = getattr(plan, "shardings", plan)
        if not isinstance(shardings, Mapping):
            raise TypeError(f"argument plan: expected a ShardingPlan or a mapping of table name to placement, got "
                            f"{type(plan).__name__}")
        names = {c.name for c in configs}
        out = {}
        for name, value in shardings.items():
            if name not in names:
                raise ValueError(f"argument plan: no table {name!r} in this collection (tables: {sorted(names)})")
            try:
                sharding = value if isinstance(value, ParameterSharding) else ParameterSharding(sharding_type_of(value))
                out[name] = sharding.check(r, f"argument plan: table {name!r}") \
                    if sharding.sharding_type is not ShardingType.TABLE_WISE or sharding.ranks is not None else sharding
            except ValueError as exc:
                raise ValueError(str(exc) if str(exc).startswith("argument plan") else
                                 f"argument plan: table {name!r}: {exc}") from None
        return out

    def _initialize(self, configs: list) -> None:
        """Write every table's initial rows into its stack (one agreement of the given
        initializers' checksums for all tables)."""
        given = {i: c for i, c in enumerate(configs) if c.initializer is not None}
        tables, problem, crcs = {}, None, {}
        for i, c in given.items():
            table, problem, crc = initial_table(c.initializer, c.shape, c.spec.master_dtype)
            if problem is not None:
                problem = Problem(problem.error, f"table {c.name!r}: {problem.message}")
                break
            tables[i], crcs[i] = table, crc
        if given:
            seen = agree_objects(f"{self._name}: initializers", crcs, self.comm, problem=problem)
            for i, c in given.items():
                error = different_table(f"{self._name}: table {c.name!r}", [s.get(i) for s in seen])
                if error is not None:
                    raise error
        for stack in self.stacks:
            target = stack.shard.initial_writes()
            for slot in stack.slots:
                c = slot.config
                rows = target[slot.rows] if isinstance(target, np.ndarray) else target.view(slot.rows.start,
                                                                                            slot.rows.stop)
                if slot.index in tables:
                    slot.layout.shard_from_block(tables[slot.index], 0, rows)
                    continue
                low, high = (c.weight_init_min, c.weight_init_max) if c.weight_init_min is not None else (-0.05, 0.05)
                for first, block in default_blocks(c.shape, c.spec.master_dtype, c.spec.seed, low, high):
                    slot.layout.shard_from_block(block, first, rows)
            stack.shard.initialized()

    # -- errors ------------------------------------------------------------------------------------
    def _bad_index(self, replica: int, where: int, value: int) -> IndexError:
        """``where``: a feature's index, or ``-1 - table index`` (a table's own call)."""
        if where < 0:
            c = self.configs[-1 - where]
            return IndexError(f"table {c.name!r}: replica {replica} passed index {value}, expected indices in "
                              f"[0, {c.num_embeddings}) (pass clip_indices=True to clip instead); nothing was "
                              f"looked up or updated")
        f = self._features[where]
        c = self.configs[f.table]
        return IndexError(f"{self._name}: replica {replica}: feature {f.name!r} (table {c.name!r}): argument "
                          f"values: expected IDs in [0, {c.num_embeddings}), got {value}; nothing was looked up or "
                          f"updated")

    def _other_collection(self, codes: np.ndarray, op: str) -> None:
        other = np.flatnonzero(codes != self._code)
        if other.size:
            raise RuntimeError(f"{self._name}: replica {int(other[0])} called embedding_{op} on other tables at the "
                               f"same point; every replica must look up and update the same collections in the same "
                               f"order")

    # -- inputs --------------------------------------------------------------------------------------
    def _batch(self, features) -> _Batch:
        """This replica's input as a :class:`_Batch`, checked locally.

        Raises:
            KeyError, ValueError, TypeError: naming the feature and argument."""
        names = self.features
        if isinstance(features, KeyedJaggedArray):
            keys = list(features.keys)
            if sorted(keys) != sorted(names) or len(set(keys)) != len(keys):
                missing, extra = sorted(set(names) - set(keys)), sorted(set(keys) - set(names))
                raise KeyError(f"argument features: expected the keys {names}, got {keys}"
                               + (f" (missing {missing})" if missing else "") + (f" (unknown {extra})" if extra else ""))
            values, lengths, weights = features.values, features.lengths, features.weights
            if values.ndim != 1 or values.dtype.kind not in "iu":
                raise TypeError(f"argument features: expected 1-D integer values, got {values.dtype}{list(values.shape)}")
            if lengths.ndim != 1 or lengths.dtype.kind not in "iu" or (keys and lengths.size % len(keys)):
                raise ValueError(f"argument features: expected integer lengths of len(keys) * stride, got "
                                 f"{lengths.dtype}{list(lengths.shape)} for {len(keys)} keys")
            per_key = lengths.reshape(len(keys), -1) if keys else lengths.reshape(0, 0)
            if (lengths < 0).any() or int(lengths.sum()) != values.size:
                raise ValueError(f"argument features: expected non-negative lengths adding up to values.size = "
                                 f"{values.size}, got a sum of {int(lengths.sum())}")
            if weights is not None and (weights.shape != values.shape or weights.dtype.kind not in "fiu"):
                raise ValueError(f"argument features: expected real weights of the values' shape {list(values.shape)}, "
                                 f"got {weights.dtype}{list(weights.shape)}")
            counts = per_key.sum(axis=1)
            at = np.zeros(len(keys) + 1, np.int64)
            np.cumsum(counts, out=at[1:])
            where = {k: i for i, k in enumerate(keys)}
            if keys == names:
                ids = values.astype(np.int64, copy=False)
                w = weights
            else:
                order = [where[n] for n in names]
                ids = np.concatenate([values[at[i]:at[i + 1]] for i in order]).astype(np.int64, copy=False)
                w = None if weights is None else np.concatenate([weights[at[i]:at[i + 1]] for i in order])
            lengths_of = [per_key[where[n]] for n in names]
            counts_of = [int(counts[where[n]]) for n in names]
            weights_of = [None if w is None else None for _ in names]
            starts = np.zeros(len(names) + 1, np.int64)
            np.cumsum(counts_of, out=starts[1:])
            if w is not None:
                w = np.asarray(w, np.float64)
                weights_of = [w[starts[i]:starts[i + 1]] for i in range(len(names))]
            batch = _Batch(np.ascontiguousarray(ids), starts, lengths_of, weights_of)
        elif isinstance(features, Mapping):
            unknown = sorted(set(features) - set(names))
            if unknown:
                raise KeyError(f"argument features: unknown features {unknown} (this collection reads {names})")
            parts, lengths_of, weights_of = [], [], []
            for n in names:
                if n not in features:
                    raise KeyError(f"argument features: no batch for feature {n!r}")
                item = features[n]
                jagged = item if isinstance(item, JaggedArray) else _jagged(item)
                if jagged is None:
                    raise TypeError(f"feature {n!r}: expected a JaggedArray or (values, lengths[, weights]), got "
                                    f"{type(item).__name__}")
                v, lengths = jagged.values, jagged.lengths
                if v.ndim != 1 or v.dtype.kind not in "iu":
                    raise TypeError(f"feature {n!r}: argument values: expected 1-D integer IDs, got "
                                    f"{v.dtype}{list(v.shape)}")
                if lengths is None:
                    o = jagged.offsets
                    if o is None or o.ndim != 1 or o.dtype.kind not in "iu" or o.size < 1 or o[0] != 0 \
                            or (np.diff(o) < 0).any() or o[-1] != v.size:
                        raise ValueError(f"feature {n!r}: argument offsets: expected non-decreasing integer offsets "
                                         f"from 0 to values.size = {v.size}, got {o!r:.80}")
                    lengths = np.diff(o)
                if lengths.ndim != 1 or lengths.dtype.kind not in "iu" or (lengths < 0).any() \
                        or int(lengths.sum()) != v.size:
                    raise ValueError(f"feature {n!r}: argument lengths: expected non-negative integer lengths adding "
                                     f"up to values.size = {v.size}, got {lengths.dtype}{list(lengths.shape)} summing "
                                     f"to {int(lengths.sum()) if lengths.dtype.kind in 'iu' else '?'}")
                w = jagged.weights
                if w is not None and (w.shape != v.shape or w.dtype.kind not in "fiu"):
                    raise ValueError(f"feature {n!r}: argument weights: expected real weights of the values' shape "
                                     f"{list(v.shape)}, got {w.dtype}{list(w.shape)}")
                parts.append(v)
                lengths_of.append(lengths)
                weights_of.append(None if w is None else np.asarray(w, np.float64))
            counts_of = [p.size for p in parts]
            starts = np.zeros(len(names) + 1, np.int64)
            np.cumsum(counts_of, out=starts[1:])
            ids = np.concatenate(parts).astype(np.int64, copy=False) if len(parts) > 1 else \
                parts[0].astype(np.int64, copy=False)
            batch = _Batch(np.ascontiguousarray(ids), starts, lengths_of, weights_of)
        else:
            raise TypeError(f"argument features: expected a KeyedJaggedArray or a mapping of feature name to "
                            f"(values, lengths[, weights]), got {type(features).__name__}")
        for j, f in enumerate(self._features):
            if not f.pooled:
                if batch.weights[j] is not None:
                    raise ValueError(f"feature {f.name!r}: weights apply to pooled features (EmbeddingBagConfig) only")
        return batch

    def _bad(self, batch: _Batch):
        """``(feature, value)`` of this replica's first out-of-range ID, or ``None``."""
        ids = batch.ids
        if not ids.size:
            return None
        rows = self._rows_of_feature
        if (rows == rows[0]).all():
            if ids.view(np.uint64).max() < rows[0]:
                return None
            limit = rows[0]
        else:
            limit = np.repeat(rows, np.diff(batch.starts))
            if not (ids.view(np.uint64) >= limit).any():
                return None
        at = int(np.argmax(ids.view(np.uint64) >= limit))
        feature = int(np.searchsorted(batch.starts, at, side="right") - 1)
        return feature, int(ids[at])

    def _prepare(self, features):
        """``(batch, problem, bad)`` of this replica's input (nothing raised here)."""
        try:
            batch = self._batch(features)
        except (KeyError, ValueError, TypeError) as exc:
            return None, _problem(exc), None
        return batch, None, self._bad(batch)

    def _call(self, batch: _Batch) -> _Call:
        """The batch's IDs as the exchange takes them: stack IDs, and where each stack's
        and each limited table's IDs are."""
        counts = np.diff(batch.starts)
        offsets = self._gid_offset
        gid = batch.ids + np.repeat(offsets, counts) if offsets.any() else batch.ids
        if len(self.stacks) == 1:
            stack_pos = [None]
        else:
            stack_pos = [_ranges(batch.starts, members) for members in self._stack_features]
        table_pos = {}
        for t in (self._limits.tables if self._limits is not None else ()):
            table_pos[t.index] = _ranges(batch.starts, [j for j, f in enumerate(self._features) if f.table == t.index])
        return _Call(batch.ids, gid, stack_pos, table_pos)

    def _stack_gids(self, call: _Call, keep: np.ndarray | None = None) -> tuple[list, list]:
        """Every stack's stack IDs (C-contiguous int64) and, when ``keep`` (a mask over
        the call's IDs) is given, the indices of the kept ones in the stack's order."""
        gids, picked = [], []
        for pos in call.stack_pos:
            gid = call.gid if pos is None else call.gid[pos]
            if keep is None:
                gids.append(np.ascontiguousarray(gid))
                picked.append(None)
                continue
            mask = keep if pos is None else keep[pos]
            idx = np.flatnonzero(mask)
            gids.append(np.ascontiguousarray(gid[idx]))
            picked.append(idx)
        return gids, picked

    def _passes(self, op: str, call: _Call | None):
        """The ID-limit plan of a call (collective when the collection has limited
        tables): a list of masks over its IDs, one per pass, or ``[None]`` (one pass, all
        IDs); and whether any ID was dropped."""
        if self._limits is None:
            return [None], False
        plan = self._limits.plan(op, call.ids if call is not None else None, call.table_pos if call else {})
        if plan is None:
            return [None], False
        n = call.ids.size
        keep = np.ones(n, bool)
        if plan.dropped is not None:
            keep[plan.dropped] = False
        masks = []
        for positions in plan.passes:
            if positions is None:
                masks.append(keep)
            else:
                mask = np.zeros(n, bool)
                mask[positions] = True
                masks.append(mask)
        return masks, plan.dropped is not None and plan.dropped.size > 0

    def _exchange_lookup(self, call: _Call | None, problem, bad, keep: bool, what: str):
        """Every stack's unique rows and each of its IDs' row (``(rows, inverse, u)``
        per stack, in the stack's ID order; dropped IDs read a row of zeros past the
        others) and the exchange contexts (one per pass). Collective."""
        ok = problem is None and bad is None
        masks, dropped = self._passes("lookup", call if ok else None)
        serving = [s.shard.serving for s in self.stacks]
        if masks[0] is None:
            gids = self._stack_gids(call)[0] if ok else [None] * len(self.stacks)
            rows, routes, context = self._exchange.lookup(serving, gids, problem, bad, keep=keep, what=what)
            self._after_lookup()
            return [(u, route.inverse, route.u) for u, route in zip(rows, routes)], [context], [[0] * len(rows)]
        parts = [[] for _ in self.stacks]  # per stack: (picked, unique rows copy, inverse)
        contexts, offsets = [], []
        for mask in masks:
            gids, picked = self._stack_gids(call, mask)
            rows, routes, context = self._exchange.lookup(serving, gids, None, None, keep=keep, what=what)
            self._after_lookup()
            contexts.append(context)
            offsets.append([sum(p[1].shape[0] for p in parts[s]) for s in range(len(self.stacks))])
            for s, (u, route) in enumerate(zip(rows, routes)):
                parts[s].append((picked[s], np.array(u), route.inverse.copy()))
        out = []
        for s, stack in enumerate(self.stacks):
            n = call.ids.size if call.stack_pos[s] is None else call.stack_pos[s].size
            e = stack.e
            inverse = np.empty(n, np.intp)
            at = 0
            for picked, unique, inv in parts[s]:
                inverse[picked] = inv + at
                at += unique.shape[0]
            total = at + (1 if dropped else 0)
            rows = np.zeros((total, e), stack.dtype)
            at = 0
            for picked, unique, _ in parts[s]:
                rows[at:at + unique.shape[0]] = unique
                at += unique.shape[0]
            if dropped:
                covered = np.zeros(n, bool)
                for picked, _, _ in parts[s]:
                    covered[picked] = True
                inverse[~covered] = total - 1  # the row of zeros
            out.append((rows, inverse, total))
        return out, contexts, offsets

    def _routes(self, call: _Call | None, problem, bad):
        """The update's routes of every pass (local) and each stack's IDs' unique rows as
        :meth:`_exchange_lookup` numbers them: ``(per stack (inverse, u), [(routes,
        offsets)] per pass)``. Collective when the collection has limited tables."""
        ok = problem is None and bad is None
        masks, dropped = self._passes("update", call if ok else None)
        if not ok:
            return None, [([None] * len(self.stacks), None)]
        if masks[0] is None:
            routes = self._exchange.route("update", self._stack_gids(call)[0])
            return [(route.inverse, route.u) for route in routes], [(routes, [0] * len(routes))]
        passes = []
        totals = [0] * len(self.stacks)
        inverses = [np.empty(call.ids.size if pos is None else pos.size, np.intp) for pos in call.stack_pos]
        covered = [np.zeros(inv.size, bool) for inv in inverses]
        for mask in masks:
            gids, picked = self._stack_gids(call, mask)
            routes = self._exchange.route("update", gids)
            passes.append((routes, list(totals)))
            for s, route in enumerate(routes):
                inverses[s][picked[s]] = route.inverse + totals[s]
                covered[s][picked[s]] = True
                totals[s] += route.u
        out = []
        for s in range(len(self.stacks)):
            u = totals[s]
            if dropped:
                inverses[s][~covered[s]] = u
                u += 1
            out.append((inverses[s], u))
        return out, passes

    def _maps(self, batch: _Batch, mapped: list, keyed: bool) -> list:
        """Every stack's :class:`OutputMap` of the batch (``mapped``: per stack
        ``(inverse, u)``)."""
        maps = []
        for stack, members, (inverse, u) in zip(self.stacks, self._stack_features, mapped):
            rows, at = [], 0
            for j in members:
                n = int(batch.starts[j + 1] - batch.starts[j])
                f = self._features[j]
                rows.append(FeatureRows(at, at + n, batch.lengths[j] if f.pooled else None, f.combiner,
                                        batch.weights[j]))
                at += n
            maps.append(OutputMap(rows, inverse, u, keyed=keyed and self._keyed_stack(stack, members)))
        return maps

    def _keyed_stack(self, stack: Stack, members: list) -> bool:
        return all(self._features[j].pooled for j in members)

    def forward(self, features, *, keep: bool = True):
        """Every feature's output of this replica's batch. Collective (one agreement, one
        all-to-all of IDs, one of rows; with ID limits, their check first).

        Args:
            features: a :class:`~.jagged.KeyedJaggedArray` with exactly the collection's
                features as keys (any order; one stride), or a mapping of every feature
                name to its :class:`~.jagged.JaggedArray` or ``(values, lengths[,
                weights])``; values are IDs ``int[n]``, lengths ``int[B]``, weights
                ``float[n]`` (pooled features only).
            keep: keep what :meth:`backward` needs (the IDs stay on the replicas that
                hold their rows, so the update sends only the gradients).

        Returns:
            ``(outputs, context)``: the outputs (see :meth:`lookup`) and a
            :class:`LookupContext` for :meth:`backward` (``None`` without ``keep``).

        Raises:
            KeyError, ValueError, TypeError: on every replica, for any replica's missing
                or unknown feature or malformed batch (naming the replica, the feature,
                the argument, expected and got).
            IndexError: on every replica, for an ID outside its table on any replica.
            popdist_lite.IdLimitError: on every replica, for a table's ID limit
                exceeded without dropping or minibatching.
        """
        start = perf_counter()
        batch, problem, bad = self._prepare(features)
        call = self._call(batch) if problem is None and bad is None else None
        looked, contexts, offsets = self._exchange_lookup(call, problem, bad, keep, f"{self._name}.lookup")
        start_pool = perf_counter()
        keyed = self._keyed_output(batch)
        maps = self._maps(batch, [(inverse, u) for _, inverse, u in looked], keyed)
        outputs = self._outputs(batch, maps, [rows for rows, _, _ in looked], keyed)
        counters.record("lookup.pool", start_pool, kind=counters.PHASE, detail=self._name)
        counters.record("lookup", start, kind=counters.PHASE, detail=self._name)
        if not keep:
            return outputs, None
        sizes = [int(lengths.size) if f.pooled else None for f, lengths in zip(self._features, batch.lengths)]
        return outputs, LookupContext(contexts, maps, sizes, np.diff(batch.starts).tolist(), keyed, offsets)

    def _keyed_output(self, batch: _Batch) -> bool:
        """Whether pooled outputs are one ``(B, sum of dims)`` array (every feature pooled,
        one bag count, one dtype)."""
        return False

    def _outputs(self, batch: _Batch, maps: list, rows: list, keyed: bool):
        """name -> output array (pooled ``(B, e)``, sequence ``(n, e)``)."""
        out = {}
        for stack, members, m, unique in zip(self.stacks, self._row_order, maps, rows):
            result = m.forward(unique)
            at = 0
            for j in members:
                f = self._features[j]
                n = batch.lengths[j].size if f.pooled else int(batch.starts[j + 1] - batch.starts[j])
                out[f.name] = result[at:at + n]
                at += n
        return out

    def lookup(self, features):
        """Every feature's output (:meth:`forward` without a context). Collective.

        Returns:
            name -> array: a pooled feature's ``(B, e)``, a sequence feature's ``(n, e)``,
            in its table's dtype (the subclasses return TorchRec's types)."""
        return self.forward(features, keep=False)[0]

    def _after_lookup(self) -> None:
        """Disk stacks: raise a problem met while gathering on every replica; let
        prefetches go after the lookups of tables that are not updated."""
        for stack in self.stacks:
            disk = stack.shard.disk
            if disk is None:
                continue
            disk.agree(self.comm)
            if not stack.trainable:
                disk.used()
            self._sample(stack)

    def _sample(self, stack: Stack) -> None:
        disk = stack.shard.disk
        if counters.events is not None:
            counters.sample(f"disk {stack.name}", {k: disk.stats[k] for k in progress.STORAGE_FIELDS})
        if progress.recording():
            progress.add_storage(disk.unpublished())

    def _grads(self, context: LookupContext, grads) -> list:
        """Every stack's output gradients ``(rows, e)`` in its map's row order, checked.

        Raises:
            KeyError, ValueError, TypeError: naming the feature and what was expected."""
        per_feature = self._grads_by_feature(context, grads)
        out = []
        for stack, members in zip(self.stacks, self._row_order):
            if not stack.trainable:
                out.append(None)
                continue
            parts = [per_feature[j] for j in members]
            out.append(parts[0] if len(parts) == 1 else np.concatenate(parts) if parts
                       else np.zeros((0, stack.e), np.float32))
        return out

    def _grads_by_feature(self, context: LookupContext, grads) -> list:
        """Every feature's gradient ``(rows, e)`` (checked)."""
        if isinstance(grads, KeyedArray):
            grads = grads.to_dict()
        if not isinstance(grads, Mapping):
            raise TypeError(f"argument grads: expected a mapping of feature name to its output's gradient, got "
                            f"{type(grads).__name__}")
        unknown = sorted(set(grads) - set(self.features))
        if unknown:
            raise KeyError(f"argument grads: unknown features {unknown}")
        out = []
        for j, f in enumerate(self._features):
            e = self.configs[f.table].embedding_dim
            rows = context.batch_sizes[j] if f.pooled else context.counts[j]
            if f.name not in grads:
                raise KeyError(f"argument grads: no gradient for feature {f.name!r}")
            g = np.asarray(grads[f.name])
            if g.shape != (rows, e) or g.dtype.kind != "f":
                raise ValueError(f"feature {f.name!r}: argument grads: expected a floating array of shape "
                                 f"{[rows, e]}, got {g.dtype}{list(g.shape)}")
            out.append(g)
        return out

    def _sums(self, maps: list, per_stack: list) -> list:
        """Every trainable stack's gradient sums per unique row (``M.T @ G``)."""
        start = perf_counter()
        sums = [None if g is None else m.backward(g, stack.exchange_stack.acc)
                for stack, m, g in zip(self.stacks, maps, per_stack)]
        counters.record("update.coalesce", start, kind=counters.PHASE, detail=self._name)
        return sums

    def backward(self, context: LookupContext, grads, *, loss_scale: float = 1.0) -> None:
        """Update every trainable table from the gradients of :meth:`forward`'s outputs
        (the update in backward). Collective: one agreement, one all-to-all of gradient
        sums (the IDs stayed where the lookup sent them); per minibatch when ID limits
        split the lookup.

        Per row, every replica's gradients are summed (over features, bags and replicas),
        divided by ``loss_scale`` (pass the number of replicas for the gradient of the
        replicas' mean loss), and the table's optimizer spec steps once, on the replica
        holding the row (column-wise: each replica its columns; data-parallel: every
        replica, identically).

        Args:
            context: :meth:`forward`'s context of the same batch (every replica passes
                the context of the same lookup; each context once).
            grads: a mapping of feature name to the gradient of its output (its shape),
                or, for an :class:`EmbeddingBagCollection`, the :class:`~.jagged.KeyedArray`
                of the outputs' gradient or its ``(B, sum of dims)`` values.
            loss_scale: as above; the same on every replica.

        Raises:
            KeyError, ValueError, TypeError: on every replica, for any replica's missing,
                unknown or malformed gradient; nothing is updated.
            RuntimeError: replicas passing the contexts of different lookups.
        """
        start = perf_counter()
        problem, per_stack = None, []
        try:
            if not isinstance(context, LookupContext) or context.used:
                raise ValueError("argument context: expected the LookupContext of a forward(keep=True) not yet "
                                 "given to backward")
            per_stack = self._grads(context, grads)
        except (KeyError, ValueError, TypeError) as exc:
            problem = _problem(exc)
        if problem is not None:
            self._exchange.backward(_dummy(self._exchange), [], problem, what=f"{self._name}.backward")
        sums = self._sums(context.maps, per_stack)
        for exchange, offsets in zip(context.exchange, context.offsets):
            part = [None if total is None else total[o:o + route.u]
                    for total, o, route in zip(sums, offsets, exchange.routes)]
            pairs = self._exchange.backward(exchange, part, None, what=f"{self._name}.backward")
            context.used = True  # the first update ran: the context's IDs are spent
            self._apply(pairs, loss_scale)
        counters.record("update", start, kind=counters.PHASE, detail=self._name)

    def apply_gradients(self, features, grads, *, loss_scale: float = 1.0) -> None:
        """:meth:`forward` (without rows) then :meth:`backward`: update from the outputs'
        gradients of ``features``. Collective (one agreement, one all-to-all of IDs and
        one of gradient sums). Arguments and errors as :meth:`forward` and
        :meth:`backward`."""
        start = perf_counter()
        batch, problem, bad = self._prepare(features)
        call = self._call(batch) if problem is None and bad is None else None
        mapped, passes = self._routes(call, problem, bad)
        sums = [None] * len(self.stacks)
        if mapped is not None:
            keyed = self._keyed_output(batch)
            maps = self._maps(batch, mapped, keyed)
            sizes = [int(lengths.size) if f.pooled else None for f, lengths in zip(self._features, batch.lengths)]
            context = LookupContext(None, maps, sizes, np.diff(batch.starts).tolist(), keyed)
            try:
                sums = self._sums(maps, self._grads(context, grads))
            except (KeyError, ValueError, TypeError) as exc:
                problem = _problem(exc)
        self._update_passes(passes, sums, problem, bad, loss_scale, f"{self._name}.apply_gradients")
        counters.record("update", start, kind=counters.PHASE, detail=self._name)

    def _update_passes(self, passes: list, sums: list, problem, bad, loss_scale: float, what: str) -> None:
        """The stateless update of every pass (its routes and first unique row per stack)."""
        for routes, offsets in passes:
            if offsets is None or problem is not None:
                part = [None] * len(self.stacks)
            else:
                part = [None if total is None or route is None else total[o:o + route.u]
                        for total, o, route in zip(sums, offsets, routes)]
            pairs = self._exchange.update(routes, part, problem, bad, what=what)
            self._apply(pairs, loss_scale)

    def _apply(self, pairs: list, loss_scale: float) -> None:
        start = perf_counter()
        for stack, pair in zip(self.stacks, pairs):
            disk = stack.shard.disk
            if pair is not None:
                stack.shard.apply(pair[0], pair[1], loss_scale)
            if disk is not None:
                disk.unpin()
                if stack.trainable:
                    disk.used()
                self._sample(stack)
        counters.record("update.apply", start, kind=counters.PHASE, detail=self._name)

    # -- one table's calls (ShardedTable) ----------------------------------------------------------------
    def _table_call(self, table: ShardedTable, op: str, indices, grads, clip_indices: bool, *,
                    loss_scale: float = 1.0, bags=None):
        """A lookup or update of one table's IDs through the collection's exchange (the
        other stacks send nothing). ``bags``: ``(lengths, weights, combiner, padding_id)``
        for pooled bags (:mod:`.combiners`)."""
        from . import combiners

        stack, slot = table._stack, table._slot
        t, e = table.shape
        problem, bad, flat, shape, feature = None, None, np.zeros(0, np.int64), (0,), FeatureRows(0, 0)
        try:
            if bags is not None:
                made = combiners.make_bags(indices, bags[0], bags[1], bags[2], bags[3])
                flat, shape = made.ids, made.shape
                scale = None if bags[1] is None and bags[2] == "sum" else made.scale
                feature = FeatureRows(0, flat.size, made.sizes, "sum", scale)
            else:
                indices = np.asarray(indices)
                if indices.dtype.kind not in "iu":
                    raise TypeError(f"argument indices: expected an integer dtype, got {indices.dtype}")
                flat, shape = indices.reshape(-1).astype(np.int64), indices.shape
                feature = FeatureRows(0, flat.size)
            if clip_indices:
                flat = np.clip(flat, 0, t - 1)
            if op == "update":
                g = np.asarray(grads)
                want = tuple(shape) + (e,)
                if g.shape != want or g.dtype.kind != "f":
                    raise ValueError(f"argument grads: expected a floating array of shape {list(want)}, got "
                                     f"{g.dtype}{list(g.shape)}")
                grads = g.reshape(-1, e)
        except (ValueError, TypeError) as exc:
            problem = Problem(type(exc), f"table {table.name!r}: {exc}")
        if problem is None and flat.size and flat.view(np.uint64).max() >= t:
            bad = (-1 - slot.index, int(flat[np.argmax((flat < 0) | (flat >= t))]))
        call = None
        if problem is None and bad is None:
            n = flat.size
            stack_pos = [np.arange(n) if s is stack else np.zeros(0, np.intp) for s in self.stacks]
            if len(self.stacks) == 1:
                stack_pos = [None]
            table_pos = {slot.index: np.arange(n)} if self._limits is not None and any(
                lt.index == slot.index for lt in self._limits.tables) else {}
            if self._limits is not None:
                table_pos.update({lt.index: np.zeros(0, np.intp) for lt in self._limits.tables
                                  if lt.index not in table_pos})
            call = _Call(flat, flat + slot.gid_offset, stack_pos, table_pos)
        what = f"table {table.name!r}: {'lookup' if op == 'lookup' else 'apply_gradients'}"
        if op == "lookup":
            looked, _, _ = self._exchange_lookup(call, problem, bad, False, what)
            rows, inverse, u = looked[stack.index]
            out = OutputMap([feature], inverse, u).forward(rows)
            return out.reshape(tuple(shape) + (e,))
        mapped, passes = self._routes(call, problem, bad)
        sums = [None] * len(self.stacks)
        if mapped is not None and stack.trainable:
            inverse, u = mapped[stack.index]
            sums[stack.index] = OutputMap([feature], inverse, u).backward(grads, stack.exchange_stack.acc)
        self._update_passes(passes, sums, problem, bad, loss_scale, what)

    # -- checkpoints (the Stateful protocol of popdist_lite.checkpoint) ------------------------------------
    def checkpoint_info(self) -> dict:
        """The manifest's entry: the tables and the plan (``plan.record()``)."""
        return {"tables": [c.name for c in self.configs], "plan": self.plan.record()}

    def state_dict(self) -> dict:
        """Every table (:meth:`ShardedTable.state_dict`) under its name. Local."""
        return {checkpoint_key(name): table for name, table in self.tables.items()}

    def validate_state_dict(self, state_dict: dict, saved) -> None:
        """Refuse a checkpoint of a collection with other tables, or whose plan record is
        malformed (the checkpoint is untrusted input; its arrays are resharded to this
        plan whatever the saved one).

        Raises:
            ValueError: naming the collection and what differs.
        """
        from .planner import ShardingPlan

        theirs = saved.info.get("tables")
        mine = [c.name for c in self.configs]
        if not isinstance(theirs, list) or sorted(map(str, theirs)) != sorted(mine):
            raise ValueError(f"collection {saved.name!r}: the checkpoint holds the tables {str(theirs)[:200]}, this "
                             f"collection has {mine}")
        if "plan" in saved.info:
            ShardingPlan.from_record(saved.info["plan"], mine)

    def load_state_dict(self, state_dict: dict) -> None:
        """Nothing left: the tables loaded themselves."""

    def __repr__(self) -> str:
        return f"{self._name}(tables={[c.name for c in self.configs]}, features={self.features})"


class EmbeddingBagCollection(TableCollection):
    """Pooled features of several tables, placed over the replicas (TorchRec's
    ``EmbeddingBagCollection``, numpy in and out). Collective to create.

    Args:
        tables: :class:`~.configs.EmbeddingBagConfig` s.
        plan, planner, comm: as :class:`TableCollection`.

    :meth:`lookup` / :meth:`forward` return a :class:`~.jagged.KeyedArray`: ``values``
    ``(B, sum of dims)`` in the tables' lookup dtype (the widest of them), feature
    after feature in :attr:`features` order, every feature's batch of ``B`` bags (the
    same ``B`` for every feature). Gradients for :meth:`backward` /
    :meth:`apply_gradients`: the :class:`~.jagged.KeyedArray` of the outputs' gradient,
    a ``(B, sum of dims)`` array, or a mapping of feature name to ``(B, e)``.
    """

    _name = "EmbeddingBagCollection"

    def _check_configs(self, tables) -> list:
        configs = super()._check_configs(tables)
        for c in configs:
            if not isinstance(c, EmbeddingBagConfig):
                raise TypeError(f"argument tables: an EmbeddingBagCollection takes EmbeddingBagConfig s, got "
                                f"{type(c).__name__} {c.name!r}")
        return configs

    def _batch(self, features) -> _Batch:
        batch = super()._batch(features)
        sizes = {int(lengths.size) for lengths in batch.lengths}
        if len(sizes) > 1:
            raise ValueError(f"argument features: expected the same number of bags for every feature, got "
                             f"{dict(zip(self.features, (int(x.size) for x in batch.lengths)))}")
        return batch

    def _keyed_output(self, batch: _Batch) -> bool:
        return True

    def _outputs(self, batch: _Batch, maps: list, rows: list, keyed: bool) -> KeyedArray:
        dims = [self.configs[f.table].embedding_dim for f in self._features]
        b = int(batch.lengths[0].size) if batch.lengths else 0
        dtype = np.result_type(*[s.dtype for s in self.stacks])
        out = aligned_empty((b, sum(dims)), dtype)
        at = np.zeros(len(dims) + 1, np.int64)
        np.cumsum(dims, out=at[1:])
        same = len(set(dims)) == 1  # one dim: the output is (B, F, e), a stack's features a gather of it
        for stack, members, m, unique in zip(self.stacks, self._stack_features, maps, rows):
            first, last = members[0], members[-1]
            contiguous = members == list(range(first, last + 1))
            if contiguous and at[first] == 0 and at[last + 1] == at[-1] and dtype == unique.dtype:
                m.forward(unique, out=out.reshape(b * len(members), stack.e))  # the whole output, in place
                continue
            result = m.forward(unique).reshape(b, len(members), stack.e)
            if same:
                out.reshape(b, len(dims), stack.e)[:, members] = result
                continue
            for i, j in enumerate(members):
                out[:, at[j]:at[j + 1]] = result[:, i]
        return KeyedArray(list(self.features), dims, out)

    def _grads_by_feature(self, context: LookupContext, grads) -> list:
        if isinstance(grads, np.ndarray) or (not isinstance(grads, (Mapping, KeyedArray)) and hasattr(grads, "shape")):
            g = np.asarray(grads)
            dims = [self.configs[f.table].embedding_dim for f in self._features]
            b = context.batch_sizes[0] if context.batch_sizes else 0
            if g.shape != (b, sum(dims)) or g.dtype.kind != "f":
                raise ValueError(f"argument grads: expected a floating array of shape {[b, sum(dims)]}, got "
                                 f"{g.dtype}{list(g.shape)}")
            grads = KeyedArray(list(self.features), dims, g)
        return super()._grads_by_feature(context, grads)

    def _grads(self, context: LookupContext, grads) -> list:
        dims = [self.configs[f.table].embedding_dim for f in self._features]
        at = np.zeros(len(dims) + 1, np.int64)
        np.cumsum(dims, out=at[1:])
        b = context.batch_sizes[0] if context.batch_sizes else 0
        whole = grads.values if isinstance(grads, KeyedArray) and list(grads.keys) == self.features else grads
        if isinstance(whole, np.ndarray) and whole.shape == (b, int(at[-1])) and whole.dtype.kind == "f":
            per_feature = None  # one (B, sum of dims) array: each stack's columns are a block of it
        else:
            per_feature = self._grads_by_feature(context, grads)
        out = []
        same = len(set(dims)) == 1
        for stack, members in zip(self.stacks, self._stack_features):
            if not stack.trainable:
                out.append(None)
                continue
            first, last = members[0], members[-1]
            if per_feature is None and members == list(range(first, last + 1)):
                block = whole[:, at[first]:at[last + 1]]  # (b, f) rows: bag b of the stack's features side by side
                out.append(np.ascontiguousarray(block).reshape(b * len(members), stack.e))
                continue
            if per_feature is None and same:
                out.append(whole.reshape(b, len(dims), stack.e)[:, members].reshape(b * len(members), stack.e))
                continue
            if per_feature is None:
                per_feature = self._grads_by_feature(context, grads)
            block = np.empty((b, len(members), stack.e), np.result_type(*[per_feature[j].dtype for j in members]))
            for i, j in enumerate(members):
                block[:, i] = per_feature[j]
            out.append(block.reshape(b * len(members), stack.e))
        return out


class EmbeddingCollection(TableCollection):
    """Sequence features of several tables, placed over the replicas (TorchRec's
    ``EmbeddingCollection``, numpy in and out): one row per ID. Collective to create.

    Args:
        tables: :class:`~.configs.EmbeddingConfig` s.
        plan, planner, comm: as :class:`TableCollection`.

    :meth:`lookup` / :meth:`forward` return ``{feature: JaggedArray(values=(n, e),
    lengths=(B,))}`` (TorchRec's ``Dict[str, JaggedTensor]``); gradients for
    :meth:`backward` / :meth:`apply_gradients`: a mapping of feature name to ``(n, e)``
    (or to a ``JaggedArray`` whose values are that).
    """

    _name = "EmbeddingCollection"

    def _check_configs(self, tables) -> list:
        configs = super()._check_configs(tables)
        for c in configs:
            if isinstance(c, EmbeddingBagConfig):
                raise TypeError(f"argument tables: an EmbeddingCollection takes EmbeddingConfig s (sequence "
                                f"features), got EmbeddingBagConfig {c.name!r}")
        return configs

    def _outputs(self, batch: _Batch, maps: list, rows: list, keyed: bool) -> dict:
        out = super()._outputs(batch, maps, rows, keyed)
        return {name: JaggedArray(out[name], batch.lengths[j]) for j, name in enumerate(self.features)}

    def _grads_by_feature(self, context: LookupContext, grads) -> list:
        if isinstance(grads, Mapping):
            grads = {k: (v.values if isinstance(v, JaggedArray) else v) for k, v in grads.items()}
        return super()._grads_by_feature(context, grads)


def _jagged(item) -> JaggedArray | None:
    """A feature's ``(values, lengths[, weights])`` or ``{"values": ..., "lengths" or
    "offsets": ..., "weights": ...}`` as a :class:`JaggedArray` (``None``: neither)."""
    if isinstance(item, (tuple, list)) and len(item) in (2, 3):
        return JaggedArray(item[0], item[1], weights=item[2] if len(item) == 3 else None)
    if isinstance(item, Mapping) and "values" in item:
        return JaggedArray(item["values"], item.get("lengths"), item.get("offsets"), item.get("weights"))
    return None


def _ranges(starts: np.ndarray, members: list) -> np.ndarray:
    """The positions ``[starts[j], starts[j + 1])`` of features ``members``, concatenated."""
    parts = [np.arange(starts[j], starts[j + 1]) for j in members]
    return np.concatenate(parts) if parts else np.zeros(0, np.intp)


def _problem(exc: Exception) -> Problem:
    """This replica's input error, raised on every replica by the next agreement."""
    message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    return Problem(type(exc), message)


def _code(names: list) -> int:
    import zlib

    return zlib.crc32("\x00".join(names).encode()) & 0x7FFFFFFF


def _dummy(exchange: SparseExchange):
    """A lookup context that carries nothing: the update's agreement raises the problem."""
    from .sparse import Lookup

    return Lookup(-1, [None] * len(exchange.stacks), [])
