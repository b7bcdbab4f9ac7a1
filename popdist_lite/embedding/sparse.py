"""Sparse exchange for TOKEN tables: deduplicated IDs go to their owner only.

The TF-IPU host-embedding guide's TOKEN lookup (section 15.3.1, :class:`.exchange.DenseExchange`)
all-gathers every replica's indices and reduce-scatters an
``r x N x e`` tensor that is mostly zeros. This exchange is the one TorchRec (row-wise
sharding: "input dist" all-to-all of lengths then IDs, optional ID deduplication,
output all-to-all) and SparseCore (IDs partitioned by owner, deduplicated per
partition) use. Placement is unchanged (row ``i`` on replica ``i % r`` at local row
``i // r``), so a table can switch exchange without moving data.

Lookup, on replica ``k`` with ``n`` indices of which ``u`` are distinct:

1. ``lookup.route``: deduplicate the indices into ``u`` unique ones plus the inverse
   map, grouped by owner, and count how many go to each owner. Three ways, all
   ``O(n)`` but the last: a bitmap over the key space when the table is small (at most
   ``BITMAP_MAX_KEYS_PER_INDEX * n`` rows, :mod:`.bitmap`); else a *position array* (one int32 per table row, kept
   between calls, never cleared: ``slot[i] = position`` for every index, then the
   positions that read their own number back are one per distinct index, as in
   hash-free deduplication on GPUs), while that array fits ``POSITION_BYTES_MAX`` or the
   local shard's size; else a sort of the keys ``(i % r) * ceil(t/r) + i // r``
   (the costs of the three: docs/performance.md).
2. ``lookup.header``: one ``Allgather`` of a small header per replica (the call signature
   every checked collective exchanges,
   :func:`popdist_lite.collectives.agreement.agree`, plus a bad-index flag, the first bad
   value and the ``r`` send counts): ``(14 + 2 + r) x 8`` bytes per replica. Every
   replica learns every replica's counts, and an out-of-range index anywhere raises
   :class:`IndexError` on every replica before any data moves.
3. ``lookup.ids``: ``Alltoallv`` of the unique local rows (int32) to their owners.
4. ``lookup.gather``: each owner gathers the requested rows of its shard.
5. ``lookup.rows``: ``Alltoallv`` of the rows back (``u x e`` per replica).
6. ``lookup.expand``: the inverse map expands ``u`` rows to ``n``.

Update (TorchRec's EXACT_SGD: duplicates coalesced, then one step per row):

1. ``update.route`` and ``update.header`` as above, plus the runs of equal indices: a
   stable radix sort of the deduplicated numbers (:func:`._segment.runs_of`), or a sort
   of the keys where there is no position array.
2. ``update.coalesce``: sum the gradients of duplicate indices locally (segment sum).
3. ``update.exchange``: ``Alltoallv`` of the unique local rows and of their summed
   gradients to the owners.
4. ``update.sum``: each owner sums what it received per row (segment sum again, as
   several replicas may send the same row) and returns ``(rows, sums)`` for the
   optimizer, which applies one step per row.

Bytes per replica and step: header ``O(r)``, IDs ``4u``, rows ``u * e * itemsize``
each way, against ``8 N_total`` plus ``N_total * e * itemsize`` for the dense
exchange (``N_total`` = all replicas' indices). Scratch arrays are reused between steps.
"""

from __future__ import annotations

from time import perf_counter

import numpy as np

from .. import counters
from ..collectives.all_to_all import exchange_rows
from ..collectives import Problem, agree, register_op
from ._buffers import Buffers, aligned_empty
from ._segment import group, inverse_of, runs_of, sum_groups
from .bitmap import Bitmap
from .table_spec import TableSpec

register_op("embedding_lookup")
register_op("embedding_update")
#: A lookup deduplicates its indices with a bitmap (O(t + n)) while the key space is at
#: most this many keys per index.
BITMAP_MAX_KEYS_PER_INDEX = 16
#: Else use a position array (``4 t`` bytes per replica, kept between calls) when it
#: takes at most this many bytes, or no more than the local shard; else sort.
POSITION_BYTES_MAX = 64 << 20
_BAD, _BAD_VALUE, _COUNTS = 0, 1, 2  # payload fields


