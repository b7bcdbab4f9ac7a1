"""Enforcing a table's ID limits around one exchange: the check, the error, ID
dropping and minibatching (the seed ``sparsecore-minibatching.txt``, "How it works").

Used by :class:`~popdist_lite.embedding.HostEmbedding` for tables created with limits;
it wraps a single-pass lookup or update of either exchange (sparse or dense), so
everything below holds for both.

One call (lookup or update), on every replica:

1. **Check** (``limits.check`` phase). Count this replica's IDs and unique IDs per owner
   (:func:`.partitions.partition_counts`) and exchange them in one ``Allgather`` of
   ``(14 + 2r) x 8`` bytes per replica (the call-signature check every collective
   makes, :func:`popdist_lite.collectives.fingerprint.agree`, with the counts as payload).
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
   d. the masks are OR-reduced across replicas (one ``Allgather`` of 5 int64 per
      replica, OR-ed locally; it also carries any partition where one bucket alone
      exceeds a limit, which no split can fix).

   How the load per bucket is measured: the limits hold per ``(sender, owner)``
   partition, so the load a node is compared with is the *largest partition load*
   over every sender and owner, ``max_{s,o} sum_{b in node} load[s, o, b]``. The
   sender knows its partitions exactly, and ``max over senders`` then ``> limit`` is
   the OR over senders of ``> limit``, so combining the loads across replicas (the
   seed's step 3) and OR-ing the masks (its step 5) are the same single reduction of
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
OR-ed mask, identical on every replica, so every replica issues the same collectives.
"""

from __future__ import annotations

from time import perf_counter
from typing import Callable

import numpy as np

from ... import counters
from ...collectives.fingerprint import EXTRA, PAYLOAD, agree
from . import stats as id_stats
from .partitions import exceeded_message, keep_mask, partition_counts
from .settings import IdLimitError, IdLimits
from .minibatch_split import NUM_BUCKETS, bucket_of, minibatch_of_bucket, split_mask

#: Deduplicate with a bitmap (O(t + n)) rather than a sort when t <= this x n.
BITMAP_FACTOR = 64
_BUCKET_ADVICE = ("one hash bucket alone exceeds the limit, which minibatching cannot split. Set "
                  "allow_id_dropping=True or raise the limit; nothing was looked up or updated")


