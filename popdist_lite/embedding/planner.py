"""Placing a collection's tables: :class:`EmbeddingShardingPlanner` and the
:class:`ShardingPlan` it makes, at TorchRec's names (``torchrec.distributed.planner``:
``EmbeddingShardingPlanner``, ``Topology``, ``ParameterConstraints``).

TorchRec's planner enumerates sharding options per table, estimates each one's storage
and step time, and partitions them over the ranks to fit each rank's memory and
balance the estimated time. This planner does the same with a cost model of
popdist-lite's own exchange (:mod:`.sparse`), in which every placement moves its
table's rows in the same collectives, so what the choice changes is where rows are
stored and which replica serves and updates them:

1. **Fixed placements first**: a table whose placement the collection's ``plan`` or a
   :class:`ParameterConstraints` with one sharding type (and, table-wise, one rank)
   fixes is placed so.
2. **Data-parallel** for small tables when all of them are: when every table left to
   place is at most ``data_parallel_max_bytes`` (default 1 MiB: weights, serving copy,
   optimizer state) and every replica has room, all are replicated: lookups then read
   local copies and exchange no rows, and an update is a sparse all-reduce of at most
   ``t`` rows per table. Beside larger tables a small table is placed as they are (3,
   4): in one exchange for every table, replicating it would save no bytes (at two
   replicas its gradient sums move as many bytes as its IDs and rows would, above two
   more, as every replica's sums reach every replica) and would add a stack, with its
   copies, to every call.
3. **Table-wise, balanced**: the other tables by decreasing expected load (the bytes
   their IDs, rows and gradients move per step), each whole to the replica with the
   least load so far that has room for it (leaving room for the tables still waiting),
   while that replica's load stays within ``balance`` (default 1.1) of an even share
   of all these tables' load and the table is no larger than ``balance`` times an
   even share of their storage: many tables then spread over the replicas, and each
   table's rows are served and updated by one replica.
4. **Row-wise** for the rest: tables whose load or storage is above one replica's
   share, split over every replica (the TOKEN strategy); a table that fits nowhere
   split stays whole where it fits.
5. **Column-wise** only where a constraint asks for it: it stores what row-wise stores
   and moves the same row bytes, but sends every ID to every replica.

Storage per replica (``t`` rows of ``e`` columns, ``b`` bytes per row for the master
weights, the serving copy of a float16 table with float32 master weights and the
optimizer state): row-wise and column-wise ``b * t / r`` each, table-wise ``b * t`` on
its replica, data-parallel ``b * t`` on every replica. A table on disk
(``storage=DiskStorage(...)``) counts its rows against the replica's disk capacity and
its cache against the memory. Expected load of a table (bytes per replica and step):
``u * (4 + e * s + 4 * e)`` for its ``u`` expected distinct IDs per replica
(``t * (1 - exp(-n / t))`` for ``n`` IDs: uniform IDs, an upper bound for skewed ones),
``s`` the lookup dtype's size: an ID out, its row back, its gradient sum out.
``n`` is ``batch_size`` bags per replica times each feature's pooling factor (IDs per
bag, 1 by default: one categorical value per sample, as Criteo's).

The plan prints as a table like TorchRec's planner statistics (``print(plan)``) and is
saved in checkpoints (:meth:`ShardingPlan.record`); a checkpoint saved under one plan
loads under any other (the arrays are resharded by their partitions).
"""

from __future__ import annotations

import math
import os
import shutil
import socket
from dataclasses import dataclass, field

import numpy as np

from .configs import EmbeddingConfig
from .placement import ParameterSharding, ShardingType, sharding_type_of

#: Tables at most this large (bytes) are replicated unless constrained otherwise.
DATA_PARALLEL_MAX_BYTES = 1 << 20
#: The fraction of a host's available memory (and of its storage directories' free
#: space) the default topology lets its replicas' tables take.
MEMORY_FRACTION = 0.5
_ORDER = (ShardingType.DATA_PARALLEL, ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.COLUMN_WISE)
_SHORT = {ShardingType.ROW_WISE: "RW", ShardingType.COLUMN_WISE: "CW", ShardingType.TABLE_WISE: "TW",
          ShardingType.DATA_PARALLEL: "DP"}