class SparseTokenExchange:
    """The sparse exchange of one TOKEN table (implements :class:`.exchange.Exchange`).

    Args:
        spec: the table's spec (its name for error messages; its code is compared across
            replicas so that replicas exchanging different tables at the same point fail
            loudly).
        comm: the replica communicator.
    """

    def __init__(self, spec: TableSpec, comm):
        num_tokens, encoding = spec.shape
        self.spec, self.name, self.t, self.e, self.comm = spec, spec.name, num_tokens, encoding, comm
        self.r, self.k = comm.size, comm.rank
        self.rows = -(-num_tokens // self.r)  # local rows per replica, ceil(t/r)
        self.space = self.rows * self.r        # key space
        self.id_dtype = np.dtype(np.int32 if self.rows < 2 ** 31 else np.int64)
        self.edges = np.arange(self.r + 1, dtype=np.int64) * self.rows
        self.table_code = spec.code
        self._codes = np.full(self.r, self.table_code, dtype=np.int64).tobytes()
        self.buffers = Buffers()
        self._bitmap: Bitmap | None = None
        self.use_slots = 4 * num_tokens <= max(POSITION_BYTES_MAX, self.rows * encoding * 4)
        self._slot: np.ndarray | None = None   # position array (stale values never read)
        self._iota = np.arange(0, dtype=np.int32)
        self.shift = self.r.bit_length() - 1 if self.r & (self.r - 1) == 0 else None
        # numpy's stable argsort is a radix sort for 8- and 16-bit integers
        self.owner_dtype = np.int8 if self.r < 2 ** 7 else np.int16 if self.r < 2 ** 15 else np.int32

    def reserve(self, capacity: int, dtype) -> None:
        """Allocate the buffers for ``capacity`` unique IDs per partition (``r * capacity``
        per direction) of a table of lookup ``dtype``, once: a call within the limits
        never grows them."""
        n, e = self.r * capacity, self.e
        acc = np.float32 if dtype == np.float16 else dtype
        for name, shape, kind in (("ids", n, self.id_dtype), ("wanted", n, self.id_dtype),
                                  ("found", (n, e), dtype), ("rows", (n, e), dtype),
                                  ("their_ids", n, self.id_dtype), ("their_sums", (n, e), acc)):
            self.buffers.get(name, shape, kind)

    # -- routing ------------------------------------------------------------------------
    def _keys(self, flat: np.ndarray) -> np.ndarray:
        if self.r == 1:
            return flat
        local, owner = np.divmod(flat, self.r)
        owner *= self.rows
        owner += local
        return owner

    def _unique_slots(self, flat: np.ndarray):
        """Deduplicate with the position array: ``(ids, inverse, counts)`` where ``ids``
        are the distinct indices' local rows grouped by owner (in owner order; any order
        within an owner), ``inverse`` maps each index to its position in ``ids`` and
        ``counts[j]`` is how many go to owner ``j``. No sort of ``n`` values, and two
        random passes over the position array (the rest stays within ``O(n)`` scratch).
        """
        n = flat.size
        if self._slot is None:
            self._slot = np.empty(self.t, dtype=np.int32)
        if self._iota.size < n:
            self._iota = np.arange(max(n, 2 * self._iota.size), dtype=np.int32)
        slot, iota = self._slot, self._iota[:n]
        slot[flat] = iota  # for a repeated index one of its positions stays ...
        first = slot.take(flat, out=self.buffers.get("first", n, np.int32), mode="clip")  # ... and
        # every occurrence reads that position back (n-sized temporaries live in reused
        # buffers: fresh pages cost a fault each; mode="clip": no buffering, ids are checked)
        chosen = (first == iota).nonzero()[0]  # one position per distinct index
        distinct = flat[chosen]
        if self.r == 1:
            local, counts = distinct, [distinct.size]
        else:
            if self.shift is not None:  # r a power of two: no integer division
                owner, local = distinct & (self.r - 1), distinct >> self.shift
            else:
                local, owner = np.divmod(distinct, self.r)
            order = owner.astype(self.owner_dtype).argsort(kind="stable")
            chosen, local = chosen[order], local[order]  # grouped by owner (radix sort)
            counts = np.bincount(owner, minlength=self.r)
        compact = self.buffers.get("compact", n, np.intp)  # intp: np.take's own index type
        compact[chosen] = iota[:chosen.size]
        inverse = compact.take(first, out=self.buffers.get("inverse", n, np.intp), mode="clip")
        return local.astype(self.id_dtype, copy=False), inverse, counts

    def _route(self, op: str, flat: np.ndarray, problem: Problem | None, need_groups: bool):
        """Deduplicate, agree on the header, raise on every replica for any problem.

        Returns ``(ids, inverse_or_None, perm, starts, send_counts, recv_counts)``, counts as lists:
        ``ids``, the distinct indices' local rows (``id_dtype``) grouped by owner;
        ``inverse`` (lookups) or ``perm``/``starts`` as :func:`group` gives them (updates:
        ``flat[perm]`` runs through the distinct indices in the order of ``ids``).
        """
        start = perf_counter()
        n = flat.size
        payload = np.zeros(2 + self.r, dtype=np.int64)
        ids = inverse = perm = starts = None
        if problem is None and n:
            # flat is int64 (HostEmbedding._prepare): one pass, as unsigned a negative index exceeds any table
            if flat.view(np.uint64).max() >= self.t:
                payload[_BAD] = 1
                payload[_BAD_VALUE] = flat[np.argmax((flat < 0) | (flat >= self.t))]
        if problem is None and not payload[_BAD]:
            small = self.space <= BITMAP_MAX_KEYS_PER_INDEX * max(n, 1)
            if self.use_slots and (need_groups or not small):
                ids, inverse, payload[_COUNTS:] = self._unique_slots(flat)
                if need_groups:  # updates: the runs of equal indices, by their number
                    perm, starts = runs_of(inverse, ids.size)
                    inverse = None
            else:
                keys = self._keys(flat)
                if need_groups or not small:
                    unique, perm, starts = group(keys)
                    if not need_groups:
                        inverse = inverse_of(perm, starts)
                else:
                    if self._bitmap is None:
                        self._bitmap = Bitmap(self.space)
                    unique, inverse = self._bitmap.unique_inverse(keys)
                payload[_COUNTS:] = np.diff(np.searchsorted(unique, self.edges))
                ids = self._local_rows(unique, "ids")
        counters.record(f"{op}.route", start, kind=counters.PHASE, detail=self.name)
        start = perf_counter()
        signatures = agree("embedding_" + op, None, self.comm, problem=problem, extra=self.table_code,
                           payload=payload)
        header = signatures["payload"]
        n_bytes = signatures.itemsize * (self.r - 1)
        counters.record(f"{op}.header", start, n_bytes, n_bytes, kind=counters.PHASE, detail=self.name)
        self._check(op, signatures["extra"], header)
        send_counts = header[self.k, _COUNTS:].tolist()
        recv_counts = header[:, _COUNTS + self.k].tolist()
        return ids, inverse, perm, starts, send_counts, recv_counts

    def _check(self, op: str, codes: np.ndarray, header: np.ndarray) -> None:
        if not np.count_nonzero(header[:, _BAD]) and codes.tobytes() == self._codes:
            return  # the common case: no bad index and the same table everywhere
        self.spec.require_same_table(codes, op)
        bad = np.flatnonzero(header[:, _BAD])
        if bad.size:
            r = int(bad[0])
            raise IndexError(f"host embedding {self.name!r}: replica {r} passed index "
                             f"{int(header[r, _BAD_VALUE])}, expected indices in [0, {self.t}) (pass "
                             f"clip_indices=True to clip instead); nothing was looked up or updated")

    def _local_rows(self, unique: np.ndarray, name: str) -> np.ndarray:
        out = self.buffers.get(name, unique.size, self.id_dtype)
        np.remainder(unique, self.rows, out=out, casting="unsafe")
        return out

    # -- lookup -------------------------------------------------------------------------
    def lookup(self, shard: np.ndarray, flat: np.ndarray, problem: Problem | None = None) -> np.ndarray:
        """:meth:`.exchange.Exchange.lookup` (``shard``: the ``(ceil(t/r), e)`` TOKEN
        shard; returns a new array)."""
        ids, inverse, _, _, send_counts, recv_counts = self._route("lookup", flat, problem, False)
        e, b, k, comm = self.e, self.buffers, self.k, self.comm
        # This replica's own IDs stay here: gathered straight into their place in `rows`.
        at = sum(send_counts[:k])
        mine = slice(at, at + send_counts[k])
        theirs = sum(recv_counts[:k])
        before, after = slice(0, theirs), slice(theirs + recv_counts[k], sum(recv_counts))
        start = perf_counter()
        wanted = exchange_rows(ids, send_counts, recv_counts, comm, skip_self=True,
                               out=b.get("wanted", after.stop, self.id_dtype))
        self._phase("lookup.ids", start, send_counts, recv_counts, ids.itemsize)
        start = perf_counter()
        found = b.get("found", (after.stop, e), shard.dtype)
        rows = b.get("rows", (ids.size, e), shard.dtype)
        # mode="clip": no buffering (the ids were checked); the own segment of `wanted`
        # and `found` is never written nor read
        for part in (before, after):
            if part.start < part.stop:
                shard.take(wanted[part], axis=0, out=found[part], mode="clip")
        shard.take(ids[mine], axis=0, out=rows[mine], mode="clip")
        counters.record("lookup.gather", start, kind=counters.PHASE, detail=self.name)
        start = perf_counter()
        exchange_rows(found, recv_counts, send_counts, comm, out=rows, skip_self=True)
        self._phase("lookup.rows", start, recv_counts, send_counts, e * found.itemsize)
        start = perf_counter()
        out = aligned_empty((flat.size, e), shard.dtype)  # a new array, which DLPack consumers can share
        if flat.size:
            rows.take(inverse, axis=0, mode="clip", out=out)
        counters.record("lookup.expand", start, kind=counters.PHASE, detail=self.name)
        return out

    # -- update -------------------------------------------------------------------------
    def gradient_sums(self, flat: np.ndarray, grads: np.ndarray | None, problem: Problem | None = None,
                      trainable: bool = True):
        """:meth:`.exchange.Exchange.gradient_sums` (``rows`` sorted; ``sums`` float32 for
        float16 tables, else the table dtype)."""
        ids, _, perm, starts, send_counts, recv_counts = self._route("update", flat, problem, True)
        if not trainable:
            return None
        acc = np.float32 if grads.dtype == np.float16 else grads.dtype
        start = perf_counter()
        sums = sum_groups(grads, perm, starts, dtype=acc)
        counters.record("update.coalesce", start, kind=counters.PHASE, detail=self.name)
        start = perf_counter()
        b, e = self.buffers, self.e
        n_in = sum(recv_counts)
        their_ids = exchange_rows(ids, send_counts, recv_counts, self.comm, out=b.get("their_ids", n_in, self.id_dtype))
        their_sums = exchange_rows(sums, send_counts, recv_counts, self.comm, out=b.get("their_sums", (n_in, e), acc))
        self._phase("update.exchange", start, send_counts, recv_counts, ids.itemsize + e * sums.itemsize)
        start = perf_counter()
        rows, perm, starts = group(their_ids)
        total = sum_groups(their_sums, perm, starts)
        counters.record("update.sum", start, kind=counters.PHASE, detail=self.name)
        return rows.astype(np.intp), total

    def _phase(self, name: str, start: float, send_counts, recv_counts, row_bytes: int) -> None:
        """Record a phase whose exchanges moved rows of ``row_bytes`` (payload bytes
        without this replica's own part, as the collective counters)."""
        k = self.k
        sent = (sum(send_counts) - send_counts[k]) * row_bytes
        received = (sum(recv_counts) - recv_counts[k]) * row_bytes
        counters.record(name, start, sent, received, kind=counters.PHASE, detail=self.name)
