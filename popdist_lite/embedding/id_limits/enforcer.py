"""Enforcing a table's ID limits around one exchange: the check, the error, ID
dropping and minibatching (the SparseCore minibatching guide, "How it works").

Used by :class:`~popdist_lite.embedding.HostEmbedding` for tables created with limits;
it wraps a single-pass lookup or update of either exchange (sparse or dense), so
everything below holds for both.

One call (lookup or update), on every replica:

1. **Check** (``limits.check`` phase). Count this replica's IDs and unique IDs per owner
   (:func:`.partitions.partition_counts`) and exchange them in one ``Allgather`` of
   ``(14 + 1 + 2r) x 8`` bytes per replica (the call signature,
   :func:`popdist_lite.collectives.agreement.agree`, with the counts as payload).
   Every replica then holds the whole ``(sender, owner)`` count matrix: the logical OR
   of "this replica needs minibatching" is ``(counts > limit).any()``, and the error
   message and the statistics come from the same matrix. When no partition exceeds a
   limit, this small collective is the whole cost; the exchange then runs once.
   A bad input anywhere (out-of-range index, wrong dtype) skips the limits and lets the
   exchange raise its usual error on every replica.
2. **Exceeded, minibatching off**: :class:`.settings.IdLimitError` on every replica
   (naming the table, the worst partition, the observed count and the limit), or with
   ``allow_id_dropping`` the positions chosen by :func:`.partitions.keep_mask` are dropped
   (rows of zeros, gradients ignored) and the exchange runs once on the rest.
3. **Exceeded, minibatching on** (``limits.split`` phase):

   a. every ID goes to bucket ``splitmix64(id) & 63`` (:mod:`.minibatch_split`);
   b. this replica's loads per ``(owner, bucket)`` are counted, with and without
      duplicates, so per partition of its own;
   c. the tree split (:func:`.minibatch_split.split_mask`) over the 64 buckets runs on
      those ``r x 64`` loads, splitting a node when *any* of this replica's
      partitions would exceed the limit there;
   d. the masks are OR-reduced across replicas (the call signature with 5
      int64 of payload per replica, OR-ed locally; it also carries any partition where
      one bucket alone exceeds a limit, which no split can fix).

   How the load per bucket is measured: the limits hold per ``(sender, owner)``
   partition, so the load a node is compared with is the *largest partition load*
   over every sender and owner, ``max_{s,o} sum_{b in node} load[s, o, b]``. The
   sender knows its partitions exactly, and ``max over senders`` then ``> limit`` is
   the OR over senders of ``> limit``, so combining the loads across replicas (the
   guide's step 3) and OR-ing the masks (its step 5) are the same single reduction of
   the per-node decisions. (Summing loads over senders, as SparseCore sums them over
   hosts feeding one device, would over-split here: different senders fill
   different partitions.)
   e. the minibatches (runs of buckets between set bits) run one after another: a
      lookup fills its rows minibatch by minibatch, an update applies the optimizer
      per minibatch. Each ID is in exactly one bucket, hence one minibatch, so the
      result equals one pass (SGD rows are updated once, with the same sum).

   One bucket over a limit raises :class:`.settings.IdLimitError` before anything moves
   unless ``allow_id_dropping``, in which case each minibatch is checked and dropped
   as in step 2.

Collective safety: every branch depends only on the agreed count matrix and the
OR-ed mask, identical on every replica (the :class:`Plan`), so every replica issues the
same collectives.
"""

from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING, Callable

import numpy as np

from ... import counters
from ...collectives import Problem, agree, register_op
from ..bitmap import Bitmap
from . import stats as id_stats
from .minibatch_split import NUM_BUCKETS, bucket_of, minibatch_of_bucket, split_mask
from .partitions import exceeded_message, keep_mask, partition_counts
from .settings import IdLimitError

if TYPE_CHECKING:
    from ..table_spec import TableSpec

register_op("embedding_limits")        # the check: every replica's counts per partition
register_op("embedding_limits_split")  # the minibatch split: every replica's split mask
#: The check counts unique IDs with a bitmap (O(t + n)) rather than a sort while the
#: table has at most this many rows per ID of the call.
COUNTS_BITMAP_MAX_ROWS_PER_ID = 64
_BUCKET_ADVICE = ("one hash bucket alone exceeds the limit, which minibatching cannot split. Set "
                  "allow_id_dropping=True or raise the limit; nothing was looked up or updated")