class Limiter:
    """Applies a table's :class:`.settings.IdLimits` around its single-pass exchange.

    Args:
        name: table name (messages, statistics).
        num_tokens: ``t``.
        comm: the replica communicator.
        limits: the table's limits.
        table_code: the table's CRC, compared across replicas in the check.
    """

    def __init__(self, name: str, num_tokens: int, comm, limits: IdLimits, table_code: int):
        self.name, self.t, self.comm, self.limits = name, num_tokens, comm, limits
        self.r, self.k = comm.size, comm.rank
        self.table_code = table_code
        self._seen: np.ndarray | None = None  # bitmap scratch for deduplication (all False between calls)

    # -- public: wrap one lookup / update ------------------------------------------------
    def lookup(self, flat: np.ndarray, problem, once: Callable) -> np.ndarray:
        """``once(flat, problem) -> (n, e)`` rows, under the limits. Returns ``(n, e)``."""
        plan = self._plan("lookup", flat, problem)
        if plan is None:
            return once(flat, problem)
        stats, parts = plan
        out = None
        for sel in parts:  # minibatches (or the one kept set), in order
            sub = flat if sel is None else flat[sel]
            keep = self._keep(sub, stats)
            rows = once(sub if keep is None else sub[keep], None)
            if out is None:
                out = np.zeros((flat.size, rows.shape[1]), dtype=rows.dtype)
            if sel is None and keep is None:
                out = rows
            elif sel is None:
                out[keep] = rows
            elif keep is None:
                out[sel] = rows
            else:
                out[sel[keep]] = rows
        id_stats.publish(stats)
        return out

    def update(self, flat: np.ndarray, grads, problem, once: Callable) -> None:
        """``once(flat, grads, problem)`` (checks, exchanges and applies), under the limits."""
        plan = self._plan("update", flat, problem)
        if plan is None:
            once(flat, grads, problem)
            return
        stats, parts = plan
        for sel in parts:
            sub_flat, sub_grads = (flat, grads) if sel is None else (flat[sel], grads[sel])
            keep = self._keep(sub_flat, stats)
            if keep is not None:
                sub_flat, sub_grads = sub_flat[keep], sub_grads[keep]
            once(sub_flat, sub_grads, None)
        id_stats.publish(stats)

    # -- planning ------------------------------------------------------------------------
    def _plan(self, op: str, flat: np.ndarray, problem):
        """``None`` (run once, unchanged, after publishing stats), or ``(stats, parts)``:
        ``parts`` lists index arrays (a minibatch each) or ``[None]`` (the whole call), and
        ``stats["_check"]`` says whether each part must be checked for dropping."""
        start = perf_counter()
        r, lim = self.r, self.limits
        payload = np.zeros(1 + 2 * r, dtype=np.int64)
        unique = None
        if problem is not None or (flat.size and (flat.min() < 0 or flat.max() >= self.t)):
            payload[0] = 1  # let the exchange report it on every replica
        else:
            seen = None
            if self.t <= BITMAP_FACTOR * flat.size:
                if self._seen is None:
                    self._seen = np.zeros(self.t, dtype=bool)
                seen = self._seen
            ids, uniq, unique = partition_counts(flat, r, seen)
            payload[1:1 + r], payload[1 + r:] = ids, uniq
        table = agree("embedding_limits", None, self.comm, extra=self.table_code, payload=payload)
        n_bytes = table.shape[1] * 8 * (r - 1)
        counters.record("limits.check", start, n_bytes, n_bytes, kind=counters.PHASE, detail=self.name)
        other = np.flatnonzero(table[:, EXTRA] != self.table_code)
        if other.size:
            raise RuntimeError(f"host embedding {self.name!r}: replica {int(other[0])} called "
                               f"embedding_{op} on a different table at the same point; every replica "
                               f"must look up and update the same tables in the same order")
        if table[:, PAYLOAD].any():
            return None
        ids = table[:, PAYLOAD + 1:PAYLOAD + 1 + r]
        uniq = table[:, PAYLOAD + 1 + r:]
        stats = self._stats(op, ids, uniq)
        over = self._over(ids, uniq)
        if not over:
            id_stats.publish(stats)
            return None
        if lim.enable_minibatching:
            return stats, self._minibatches(flat, unique, stats)
        if lim.allow_id_dropping:
            stats["_check"] = True
            return stats, [None]
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

    def _keep(self, sub: np.ndarray, stats: dict):
        """Positions of ``sub`` kept by the limits when this part must be checked, else None.
        Local: the plan already knows (from agreed data) that every replica drops here."""
        if not stats.get("_check"):
            return None
        keep = keep_mask(sub, self.r, self.limits)
        dropped = int(sub.size - np.count_nonzero(keep))
        stats["dropped_ids"] += dropped
        return keep if dropped else None

    def _minibatches(self, flat: np.ndarray, unique: np.ndarray, stats: dict) -> list[np.ndarray]:
        start = perf_counter()
        r, lim = self.r, self.limits
        owner = flat % r
        bucket = bucket_of(flat)
        ids_load = np.bincount(owner * NUM_BUCKETS + bucket, minlength=r * NUM_BUCKETS).reshape(r, NUM_BUCKETS)
        uniq_load = np.bincount((unique % r) * NUM_BUCKETS + bucket_of(unique),
                                minlength=r * NUM_BUCKETS).reshape(r, NUM_BUCKETS)
        mine = np.zeros(5, dtype=np.int64)
        for col, load, limit in ((1, ids_load, lim.max_ids_per_partition),
                                 (3, uniq_load, lim.max_unique_ids_per_partition)):
            if limit is None:
                continue
            mine[0] |= split_mask(load, limit)
            worst = np.unravel_index(int(np.argmax(load)), load.shape)
            if load[worst] > limit:  # one bucket alone is over the limit
                mine[col], mine[col + 1] = load[worst], worst[0]
        gathered = np.empty((r, 5), dtype=np.int64)
        t0 = perf_counter()
        self.comm.Allgather(mine, gathered)
        counters.record("all_gather", t0, mine.nbytes * (r - 1), mine.nbytes * (r - 1))
        mask = int(np.bitwise_or.reduce(gathered[:, 0]))
        if gathered[:, (1, 3)].any():
            if not lim.allow_id_dropping:
                ids_over = np.zeros((r, r), dtype=np.int64)
                uniq_over = np.zeros((r, r), dtype=np.int64)
                ids_over[np.arange(r), gathered[:, 2]] = gathered[:, 1]
                uniq_over[np.arange(r), gathered[:, 4]] = gathered[:, 3]
                raise IdLimitError(f"host embedding {self.name!r}: " + exceeded_message(
                    self.name, ids_over, uniq_over, lim, where=" in one hash bucket", advice=_BUCKET_ADVICE))
            stats["_check"] = True
        of = minibatch_of_bucket(mask)[bucket]
        count = int(bin(mask).count("1")) + 1
        order = np.argsort(of, kind="stable")
        bounds = np.searchsorted(of[order], np.arange(count + 1))
        stats["num_minibatches"] = count
        stats["split_mask"] = mask
        counters.record("limits.split", start, kind=counters.PHASE, detail=self.name)
        return [order[bounds[m]:bounds[m + 1]] for m in range(count)]
