"""Enforcing the ID limits of a collection's tables around its one exchange: the check,
the error, ID dropping and minibatching for every limited table of a call at once
(the one-table case is :mod:`.enforcer`, whose rules this follows).

A collection with limited tables (row-wise or table-wise placements) checks them once
per call, before its exchange:

1. **Check** (``limits.check`` phase): this replica counts, for every limited table,
   its IDs and unique IDs per owner (row-wise: ``id % r``; table-wise: the table's
   replica) and every replica gets every count in one agreement
   (``(14 + 1 + 2 L r) x 8`` bytes per replica for ``L`` limited tables). When no
   partition exceeds its table's limits this is the whole cost.
2. **Exceeded**: a table that may neither drop nor minibatch raises
   :class:`.settings.IdLimitError` on every replica (naming the table, the worst
   partition, the count and the limit) before anything moves; a table with
   ``allow_id_dropping`` drops, on each replica, the positions
   :func:`.partitions.keep_mask` chooses (rows of zeros, gradients ignored).
3. **Minibatching** (``limits.split`` phase): for every exceeding table with
   ``enable_minibatching``, the tree split of its 64 hash buckets
   (:func:`.minibatch_split.split_mask`) on this replica's loads, the masks of all
   those tables OR-ed across replicas in one more agreement; the call then runs in as
   many passes as the table with the most minibatches has: pass ``p`` carries
   minibatch ``p`` of each such table and, in the first pass, every other ID. Each ID is
   in exactly one minibatch, so the lookups equal one pass; an update applies the
   optimizer once per pass (SparseCore's minibatching).

Every branch depends only on agreed counts and masks, so every replica issues the same
collectives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from time import perf_counter

import numpy as np

from ... import counters
from ...collectives import agree, register_op
from . import stats as id_stats
from .minibatch_split import NUM_BUCKETS, bucket_of, minibatch_of_bucket, split_mask
from .partitions import exceeded_message, keep_mask
from .settings import IdLimitError

register_op("collection_limits")        # every replica's counts per limited table and partition
register_op("collection_limits_split")  # every minibatching table's split mask
_ADVICE = ("one hash bucket alone exceeds the limit, which minibatching cannot split. Set allow_id_dropping=True "
           "or raise the limit; nothing was looked up or updated")


@dataclass
class LimitedTable:
    """A limited table of a collection: its name, limits, and where its IDs go
    (``owner``: the replica of a table-wise table, ``None`` row-wise)."""

    index: int
    name: str
    limits: object
    owner: int | None


@dataclass
class LimitPlan:
    """How one call runs: ``passes`` (the positions of the call's IDs each pass
    carries, in order; one pass of ``None``: all of them) and ``dropped`` (positions
    dropped), from agreed data only."""

    passes: list = field(default_factory=lambda: [None])
    dropped: np.ndarray | None = None


class BatchLimits:
    """The ID limits of a collection's limited tables.

    Args:
        tables: the :class:`LimitedTable` s.
        comm: the replica communicator.
        name: the collection's name (counters, errors).
        code: the collection's code (replicas checking other collections fail loudly).
    """

    def __init__(self, tables: list, comm, name: str, code: int):
        self.tables, self.comm, self.name, self.code = tables, comm, name, code
        self.r = comm.size

    def _owners(self, table: LimitedTable, ids: np.ndarray) -> np.ndarray:
        return ids % self.r if table.owner is None else np.full(ids.size, table.owner, np.int64)

    def plan(self, op: str, ids: np.ndarray | None, positions: dict) -> LimitPlan | None:
        """The check (collective): ``None`` when the call runs in one pass unchanged,
        else the :class:`LimitPlan`.

        Args:
            op: ``"lookup"`` or ``"update"`` (the statistics' name).
            ids: this replica's IDs of the call (raw, per table), or ``None`` when its
                input is bad (the exchange reports it; nothing is limited then).
            positions: table index -> the positions of its IDs in ``ids``.

        Raises:
            IdLimitError: on every replica, when a limit is exceeded and neither
                minibatching nor dropping may handle it.
            RuntimeError: replicas checking other collections at the same point.
        """
        start = perf_counter()
        r, tables = self.r, self.tables
        payload = np.zeros(1 + 2 * r * len(tables), np.int64)
        if ids is None:
            payload[0] = 1
        else:
            for i, t in enumerate(tables):
                mine = ids[positions[t.index]]
                owners = self._owners(t, mine)
                unique = np.unique(mine)
                at = 1 + 2 * r * i
                payload[at:at + r] = np.bincount(owners, minlength=r)
                payload[at + r:at + 2 * r] = np.bincount(self._owners(t, unique), minlength=r)
        signatures = agree("collection_limits", None, self.comm, extra=self.code, payload=payload)
        n_bytes = signatures.itemsize * (r - 1)
        counters.record("limits.check", start, n_bytes, n_bytes, kind=counters.PHASE, detail=self.name)
        codes = signatures["extra"]
        if (codes != self.code).any():
            j = int(np.flatnonzero(codes != self.code)[0])
            raise RuntimeError(f"{self.name}: replica {j} checked the ID limits of other tables at the same point; "
                               f"every replica must look up and update the same collections in the same order")
        gathered = signatures["payload"]
        if gathered[:, 0].any():
            return None
        plan, splitting = LimitPlan(), []
        for i, t in enumerate(tables):
            at = 1 + 2 * r * i
            counts, uniq = gathered[:, at:at + r], gathered[:, at + r:at + 2 * r]
            record = _stats(t.name, op, counts, uniq)
            lim = t.limits
            over = (lim.max_ids_per_partition is not None and counts.max() > lim.max_ids_per_partition) or \
                (lim.max_unique_ids_per_partition is not None and uniq.max() > lim.max_unique_ids_per_partition)
            if over and lim.enable_minibatching:
                splitting.append((t, record))
                continue
            if over and not lim.allow_id_dropping:
                raise IdLimitError(f"{self.name}: table {t.name!r}: " + exceeded_message(t.name, counts, uniq, lim))
            if over:
                mine = ids[positions[t.index]]
                keep = keep_mask(mine, r if t.owner is None else 1, lim)
                dropped = positions[t.index][~keep]
                record["dropped_ids"] = int(dropped.size)
                plan.dropped = dropped if plan.dropped is None else np.concatenate([plan.dropped, dropped])
            id_stats.publish(record)
        if splitting:
            self._split(ids, positions, splitting, plan)
        if plan.dropped is None and plan.passes == [None]:
            return None
        return plan

    def _split(self, ids: np.ndarray, positions: dict, splitting: list, plan: LimitPlan) -> None:
        """Minibatches of the exceeding tables (collective: their masks are OR-ed)."""
        start = perf_counter()
        r = self.r
        mine = np.zeros(5 * len(splitting), np.int64)  # per table: mask, then (load, owner) of a bucket over each limit
        buckets = []
        for i, (t, _) in enumerate(splitting):
            values = ids[positions[t.index]]
            owner = self._owners(t, values)
            bucket = bucket_of(values)
            unique = np.unique(values)
            loads = (np.bincount(owner * NUM_BUCKETS + bucket, minlength=r * NUM_BUCKETS).reshape(r, NUM_BUCKETS),
                     np.bincount(self._owners(t, unique) * NUM_BUCKETS + bucket_of(unique),
                                 minlength=r * NUM_BUCKETS).reshape(r, NUM_BUCKETS))
            lim = t.limits
            for col, load, limit in ((1, loads[0], lim.max_ids_per_partition),
                                     (3, loads[1], lim.max_unique_ids_per_partition)):
                if limit is None:
                    continue
                mine[5 * i] |= split_mask(load, limit)
                worst = np.unravel_index(int(np.argmax(load)), load.shape)
                if load[worst] > limit:
                    mine[5 * i + col], mine[5 * i + col + 1] = load[worst], worst[0]
            buckets.append(bucket)
        signatures = agree("collection_limits_split", None, self.comm, extra=self.code, payload=mine)
        gathered = signatures["payload"].reshape(r, len(splitting), 5)
        of = {}
        count = 1
        for i, (t, record) in enumerate(splitting):
            mask = int(np.bitwise_or.reduce(gathered[:, i, 0]))
            if gathered[:, i, (1, 3)].any():
                if not t.limits.allow_id_dropping:
                    ids_over, uniq_over = np.zeros((r, r), np.int64), np.zeros((r, r), np.int64)
                    ids_over[np.arange(r), gathered[:, i, 2]] = gathered[:, i, 1]
                    uniq_over[np.arange(r), gathered[:, i, 4]] = gathered[:, i, 3]
                    raise IdLimitError(f"{self.name}: table {t.name!r}: " + exceeded_message(
                        t.name, ids_over, uniq_over, t.limits, where=" in one hash bucket", advice=_ADVICE))
            of[t.index] = minibatch_of_bucket(mask)[buckets[i]]
            record["num_minibatches"] = int(bin(mask).count("1")) + 1
            record["split_mask"] = mask
            count = max(count, record["num_minibatches"])
            id_stats.publish(record)
        n = ids.size
        pass_of = np.zeros(n, np.intp)
        for t, _ in splitting:
            pass_of[positions[t.index]] = of[t.index]
        keep = np.ones(n, bool)
        if plan.dropped is not None:
            keep[plan.dropped] = False
        plan.passes = [np.flatnonzero((pass_of == p) & keep) for p in range(count)]
        counters.record("limits.split", start, kind=counters.PHASE, detail=self.name)


def _stats(name: str, op: str, ids: np.ndarray, uniq: np.ndarray) -> dict:
    i, u = np.unravel_index(int(np.argmax(ids)), ids.shape), np.unravel_index(int(np.argmax(uniq)), uniq.shape)
    return {"table": name, "op": op, "max_ids_per_partition": int(ids[i]),
            "max_unique_ids_per_partition": int(uniq[u]), "max_ids_partition": [int(i[0]), int(i[1])],
            "max_unique_ids_partition": [int(u[0]), int(u[1])], "num_minibatches": 1, "dropped_ids": 0}