@dataclass(frozen=True)
class ParameterConstraints:
    """What the planner may choose for one table (TorchRec's ``ParameterConstraints``).

    Attributes:
        sharding_types: the allowed sharding types (names or :class:`ShardingType`);
            one type fixes it. ``None``: any (column-wise only when listed).
        ranks: the replicas a table-wise placement may use (one: fixed).
        pooling_factors: the expected IDs per bag of each of the table's features
            (default 1 each).
        batch_size: bags per replica and step of the table's features (default: the
            planner's).
    """

    sharding_types: tuple | None = None
    ranks: tuple | None = None
    pooling_factors: tuple | None = None
    batch_size: int | None = None

    def __post_init__(self):
        if self.sharding_types is not None:
            types = (self.sharding_types,) if isinstance(self.sharding_types, (str, ShardingType)) \
                else self.sharding_types
            object.__setattr__(self, "sharding_types", tuple(sharding_type_of(t) for t in types))
        if self.ranks is not None:
            object.__setattr__(self, "ranks", tuple(int(k) for k in self.ranks))
        if self.pooling_factors is not None:
            object.__setattr__(self, "pooling_factors", tuple(float(p) for p in self.pooling_factors))


@dataclass(frozen=True)
class Topology:
    """The replicas' capacities (TorchRec's ``Topology``, by bytes rather than devices).

    Attributes:
        world_size: the number of replicas.
        memory_bytes: what each replica's tables may take in memory: one int for every
            replica, or one per replica.
        disk_bytes: what each replica's disk tables may take on disk (int or per replica).
    """

    world_size: int
    memory_bytes: int | tuple = 1 << 62
    disk_bytes: int | tuple = 1 << 62

    def memory(self) -> list[int]:
        return _per_replica(self.memory_bytes, self.world_size, "memory_bytes")

    def disk(self) -> list[int]:
        return _per_replica(self.disk_bytes, self.world_size, "disk_bytes")

    @classmethod
    def current(cls, comm, directories=(), fraction: float = MEMORY_FRACTION) -> "Topology":
        """This job's topology: each replica's share of its host's available memory
        (``MemAvailable`` over the replicas on the host) and of the free space of
        ``directories`` (the disk tables' storage directories), times ``fraction``.
        Collective (one small agreement)."""
        from ..collectives import agree_objects

        host = socket.gethostname()
        memory = _available_memory()
        disk = min([shutil.disk_usage(d).free for d in directories if os.path.isdir(d)], default=1 << 62)
        seen = agree_objects("Topology.current", (host, memory, disk), comm)
        per_host = {}
        for h, _, _ in seen:
            per_host[h] = per_host.get(h, 0) + 1
        return cls(comm.size, tuple(int(m * fraction) // per_host[h] for h, m, _ in seen),
                   tuple(int(d * fraction) // per_host[h] for h, _, d in seen))


def _per_replica(value, r: int, what: str) -> list[int]:
    values = [int(value)] * r if isinstance(value, (int, np.integer)) else [int(v) for v in value]
    if len(values) != r or min(values) < 0:
        raise ValueError(f"Topology: argument {what}: expected one non-negative int or {r} of them, got {value!r}")
    return values


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


@dataclass
class TablePlan:
    """One table's line of a plan: its placement and why, and the estimates behind it."""

    name: str
    shape: tuple
    sharding: ParameterSharding
    reason: str
    memory: list            # bytes per replica
    disk: list              # bytes per replica
    ids_per_step: float     # expected IDs per replica and step
    load: float             # expected bytes per step of one replica's IDs
    loads: list = field(default_factory=list)  # the load each replica carries for the table


@dataclass
class ShardingPlan:
    """Every table's placement (TorchRec's ``ShardingPlan``), with the planner's estimates.

    Attributes:
        shardings: table name -> :class:`~.placement.ParameterSharding`.
        num_replicas: ``r``.
        tables: table name -> :class:`TablePlan` (empty for a plan read from a record).
        capacity: ``(memory, disk)`` bytes per replica the plan was made for.
    """

    shardings: dict
    num_replicas: int
    tables: dict = field(default_factory=dict)
    capacity: tuple = ((), ())

    def record(self) -> dict:
        """The JSON a checkpoint keeps: ``{"num_replicas": r, "tables": {name:
        {"sharding": type, "ranks": [...]}}}``."""
        return {"num_replicas": self.num_replicas,
                "tables": {name: {"sharding": s.sharding_type.value, "ranks": list(s.ranks)}
                           for name, s in self.shardings.items()}}

    @classmethod
    def from_record(cls, record, tables: list | None = None) -> "ShardingPlan":
        """A plan from :meth:`record`'s JSON, checked as untrusted input (a checkpoint's).

        Raises:
            ValueError: anything malformed, naming the field (or tables other than
                ``tables`` when given).
        """
        if not isinstance(record, dict):
            raise ValueError(f"plan record: expected an object, got {type(record).__name__}")
        r = record.get("num_replicas")
        if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= 1 << 16:
            raise ValueError(f"plan record: num_replicas: expected an int in [1, 65536], got {r!r:.40}")
        entries = record.get("tables")
        if not isinstance(entries, dict):
            raise ValueError("plan record: tables: expected an object")
        if tables is not None and sorted(entries) != sorted(tables):
            raise ValueError(f"plan record: holds the tables {sorted(entries)[:20]}, expected {sorted(tables)[:20]}")
        shardings = {}
        for name, entry in entries.items():
            if not isinstance(entry, dict) or not isinstance(entry.get("ranks"), list) \
                    or not all(isinstance(k, int) and not isinstance(k, bool) for k in entry["ranks"]):
                raise ValueError(f"plan record: table {name!r:.80}: expected sharding and ranks")
            try:
                shardings[name] = ParameterSharding(sharding_type_of(entry.get("sharding")),
                                                    tuple(entry["ranks"])).check(r, f"plan record: table {name!r:.80}")
            except (ValueError, TypeError) as exc:
                raise ValueError(str(exc)) from None
        return cls(shardings, r)

    def __str__(self) -> str:
        r = self.num_replicas
        memory, disk = self.capacity if self.capacity[0] else ([0] * r, [0] * r)
        used_m, used_d, load = [0] * r, [0] * r, [0.0] * r
        kinds = [dict() for _ in range(r)]
        for t in self.tables.values():
            for k in range(r):
                used_m[k] += t.memory[k]
                used_d[k] += t.disk[k]
                load[k] += t.loads[k] if t.loads else 0.0
                if k in t.sharding.ranks:
                    short = _SHORT[t.sharding.sharding_type]
                    kinds[k][short] = kinds[k].get(short, 0) + 1
        rows = [("Rank", "Memory", "Disk", "Load (MB/step)", "Shards")]
        for k in range(r):
            rows.append((str(k), _share(used_m[k], memory[k]), _share(used_d[k], disk[k]), f"{load[k] / 1e6:.3f}",
                         " ".join(f"{s}: {n}" for s, n in sorted(kinds[k].items())) or "-"))
        params = [("Table", "Rows x Dim", "Sharding", "Ranks", "Memory/replica", "IDs/step", "Why")]
        for t in self.tables.values():
            params.append((t.name, f"{t.shape[0]} x {t.shape[1]}", t.sharding.sharding_type.value,
                           _ranks(t.sharding.ranks), _bytes(max(t.memory)), f"{t.ids_per_step:.0f}", t.reason))
        if not self.tables:
            for name, s in self.shardings.items():
                params.append((name, "?", s.sharding_type.value, _ranks(s.ranks), "?", "?", "from a record"))
        lines = [f"--- popdist-lite sharding plan: {len(self.shardings)} table(s) over {r} replica(s) ---"]
        lines += _table(rows) + ["", "Parameter Info:"] + _table(params)
        width = max(len(line) for line in lines)
        border = "#" * (width + 4)
        return "\n".join([border] + [f"# {line.ljust(width)} #" for line in lines] + [border])


def _table(rows: list) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = ["  ".join(cell.rjust(w) if i in (1, 2, 3) and rows[0][0] == "Rank" else cell.ljust(w)
                     for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    out.insert(1, "  ".join("-" * w for w in widths))
    return out


def _bytes(n: float) -> str:
    if n >= 1 << 61:
        return "unlimited"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _share(used: int, capacity: int) -> str:
    if not used:
        return "0"
    if capacity <= 0 or capacity >= 1 << 61:
        return _bytes(used)
    return f"{_bytes(used)} ({100 * used / capacity:.0f}%)"


def _ranks(ranks) -> str:
    ranks = list(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


class EmbeddingShardingPlanner:
    """Chooses each table's placement (the module docstring's rules).

    Args:
        topology: the replicas' capacities (:class:`Topology`); default: the job's
            (:meth:`Topology.current`, a collective).
        batch_size: bags per replica and step of every feature (TorchRec's planner's
            ``batch_size``; default 512).
        constraints: table name -> :class:`ParameterConstraints`.
        data_parallel_max_bytes: the largest table (bytes) replicated by default.
        balance: how far above an even share of the load a replica may go with
            table-wise tables before the planner splits a table row-wise.
    """

    def __init__(self, topology: Topology | None = None, batch_size: int = 512, constraints: dict | None = None,
                 data_parallel_max_bytes: int = DATA_PARALLEL_MAX_BYTES, balance: float = 1.1):
        self.topology, self.batch_size = topology, int(batch_size)
        self.constraints = dict(constraints or {})
        self.data_parallel_max_bytes, self.balance = int(data_parallel_max_bytes), float(balance)
        for name, c in self.constraints.items():
            if not isinstance(c, ParameterConstraints):
                raise TypeError(f"EmbeddingShardingPlanner: argument constraints: table {name!r}: expected "
                                f"ParameterConstraints, got {type(c).__name__}")

    def plan(self, tables: list, comm=None, *, fixed: dict | None = None, num_replicas: int | None = None
             ) -> ShardingPlan:
        """The plan of ``tables`` (:class:`~.configs.EmbeddingConfig` s). Collective
        when the topology is the job's (``comm``); local with a given :class:`Topology`.

        Args:
            tables: the configs.
            comm: the replica communicator (default: the library's).
            fixed: table name -> :class:`ParameterSharding` placed as given (a
                table-wise one without ranks gets the least-loaded replica).
            num_replicas: plan for this many replicas (with a given topology).

        Raises:
            ValueError: unknown tables in the constraints, a constraint no placement
                meets, or tables that do not fit the replicas' capacities (naming the
                table, what it needs and what is left).
        """
        topology = self.topology
        if topology is None:
            from .. import topology as job

            job.init()
            comm = job.replica_comm() if comm is None else comm
            directories = sorted({str(c.storage.directory) for c in tables if c.storage is not None
                                  and c.storage.directory is not None})
            topology = Topology.current(comm, directories)
        r = num_replicas or topology.world_size
        memory, disk = topology.memory(), topology.disk()
        names = [c.name for c in tables]
        unknown = sorted(set(self.constraints) - set(names))
        if unknown:
            raise ValueError(f"EmbeddingShardingPlanner: constraints for unknown tables {unknown}")
        fixed = dict(fixed or {})
        free_m, free_d, load = list(memory), list(disk), [0.0] * r
        out: dict[str, TablePlan] = {}
        estimates = {c.name: _Estimate(c, self.constraints.get(c.name), self.batch_size, r) for c in tables}

        def place(c: EmbeddingConfig, sharding: ParameterSharding, reason: str) -> None:
            est = estimates[c.name]
            m, d = est.storage(sharding)
            for k in range(r):
                if m[k] > free_m[k] or d[k] > free_d[k]:
                    raise ValueError(f"EmbeddingShardingPlanner: table {c.name!r} placed {sharding.sharding_type.value} "
                                     f"needs {_bytes(m[k])} of memory and {_bytes(d[k])} of disk on replica {k}, which "
                                     f"has {_bytes(free_m[k])} and {_bytes(free_d[k])} left; give the planner a "
                                     f"Topology with more, put tables on disk (DiskStorage) or split them row-wise")
                free_m[k] -= m[k]
                free_d[k] -= d[k]
            loads = est.loads(sharding)
            for k in range(r):
                load[k] += loads[k]
            out[c.name] = TablePlan(c.name, c.shape, sharding, reason, m, d, est.ids, est.load, loads)

        def least_loaded(c, ranks) -> int:
            est = estimates[c.name]
            best = None
            for k in ranks:
                m, d = est.storage(ParameterSharding(ShardingType.TABLE_WISE, (k,)))
                if m[k] <= free_m[k] and d[k] <= free_d[k] and (best is None or load[k] < load[best]):
                    best = k
            if best is None:
                raise ValueError(f"EmbeddingShardingPlanner: table {c.name!r} fits on none of the replicas "
                                 f"{list(ranks)} whole (it needs {_bytes(est.storage_full()[0])} of memory)")
            return best

        def est_types(c):  # the sharding types a constraint allows, if one was given
            constraint = self.constraints.get(c.name)
            return None if constraint is None or constraint.sharding_types is None else constraint.sharding_types

        # 1. fixed placements
        rest = []
        for c in tables:
            allowed = estimates[c.name].allowed
            given = fixed.get(c.name)
            if given is None and len(allowed) == 1:
                ranks = estimates[c.name].ranks
                given = ParameterSharding(allowed[0], (ranks[0],) if ranks and len(ranks) == 1 else None)
            if given is None:
                rest.append(c)
                continue
            if est_types(c) is not None and given.sharding_type not in est_types(c):
                raise ValueError(f"EmbeddingShardingPlanner: table {c.name!r}: placement "
                                 f"{given.sharding_type.value} is not among its constraint's "
                                 f"{[t.value for t in allowed]}")
            if given.sharding_type is ShardingType.DATA_PARALLEL and c.storage is not None:
                raise ValueError(f"EmbeddingShardingPlanner: table {c.name!r}: a disk table (storage=DiskStorage) "
                                 f"cannot be data-parallel")
            if given.sharding_type is ShardingType.TABLE_WISE and given.ranks is None:
                given = ParameterSharding(ShardingType.TABLE_WISE,
                                          (least_loaded(c, estimates[c.name].ranks or range(r)),))
            place(c, given.check(r, f"table {c.name!r}"), "fixed (plan or constraint)")
        # 2. small tables replicated, when all are small
        def small(c) -> bool:
            est = estimates[c.name]
            full = est.storage_full()
            return ShardingType.DATA_PARALLEL in est.allowed and c.storage is None and \
                full[0] <= self.data_parallel_max_bytes
        big = list(rest)
        if r > 1 and rest and all(small(c) for c in rest) and \
                all(sum(estimates[c.name].storage_full()[0] for c in rest) <= f for f in free_m):
            for c in rest:
                full = estimates[c.name].storage_full()[0]
                place(c, ParameterSharding(ShardingType.DATA_PARALLEL, tuple(range(r))),
                      f"small ({_bytes(full)}) as every table")
            big = []
        # 3. table-wise while balanced, 4. else row-wise (5. column-wise when it is all that is allowed)
        share = (sum(load) + r * sum(estimates[c.name].load for c in big)) / r
        stored = sum(estimates[c.name].storage_full()[0] + estimates[c.name].storage_full()[1] for c in big) / r
        waiting = sorted(big, key=lambda c: (-estimates[c.name].load, -sum(estimates[c.name].storage_full()),
                                             names.index(c.name)))
        for i, c in enumerate(waiting):
            est = estimates[c.name]
            whole = None
            if r > 1 and ShardingType.TABLE_WISE in est.allowed:
                # room for the table whole, and enough left over all replicas for the tables still waiting
                later = [est_w.storage(ParameterSharding(ShardingType.ROW_WISE, tuple(range(r))))
                         for est_w in (estimates[w.name] for w in waiting[i + 1:])]
                needed = (sum(sum(x[0]) for x in later), sum(sum(x[1]) for x in later))
                fits = []
                for k in (est.ranks or range(r)):
                    m, d = est.storage(ParameterSharding(ShardingType.TABLE_WISE, (k,)))
                    if m[k] <= free_m[k] and d[k] <= free_d[k]:
                        fits.append(k)
                if fits:
                    whole = min(fits, key=lambda j: (load[j], j))
                    m, d = est.storage(ParameterSharding(ShardingType.TABLE_WISE, (whole,)))
                    room = sum(free_m) - m[whole] >= needed[0] and sum(free_d) - d[whole] >= needed[1]
                    balanced = load[whole] + r * est.load <= self.balance * share and \
                        sum(est.storage_full()) <= self.balance * stored and room
                    split_fits = all(a <= f for a, f in zip(est.storage(
                        ParameterSharding(ShardingType.ROW_WISE, tuple(range(r))))[0], free_m))
                    if balanced or ShardingType.ROW_WISE not in est.allowed or not split_fits:
                        place(c, ParameterSharding(ShardingType.TABLE_WISE, (whole,)),
                              "whole: least-loaded replica with room" if balanced else "whole: would not fit split")
                        continue
            kind = ShardingType.ROW_WISE if ShardingType.ROW_WISE in est.allowed else ShardingType.COLUMN_WISE
            why = "split: above one replica's share" if r > 1 else "one replica"
            if kind is ShardingType.COLUMN_WISE:
                why = "the only placement allowed"
            place(c, ParameterSharding(kind, tuple(range(r))), why)
        ordered = {name: out[name] for name in names}
        return ShardingPlan({name: t.sharding for name, t in ordered.items()}, r, ordered, (memory, disk))


class _Estimate:
    """One table's storage and load estimates for the planner."""

    def __init__(self, config: EmbeddingConfig, constraint: ParameterConstraints | None, batch_size: int, r: int):
        self.config, self.r = config, r
        c = constraint or ParameterConstraints()
        allowed = c.sharding_types or (ShardingType.DATA_PARALLEL, ShardingType.TABLE_WISE, ShardingType.ROW_WISE)
        if config.storage is not None:  # a disk table is never replicated
            allowed = tuple(t for t in allowed if t is not ShardingType.DATA_PARALLEL) or (ShardingType.ROW_WISE,)
        if config.spec.id_limits.limited:  # ID limits hold per owner: row-wise and table-wise tables
            allowed = tuple(t for t in allowed if t in (ShardingType.ROW_WISE, ShardingType.TABLE_WISE)) \
                or (ShardingType.ROW_WISE,)
        self.allowed = tuple(t for t in _ORDER if t in allowed)
        self.ranks = c.ranks
        bags = c.batch_size or batch_size
        factors = c.pooling_factors or (1.0,) * len(config.feature_names)
        self.ids = float(bags * sum(factors))
        t, e = config.shape
        spec = config.spec
        self.unique = t * (1 - math.exp(-self.ids / t)) if t else 0.0
        self.load = self.unique * (4 + e * spec.dtype.itemsize + 4 * e)

    def loads(self, sharding: ParameterSharding) -> list[float]:
        """The load each replica carries for the table: table-wise, its replica serves
        every replica's IDs; row- and column-wise, each replica a share; data-parallel,
        each replica sums every replica's gradients."""
        r, kind = self.r, sharding.sharding_type
        if kind is ShardingType.TABLE_WISE:
            return [self.load * r if k in sharding.ranks else 0.0 for k in range(r)]
        return [self.load] * r

    def row_bytes(self, width: int) -> int:
        """Bytes per stored row of ``width`` columns: master weights, serving copy,
        optimizer slots (the replicated ones are not per row)."""
        spec = self.config.spec
        n = width * spec.master_dtype.itemsize
        if spec.master_dtype != spec.dtype:
            n += width * spec.dtype.itemsize
        if spec.trainable:
            for slot, array in spec.optimizer_spec.init_state((1, width)).items():
                if array.shape in ((1, width), (1,)):
                    n += array.nbytes
        return n

    def storage_full(self) -> tuple[int, int]:
        """``(memory, disk)`` of the whole table."""
        t, e = self.config.shape
        if self.config.storage is not None:
            return int(self.config.storage.cache_bytes) + 4 * t, t * self.row_bytes(e)
        return t * self.row_bytes(e), 0

    def storage(self, sharding: ParameterSharding) -> tuple[list, list]:
        """Bytes of memory and disk per replica under ``sharding``."""
        r = self.r
        t, e = self.config.shape
        kind = sharding.sharding_type
        rows, width = t, e
        if kind is ShardingType.ROW_WISE:
            rows = -(-t // r)
        elif kind is ShardingType.COLUMN_WISE:
            width = -(-e // r)
        per = rows * self.row_bytes(width)
        if self.config.storage is not None:
            mem, dsk = int(self.config.storage.cache_bytes) + 4 * rows, per
        else:
            mem, dsk = per, 0
        holders = sharding.ranks if kind is ShardingType.TABLE_WISE else range(r)
        return [mem if k in holders else 0 for k in range(r)], [dsk if k in holders else 0 for k in range(r)]