@dataclass
class Plan:
    """How one call runs under the limits. Decided from agreed data only, so it is the
    same on every replica and every replica issues the same collectives.

    Attributes:
        stats: the call's statistics record (:mod:`.stats`), published when the call ends.
        parts: the positions of each minibatch in the call's indices, in order, or
            ``[None]``: the whole call in one part.
        drop: whether each part first drops the positions beyond the limits
            (:func:`.partitions.keep_mask`).
    """

    stats: dict
    parts: list
    drop: bool = False


class IdLimitEnforcer:
    """Keeps the lookups and updates of one table within its :class:`.settings.IdLimits`,
    around its single-pass exchange.

    Args:
        spec: the table's spec (name, ``t``, limits, code).
        comm: the replica communicator.
    """

    def __init__(self, spec: "TableSpec", comm):
        self.spec, self.name, self.t, self.limits = spec, spec.name, spec.shape[0], spec.id_limits
        self.comm, self.r = comm, comm.size
        self._bitmap: Bitmap | None = None

    # -- one lookup / update ----------------------------------------------------------------
    def lookup(self, flat: np.ndarray, problem: Problem | None, once: Callable) -> np.ndarray:
        """``once(flat, problem) -> (n, e)`` rows, under the limits. Returns ``(n, e)``."""
        plan = self.plan("lookup", flat, problem)
        if plan is None:
            return once(flat, problem)
        out = None
        for where in self._positions(plan, flat):
            rows = once(flat if where is None else flat[where], None)
            if where is None:
                out = rows
                continue
            if out is None:
                out = np.zeros((flat.size, rows.shape[1]), dtype=rows.dtype)
            out[where] = rows
        id_stats.publish(plan.stats)
        return out

    def update(self, flat: np.ndarray, grads, problem: Problem | None, once: Callable) -> None:
        """``once(flat, grads, problem)`` (checks, exchanges and applies), under the limits."""
        plan = self.plan("update", flat, problem)
        if plan is None:
            once(flat, grads, problem)
            return
        for where in self._positions(plan, flat):
            if where is None:
                once(flat, grads, None)
            else:
                once(flat[where], grads[where], None)
        id_stats.publish(plan.stats)

    def _positions(self, plan: Plan, flat: np.ndarray):
        """Each part's positions in ``flat`` after dropping (``None``: all of ``flat``).
        Local: the plan already knows (from agreed data) whether every replica drops."""
        for part in plan.parts:
            keep = None
            if plan.drop:
                sub = flat if part is None else flat[part]
                mask = keep_mask(sub, self.r, self.limits)
                dropped = int(sub.size - np.count_nonzero(mask))
                plan.stats["dropped_ids"] += dropped
                keep = mask if dropped else None
            if keep is None:
                yield part
            else:
                yield np.flatnonzero(keep) if part is None else part[keep]

    # -- planning ---------------------------------------------------------------------------
    def plan(self, op: str, flat: np.ndarray, problem: Problem | None) -> Plan | None:
        """The check (collective): ``None`` when the call runs once, unchanged (its stats
        already published, or a bad input that the exchange reports on every replica),
        else the :class:`Plan`.

        Raises:
            IdLimitError: on every replica, when a limit is exceeded and neither
                minibatching nor dropping may handle it.
            RuntimeError: replicas called this at the same point for different tables.
        """
        start = perf_counter()
        r, lim = self.r, self.limits
        payload = np.zeros(1 + 2 * r, dtype=np.int64)
        unique = None
        if problem is not None or (flat.size and (flat.min() < 0 or flat.max() >= self.t)):
            payload[0] = 1  # let the exchange report it on every replica
        else:
            bitmap = None
            if self.t <= COUNTS_BITMAP_MAX_ROWS_PER_ID * flat.size:
                if self._bitmap is None:
                    self._bitmap = Bitmap(self.t)
                bitmap = self._bitmap
            ids, uniq, unique = partition_counts(flat, r, bitmap)
            payload[1:1 + r], payload[1 + r:] = ids, uniq
        signatures = agree("embedding_limits", None, self.comm, extra=self.spec.code, payload=payload)
        n_bytes = signatures.itemsize * (r - 1)
        counters.record("limits.check", start, n_bytes, n_bytes, kind=counters.PHASE, detail=self.name)
        self.spec.require_same_table(signatures["extra"], op)
        counts = signatures["payload"]
        if counts[:, 0].any():
            return None
        ids, uniq = counts[:, 1:1 + r], counts[:, 1 + r:]
        stats = self._stats(op, ids, uniq)
        if not self._over(ids, uniq):
            id_stats.publish(stats)
            return None
        if lim.enable_minibatching:
            return self._minibatches(flat, unique, stats)
        if lim.allow_id_dropping:
            return Plan(stats, [None], drop=True)
        raise IdLimitError(f"host embedding {self.name!r}: " + exceeded_message(self.name, ids, uniq, lim))

    def _over(self, ids: np.ndarray, uniq: np.ndarray) -> bool:
        lim = self.limits
        return bool((lim.max_ids_per_partition is not None and ids.max() > lim.max_ids_per_partition)
                    or (lim.max_unique_ids_per_partition is not None
                        and uniq.max() > lim.max_unique_ids_per_partition))

    def _stats(self, op: str, ids: np.ndarray, uniq: np.ndarray) -> dict:
        i, u = np.unravel_index(int(np.argmax(ids)), ids.shape), np.unravel_index(int(np.argmax(uniq)), uniq.shape)
        return {"table": self.name, "op": op, "max_ids_per_partition": int(ids[i]),
                "max_unique_ids_per_partition": int(uniq[u]), "max_ids_partition": [int(i[0]), int(i[1])],
                "max_unique_ids_partition": [int(u[0]), int(u[1])], "num_minibatches": 1, "dropped_ids": 0}

    def _minibatches(self, flat: np.ndarray, unique: np.ndarray, stats: dict) -> Plan:
        """The minibatch split (collective: the masks are OR-ed across replicas)."""
        start = perf_counter()
        r, lim = self.r, self.limits
        owner = flat % r
        bucket = bucket_of(flat)
        ids_load = np.bincount(owner * NUM_BUCKETS + bucket, minlength=r * NUM_BUCKETS).reshape(r, NUM_BUCKETS)
        uniq_load = np.bincount((unique % r) * NUM_BUCKETS + bucket_of(unique),
                                minlength=r * NUM_BUCKETS).reshape(r, NUM_BUCKETS)
        mine = np.zeros(5, dtype=np.int64)  # mask, then (load, owner) of a bucket alone over each limit
        for col, load, limit in ((1, ids_load, lim.max_ids_per_partition),
                                 (3, uniq_load, lim.max_unique_ids_per_partition)):
            if limit is None:
                continue
            mine[0] |= split_mask(load, limit)
            worst = np.unravel_index(int(np.argmax(load)), load.shape)
            if load[worst] > limit:  # one bucket alone is over the limit
                mine[col], mine[col + 1] = load[worst], worst[0]
        signatures = agree("embedding_limits_split", None, self.comm, extra=self.spec.code, payload=mine)
        gathered = signatures["payload"]
        mask = int(np.bitwise_or.reduce(gathered[:, 0]))
        drop = False
        if gathered[:, (1, 3)].any():
            if not lim.allow_id_dropping:
                ids_over = np.zeros((r, r), dtype=np.int64)
                uniq_over = np.zeros((r, r), dtype=np.int64)
                ids_over[np.arange(r), gathered[:, 2]] = gathered[:, 1]
                uniq_over[np.arange(r), gathered[:, 4]] = gathered[:, 3]
                raise IdLimitError(f"host embedding {self.name!r}: " + exceeded_message(
                    self.name, ids_over, uniq_over, lim, where=" in one hash bucket", advice=_BUCKET_ADVICE))
            drop = True
        of = minibatch_of_bucket(mask)[bucket]
        count = int(bin(mask).count("1")) + 1
        order = np.argsort(of, kind="stable")
        bounds = np.searchsorted(of[order], np.arange(count + 1))
        stats["num_minibatches"] = count
        stats["split_mask"] = mask
        counters.record("limits.split", start, kind=counters.PHASE, detail=self.name)
        return Plan(stats, [order[bounds[m]:bounds[m + 1]] for m in range(count)], drop=drop)
