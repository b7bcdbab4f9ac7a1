"""The sparse exchange: deduplicated IDs go to the replicas that hold their rows, for
any number of tables at once, in one agreement and one all-to-all per kind of data.

The TF-IPU host-embedding guide's TOKEN lookup (section 15.3.1, :class:`.exchange.DenseExchange`)
all-gathers every replica's indices and reduce-scatters an ``r x N x e`` tensor that
is mostly zeros. This exchange is the one TorchRec (input dist: an all-to-all of
lengths then IDs, optional ID deduplication; output dist: an all-to-all of rows) and
SparseCore (IDs partitioned by owner, deduplicated per partition) use, for a whole
collection of tables: the tables are grouped into *stacks* (tables of one width, dtype,
optimizer and storage, one array per replica, as FBGEMM's table-batched embeddings
stack them), and one call moves the IDs, rows and gradients of every stack in the same
collectives, so a step's collective count does not grow with the number of tables.
A :class:`~popdist_lite.HostEmbedding` with the sparse exchange is the one-table case
(:class:`SparseTokenExchange`).

Stacks and their IDs (an ID of table ``i`` becomes a *stack ID* ``g`` in
``[0, space)``: ``g = r * offset_i + id`` for a row-wise table, ``first_i + id`` for
the others):

- ``routed`` (row-wise and table-wise tables): each distinct ID goes to the replica
  holding its row: row-wise ``g % r`` at local row ``g // r`` (the TOKEN strategy,
  rows padded to a multiple of ``r`` per table), table-wise the table's replica;
- ``column`` (column-wise tables): each distinct ID goes to every replica, which
  returns its ``c = ceil(e/r)`` columns of the row (the ENCODING strategy, deduplicated);
- ``replicated`` (data-parallel tables): lookups read this replica's copy; updates
  send each distinct ID's summed gradient to every replica, which all sum them in
  replica order and apply the same step (a sparse all-reduce).

Lookup, on replica ``k`` with ``n`` IDs of a stack of which ``u`` are distinct:

1. ``lookup.route``: per stack, deduplicate the IDs into ``u`` unique ones plus the
   inverse map, grouped by destination, and count how many go to each destination.
   Three ways, all ``O(n)`` but the last: a bitmap over the key space when the stack is
   small (at most ``BITMAP_MAX_KEYS_PER_INDEX * n`` keys, :mod:`.bitmap`); else a
   *position array* (one int32 per stack ID, kept between calls, never cleared:
   ``slot[g] = position`` for every ID, then the positions that read their own number
   back are one per distinct ID, as in hash-free deduplication on GPUs), while that
   array fits ``POSITION_BYTES_MAX`` or the local shard's size; else a sort of the keys
   ``owner_base[owner] + local`` (the costs of the three: docs/performance.md).
2. ``lookup.header``: one ``Allgather`` of a small header per replica (the call
   signature every checked collective exchanges,
   :func:`popdist_lite.collectives.agreement.agree`, plus a bad-index flag, its table
   and value, and the ``r`` send counts of all stacks together): ``(14 + 4 + r) x 8``
   bytes per replica, whatever the number of tables. Every replica learns every
   replica's counts, and an out-of-range index anywhere raises :class:`IndexError` on
   every replica before any data moves.
3. ``lookup.ids``: one ``Alltoallv`` of the unique IDs as the destination's *message
   keys* (its local row plus the stack's first key on that replica), stack after stack
   for each destination: the destination splits them by stack with a binary search.
4. ``lookup.gather``: each replica gathers the requested rows (column-wise: its columns)
   of each stack.
5. ``lookup.rows``: one ``Alltoallv`` of the rows back, stack after stack (one typed
   buffer for one stack; bytes, each stack's part 8-byte aligned, for several).
6. The caller expands (or pools) the unique rows with the inverse map.

Update (TorchRec's EXACT_SGD: duplicates coalesced, then one step per row):

1. ``update.route`` and ``update.header`` as above, plus the runs of equal IDs: a
   stable radix sort of the deduplicated numbers (:func:`._segment.runs_of`), or a sort
   of the keys where there is no position array.
2. ``update.coalesce``: sum the gradients of duplicate IDs locally (segment sum).
3. ``update.exchange``: one ``Alltoallv`` of the unique IDs and one of their summed
   gradients (float32 for float16 tables), stack after stack.
4. ``update.sum``: each replica sums what it received per row (segment sum again, as
   several replicas may send the same row) and returns ``(rows, sums)`` per stack for
   the optimizer, which applies one step per row.

With the lookup's context (:meth:`SparseExchange.lookup` with ``keep=True``, the path
of an update in backward) the IDs are not sent again: the update is one agreement and
one all-to-all of gradients.

Bytes per replica and step: header ``O(r)``, IDs ``4u``, rows ``u * e * itemsize``
each way, against ``8 N_total`` plus ``N_total * e * itemsize`` for the dense
exchange (``N_total`` = all replicas' indices). Scratch arrays are reused between steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from time import perf_counter

import numpy as np

from .. import counters
from ..collectives import Problem, agree, register_op
from ..collectives.all_to_all import exchange_rows
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
ROUTED, COLUMN, REPLICATED = "routed", "column", "replicated"
_BAD, _BAD_TABLE, _BAD_VALUE, _SEQ, _COUNTS = 0, 1, 2, 3, 4  # header payload fields
_ALIGN = 8


@dataclass
class Route:
    """One stack's IDs of one call on the requesting replica.

    Attributes:
        values: the unique IDs as sent: ``routed``, the destination's local rows grouped
            by destination (replica order); else the unique stack IDs (sent to every
            replica).
        counts: how many of them go to each replica (``routed``: per owner; else ``u``
            each, or 0 each for a replicated stack's lookup).
        inverse: each ID's position among the unique ones (lookups), or ``None``.
        perm, starts: the runs of equal IDs (:func:`._segment.group`'s form; updates).
        u: the number of unique IDs.
    """

    values: np.ndarray
    counts: list
    inverse: np.ndarray | None = None
    perm: np.ndarray | None = None
    starts: np.ndarray | None = None

    @property
    def u(self) -> int:
        return int(self.values.size)


class StackRouter:
    """Deduplicates one stack's IDs of a call and groups them by destination.

    Args:
        kind: ``ROUTED``, ``COLUMN`` or ``REPLICATED`` (module docstring).
        space: the stack IDs are in ``[0, space)``.
        num_replicas, replica: ``r`` and ``k``.
        row_wise_rows: ``ROUTED``: local rows per replica of the row-wise tables (stack
            IDs below ``r * row_wise_rows`` are theirs: replica ``g % r``, row ``g // r``).
        single: ``ROUTED``: the table-wise tables, ``(first stack ID, rows, replica,
            first local row there)`` each, by first stack ID (after the row-wise IDs).
        rows_on: ``ROUTED``: the stack's local rows on every replica.
        shard_bytes: this replica's shard in bytes (the position array may take as much).
        id_dtype: the dtype of the IDs as sent.
    """

    def __init__(self, kind: str, space: int, num_replicas: int, replica: int, *, row_wise_rows: int = 0,
                 single=(), rows_on=None, shard_bytes: int = 0, id_dtype=np.int32):
        self.kind, self.space, self.r, self.k = kind, int(space), num_replicas, replica
        self.rows, self.rw_space = int(row_wise_rows), int(row_wise_rows) * num_replicas
        self.single = [tuple(int(x) for x in s) for s in single]
        self.id_dtype = np.dtype(id_dtype)
        r = num_replicas
        if kind == ROUTED:
            rows_on = [int(x) for x in (rows_on if rows_on is not None else [self.rows] * r)]
            self.edges = np.zeros(r + 1, np.int64)
            self.edges[1:] = np.cumsum(rows_on)  # keys: owner-major, owner o's rows at edges[o]...
            self.key_space = int(self.edges[-1])
            if self.single:
                s = np.array(self.single, np.int64).reshape(-1, 4)
                self._first, self._owner, self._local = s[:, 0], s[:, 2], s[:, 3]
        else:
            self.key_space = self.space
        self.use_slots = 4 * self.space <= max(POSITION_BYTES_MAX, shard_bytes)
        self.buffers = Buffers()
        self._bitmap: Bitmap | None = None
        self._slot: np.ndarray | None = None   # position array (stale values never read)
        self._iota = np.arange(0, dtype=np.int32)
        self.shift = r.bit_length() - 1 if r & (r - 1) == 0 else None
        # numpy's stable argsort is a radix sort for 8- and 16-bit integers
        self.owner_dtype = np.int8 if r < 2 ** 7 else np.int16 if r < 2 ** 15 else np.int32

    # -- where a stack ID's row lives ---------------------------------------------------------
    def locate(self, gid: np.ndarray):
        """``(owner, local row there)`` of stack IDs (``ROUTED``)."""
        r = self.r
        if not self.single:
            if r == 1:
                return np.zeros(gid.size, np.intp), gid
            if self.shift is not None:  # r a power of two: no integer division
                return gid & (r - 1), gid >> self.shift
            local, owner = np.divmod(gid, r)
            return owner, local
        rw = gid < self.rw_space
        local, owner = np.divmod(gid, r)
        tw = np.flatnonzero(~rw)
        if tw.size:
            g = gid[tw]
            j = np.searchsorted(self._first, g, side="right") - 1
            owner[tw] = self._owner[j]
            local[tw] = self._local[j] + g - self._first[j]
        return owner, local

    def _keys(self, gid: np.ndarray) -> np.ndarray:
        """Owner-major keys: ``edges[owner] + local`` (sorted keys are grouped by owner)."""
        if self.r == 1:
            return gid if not self.single else self.locate(gid)[1]
        owner, local = self.locate(gid)
        if not self.single:  # edges[owner] = owner * rows
            owner *= self.rows
            owner += local
            return owner
        return self.edges[owner] + local

    # -- deduplication --------------------------------------------------------------------------
    def route(self, gid: np.ndarray, need_groups: bool, send: bool = True) -> Route:
        """Deduplicate ``gid`` (C-contiguous int64 stack IDs, all valid) and group them by
        destination. ``need_groups``: return the runs of equal IDs (updates) instead of
        the inverse map; ``send``: a replicated stack's IDs go to every replica (else,
        a lookup, to none)."""
        n = gid.size
        small = self.key_space <= BITMAP_MAX_KEYS_PER_INDEX * max(n, 1)
        routed = self.kind == ROUTED
        inverse = perm = starts = None
        if self.use_slots and (need_groups or not small):
            values, inverse, counts = self._unique_slots(gid, routed)
            if need_groups:  # updates: the runs of equal indices, by their number
                perm, starts = runs_of(inverse, values.size)
                inverse = None
        else:
            keys = self._keys(gid) if routed else gid
            if need_groups or not small:
                unique, perm, starts = group(keys)
                if not need_groups:
                    inverse = inverse_of(perm, starts)
                    perm = starts = None
            else:
                if self._bitmap is None:
                    self._bitmap = Bitmap(self.key_space)
                unique, inverse = self._bitmap.unique_inverse(keys)
            if routed:
                counts = np.diff(np.searchsorted(unique, self.edges)).tolist()
                values = self._local_rows(unique, counts)
            else:
                values, counts = unique, None
        if not routed:
            values = values.astype(self.id_dtype, copy=False)
            counts = [values.size if (send or self.kind == COLUMN) else 0] * self.r
        return Route(values, counts, inverse, perm, starts)

    def _local_rows(self, unique: np.ndarray, counts) -> np.ndarray:
        """The owners' local rows of sorted owner-major keys."""
        out = self.buffers.get("ids", unique.size, self.id_dtype)
        if not self.single:
            np.remainder(unique, max(self.rows, 1), out=out, casting="unsafe")
        else:
            np.subtract(unique, np.repeat(self.edges[:-1], counts), out=out, casting="unsafe")
        return out

    def _unique_slots(self, gid: np.ndarray, routed: bool):
        """Deduplicate with the position array: ``(values, inverse, counts)`` where
        ``values`` are the distinct IDs (``routed``: their local rows, grouped by owner in
        owner order, any order within an owner), ``inverse`` maps each ID to its
        position in ``values`` and ``counts[j]`` is how many go to owner ``j``. No sort
        of ``n`` values, and two random passes over the position array (the rest stays
        within ``O(n)`` scratch)."""
        n = gid.size
        if self._slot is None:
            self._slot = np.empty(self.space, dtype=np.int32)
        if self._iota.size < n:
            self._iota = np.arange(max(n, 2 * self._iota.size), dtype=np.int32)
        slot, iota = self._slot, self._iota[:n]
        slot[gid] = iota  # for a repeated index one of its positions stays ...
        first = slot.take(gid, out=self.buffers.get("first", n, np.int32), mode="clip")  # ... and
        # every occurrence reads that position back (n-sized temporaries live in reused
        # buffers: fresh pages cost a fault each; mode="clip": no buffering, ids are checked)
        chosen = (first == iota).nonzero()[0]  # one position per distinct index
        distinct = gid[chosen]
        counts = None
        if not routed:
            local = distinct
        elif self.r == 1:
            local, counts = (distinct if not self.single else self.locate(distinct)[1]), [distinct.size]
        else:
            owner, local = self.locate(distinct)
            order = owner.astype(self.owner_dtype).argsort(kind="stable")
            chosen, local = chosen[order], local[order]  # grouped by owner (radix sort)
            counts = np.bincount(owner, minlength=self.r).tolist()
        compact = self.buffers.get("compact", n, np.intp)  # intp: np.take's own index type
        compact[chosen] = iota[:chosen.size]
        inverse = compact.take(first, out=self.buffers.get("inverse", n, np.intp), mode="clip")
        return local.astype(self.id_dtype, copy=False), inverse, counts


@dataclass
class ExchangeStack:
    """What the exchange knows of one stack.

    Attributes:
        kind: ``ROUTED``, ``COLUMN`` or ``REPLICATED``.
        router: its :class:`StackRouter`.
        width: columns of a local row (``ceil(e/r)`` for ``COLUMN``).
        e: the tables' row width.
        dtype: the lookup dtype (rows travel in it).
        acc: the gradient sums' dtype (float32 for float16 tables).
        koff: ``int64[r]``: the stack's first message key on every replica.
        trainable: whether updates move its gradients.
    """

    kind: str
    router: StackRouter
    width: int
    e: int
    dtype: np.dtype
    acc: np.dtype
    koff: np.ndarray
    trainable: bool = True

    def row_bytes(self, what: str) -> int:
        """Bytes of one row of ``what`` (``"rows"`` served to lookups, ``"sums"`` of
        updates) this stack sends to one destination."""
        if what == "rows":
            return 0 if self.kind == REPLICATED else self.width * self.dtype.itemsize
        return (self.width if self.kind == COLUMN else self.e) * self.acc.itemsize


class _Layout:
    """Where each stack's part of a message to or from each peer lies: region ``(p, s)``
    holds ``counts[p][s]`` rows of ``row_bytes[s]`` bytes, regions in peer-major order,
    each 8-byte aligned when there are several stacks."""

    def __init__(self, counts: np.ndarray, row_bytes: np.ndarray, pad: bool):
        sizes = counts * row_bytes
        if pad:
            sizes = -(-sizes // _ALIGN) * _ALIGN
        self.counts, self.row_bytes = counts, row_bytes
        flat = np.zeros(sizes.size + 1, np.int64)
        np.cumsum(sizes.reshape(-1), out=flat[1:])
        self.offsets = flat[:-1].reshape(sizes.shape)
        self.peer_bytes = sizes.sum(axis=1).tolist()
        self.total = int(flat[-1])

    def rows_of(self, buf: np.ndarray, s: int, dtype, width: int) -> np.ndarray:
        """Stack ``s``'s rows from every peer, in peer order: a view when its regions
        follow one another (the other stacks have nothing there), else a copy."""
        counts, ends = self.counts[:, s], self.offsets[:, s] + self.counts[:, s] * self.row_bytes[s]
        if (self.offsets[1:, s] == ends[:-1]).all():
            start = int(self.offsets[0, s])
            n = int(counts.sum())
            return buf[start:start + n * width * np.dtype(dtype).itemsize].view(dtype).reshape(n, width)
        parts = [self.view(buf, p, s, dtype, width) for p in range(len(counts)) if counts[p]]
        return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros((0, width), dtype)

    def view(self, buf: np.ndarray, p: int, s: int, dtype, width: int) -> np.ndarray:
        """Region ``(p, s)`` of the byte buffer ``buf`` as ``(rows, width)`` of ``dtype``."""
        start, n = int(self.offsets[p, s]), int(self.counts[p, s])
        return buf[start:start + n * width * np.dtype(dtype).itemsize].view(dtype).reshape(n, width)


@dataclass
class Lookup:
    """What a lookup with ``keep=True`` keeps for its update (:meth:`SparseExchange.backward`).

    Attributes:
        seq: the lookup's number on its exchange (the update checks every replica
            applies the same lookup's gradients).
        routes: every stack's :class:`Route` (``None`` for a stack without IDs).
        their_ids: every stack's IDs received from each replica (own included), as
            ``(ids, counts per replica)``.
    """

    seq: int
    routes: list
    their_ids: list = field(default_factory=list)


class SparseExchange:
    """The sparse exchange of a set of stacks (module docstring).

    Args:
        stacks: the :class:`ExchangeStack` s, in message-key order (replicated and
            column-wise stacks first: their first keys are the same on every replica).
        comm: the replica communicator.
        name: names the tables in counters and errors.
        code: the tables' identity in the call signatures (replicas exchanging other
            tables at the same point fail loudly).
        bad_index: ``bad_index(replica, table, value) -> IndexError``, the error of an
            out-of-range ID (``table`` as the caller numbers them).
        other_tables: ``other_tables(codes, op) -> None``: raises ``RuntimeError`` when
            ``codes`` (every replica's) are not all ``code``.
    """

    def __init__(self, stacks: list, comm, name: str, code: int, bad_index, other_tables):
        self.stacks, self.comm, self.name, self.code = stacks, comm, name, code
        self.r, self.k = comm.size, comm.rank
        self.bad_index, self.other_tables = bad_index, other_tables
        self._codes = np.full(self.r, code, dtype=np.int64).tobytes()
        self.buffers = Buffers()
        self.id_dtype = np.result_type(*[s.router.id_dtype for s in stacks]) if stacks else np.dtype(np.int32)
        self.single = len(stacks) == 1 and stacks[0].kind == ROUTED  # the typed fast path
        self.seq = 0

    # -- header ---------------------------------------------------------------------------------
    def _header(self, op: str, routes: list, problem: Problem | None, bad, seq: int = 0, sending=None,
                what: str | None = None):
        """Agree on every replica's counts (and problems): ``(send_counts, recv_counts,
        counts matrix (r, S))`` with totals per destination; raises on every replica for
        any replica's problem or bad index, or replicas exchanging other tables."""
        start = perf_counter()
        r, k = self.r, self.k
        payload = np.zeros(_COUNTS + r, dtype=np.int64)
        per_stack = None  # this replica's counts per destination and stack (several stacks)
        if bad is not None:
            payload[_BAD], payload[_BAD_TABLE], payload[_BAD_VALUE] = 1, bad[0], bad[1]
        elif problem is None:
            if self.single:
                if routes[0] is not None and (sending is None or sending[0]):
                    payload[_COUNTS:] = routes[0].counts
            else:
                per_stack = np.zeros((r, len(self.stacks)), np.int64)
                for s, route in enumerate(routes):
                    if route is not None and (sending is None or sending[s]):
                        per_stack[:, s] = route.counts
                payload[_COUNTS:] = per_stack.sum(axis=1)
        if per_stack is None and not self.single:
            per_stack = np.zeros((r, len(self.stacks)), np.int64)
        payload[_SEQ] = seq
        signatures = agree("embedding_" + op, None, self.comm, problem=problem, extra=self.code, payload=payload,
                           what=what)
        header = signatures["payload"]
        n_bytes = signatures.itemsize * (r - 1)
        counters.record(f"{op}.header", start, n_bytes, n_bytes, kind=counters.PHASE, detail=self.name)
        codes = signatures["extra"]
        flags = header[:, :_COUNTS]  # bad, its table and value, the lookup's number: all 0 but the number
        wrong = (flags[:, :_SEQ].any() or (flags[:, _SEQ] != seq).any()) if seq else flags.any()
        if wrong or codes.tobytes() != self._codes:
            self.other_tables(codes, op)
            bad = np.flatnonzero(header[:, _BAD])
            if bad.size:
                j = int(bad[0])
                raise self.bad_index(j, int(header[j, _BAD_TABLE]), int(header[j, _BAD_VALUE]))
            j = int(np.flatnonzero(header[:, _SEQ] != header[0, _SEQ])[0])
            raise RuntimeError(f"{self.name}: replica {j} applies the gradients of lookup #{header[j, _SEQ]}, "
                               f"replica 0 of lookup #{header[0, _SEQ]}; every replica must update with the "
                               f"context of the same lookup")
        return header[k, _COUNTS:].tolist(), header[:, _COUNTS + k].tolist(), per_stack

    def route(self, op: str, gids: list, need_groups: bool = False, send: bool = True) -> list:
        """Every stack's :class:`Route` of this replica's stack IDs (``None`` where
        ``gids`` is). Local; recorded as the phase ``{op}.route``."""
        start = perf_counter()
        routes = [None if gid is None else s.router.route(gid, need_groups, send) for s, gid in zip(self.stacks, gids)]
        counters.record(f"{op}.route", start, kind=counters.PHASE, detail=self.name)
        return routes

    def _safe_route(self, op: str, gids: list, need_groups: bool, send: bool, problem, bad):
        """:meth:`route` when this replica's input is good; an unexpected error there
        becomes this replica's problem, raised on every replica by the header (never a
        replica alone while the others wait in it)."""
        if problem is not None or bad is not None:
            return [None] * len(self.stacks), problem
        try:
            return self.route(op, gids, need_groups, send), None
        except Exception as exc:  # noqa: BLE001 - raised on every replica by the agreement
            return [None] * len(self.stacks), Problem.of(exc)

    # -- the messages ---------------------------------------------------------------------------
    def _send_ids(self, routes: list, send_counts: list, sending) -> np.ndarray:
        """The IDs message: for each destination, each stack's IDs as message keys."""
        if self.single:
            return routes[0].values
        parts = []
        at = [np.cumsum([0] + (route.counts if route is not None else [0] * self.r)) for route in routes]
        for o in range(self.r):
            for s, (stack, route) in enumerate(zip(self.stacks, routes)):
                if route is None or not sending[s] or not route.counts[o]:
                    continue
                if stack.kind == ROUTED:
                    part = route.values[at[s][o]:at[s][o + 1]]
                    parts.append(part + self.id_dtype.type(stack.koff[o]) if stack.koff[o] else part)
                else:  # every replica: the same keys (these stacks' first keys are the same everywhere)
                    parts.append(route.values + self.id_dtype.type(stack.koff[o]) if stack.koff[o] else route.values)
        if not parts:
            return np.zeros(0, self.id_dtype)
        return np.concatenate(parts).astype(self.id_dtype, copy=False)

    def _split(self, wanted: np.ndarray, recv_counts: list, own=None) -> np.ndarray:
        """``(r, S + 1)`` boundaries of each stack's keys in each sender's part of
        ``wanted`` (each part holds its stacks' keys in stack order, and a stack's keys
        lie between its first key and the next stack's: a binary search finds them).
        ``own``: this replica's own counts per stack, when its part of ``wanted`` was
        never written."""
        r, k, koff = self.r, self.k, np.array([s.koff[self.k] for s in self.stacks], np.int64)
        bounds = np.zeros((r, len(self.stacks) + 1), np.int64)
        at = 0
        for j, n in enumerate(recv_counts):
            if j == k and own is not None:
                bounds[j, 1:] = np.cumsum(own)
            elif len(self.stacks) > 1:
                bounds[j, 1:-1] = np.searchsorted(wanted[at:at + n], koff[1:])
            bounds[j, -1] = n
            bounds[j] += at
            at += n
        return bounds

    # -- lookup -------------------------------------------------------------------------------------
    def lookup(self, serving: list, gids: list, problem: Problem | None = None, bad=None, keep: bool = False,
               what: str | None = None):
        """Every stack's unique rows of this replica's IDs. Collective.

        Args:
            serving: every stack's rows to gather from (``take``).
            gids: every stack's C-contiguous int64 stack IDs (``None``: none this call),
                all valid when ``problem`` and ``bad`` are ``None``.
            problem: this replica's own :class:`Problem`, raised on every replica.
            bad: ``(table, value)`` of this replica's first out-of-range ID, raised as
                ``bad_index`` on every replica.
            keep: keep what the update needs (:meth:`backward`); replicated stacks then
                send their IDs too.
            what: names the call in a replica's problem when raised.

        Returns:
            ``(rows, routes, context)``: per stack the ``(u, e)`` unique rows (a view
            of a reused buffer: copy or consume before the next call) or ``None``, the
            :class:`Route` s (their ``inverse`` maps IDs to rows), and a :class:`Lookup`
            (``keep``) or ``None``.

        Raises:
            IndexError: on every replica, for an index outside its table on any replica.
            TypeError, ValueError: on every replica, for any replica's ``problem``.
            RuntimeError: replicas exchanging other tables, or calls out of step.
        """
        routes, problem = self._safe_route("lookup", gids, False, keep, problem, bad)
        sending = [s.kind != REPLICATED or keep for s in self.stacks]
        # raises on every replica for any replica's problem: past it, every replica's input is good
        send_counts, recv_counts, per_stack = self._header("lookup", routes, problem, bad, sending=sending,
                                                           what=what)
        b, k, comm = self.buffers, self.k, self.comm
        # This replica's own IDs stay here: gathered straight into their place in `rows`.
        at = sum(send_counts[:k])
        mine = slice(at, at + send_counts[k])
        theirs = sum(recv_counts[:k])
        before, after = slice(0, theirs), slice(theirs + recv_counts[k], sum(recv_counts))
        start = perf_counter()
        send = self._send_ids(routes, send_counts, sending)
        wanted = np.empty(after.stop, self.id_dtype) if keep else b.get("wanted", after.stop, self.id_dtype)
        exchange_rows(send, send_counts, recv_counts, comm, skip_self=True, out=wanted)
        self._phase("lookup.ids", start, send_counts, recv_counts, self.id_dtype.itemsize)
        context = None
        if keep:
            wanted[theirs:theirs + recv_counts[k]] = send[mine]  # the own part too, for the update
            context = Lookup(self.seq, routes, self._their_ids(wanted, recv_counts))
            self.seq += 1
        if self.single:
            stack = self.stacks[0]
            e, dtype = stack.width, stack.dtype
            start = perf_counter()
            shard = serving[0]
            found = b.get("found", (after.stop, e), dtype)
            rows = b.get("rows", (sum(send_counts), e), dtype)
            # mode="clip": no buffering (the ids were checked); the own segment of `wanted`
            # and `found` is never written nor read
            for part in (before, after):
                if part.start < part.stop:
                    shard.take(wanted[part], axis=0, out=found[part], mode="clip")
            shard.take(send[mine], axis=0, out=rows[mine], mode="clip")
            counters.record("lookup.gather", start, kind=counters.PHASE, detail=self.name)
            start = perf_counter()
            exchange_rows(found, recv_counts, send_counts, comm, out=rows, skip_self=True)
            self._phase("lookup.rows", start, recv_counts, send_counts, e * found.itemsize)
            return [rows], routes, context
        return self._lookup_rows(serving, routes, wanted, recv_counts, per_stack), routes, context

    def _their_ids(self, wanted: np.ndarray, recv_counts: list) -> list:
        """Every stack's IDs received from each replica: ``(ids as local rows or stack
        IDs, counts per replica)``."""
        if self.single:
            return [(wanted, recv_counts)]
        bounds = self._split(wanted, recv_counts)
        out = []
        for s, stack in enumerate(self.stacks):
            counts = (bounds[:, s + 1] - bounds[:, s]).tolist()
            ids = np.concatenate([wanted[a:z] for a, z in zip(bounds[:, s], bounds[:, s + 1])]) if sum(counts) \
                else np.zeros(0, self.id_dtype)
            if stack.koff[self.k]:
                ids = ids - self.id_dtype.type(stack.koff[self.k])
            out.append((ids, counts))
        return out

    def _lookup_rows(self, serving, routes, wanted, recv_counts, per_stack) -> list:
        """The rows exchange of several stacks (byte buffers, one region per stack)."""
        r, k, stacks = self.r, self.k, self.stacks
        row_bytes = np.array([s.row_bytes("rows") for s in stacks], np.int64)
        start = perf_counter()
        bounds = self._split(wanted, recv_counts, own=per_stack[k])
        served = _Layout(np.diff(bounds, axis=1), row_bytes, pad=True)  # what each sender asked of me
        asked = _Layout(per_stack, row_bytes, pad=True)  # what I asked of each
        found = self.buffers.get("found", served.total, np.uint8)
        rows = self.buffers.get("rows", asked.total, np.uint8)
        for j in range(r):
            for s, stack in enumerate(stacks):
                n = int(bounds[j, s + 1] - bounds[j, s])
                if not n or not row_bytes[s] or j == k:
                    continue
                ids = wanted[bounds[j, s]:bounds[j, s + 1]]
                ids = ids - self.id_dtype.type(stack.koff[k]) if stack.koff[k] else ids
                serving[s].take(ids, axis=0, out=served.view(found, j, s, stack.dtype, stack.width), mode="clip")
        for s, (stack, route) in enumerate(zip(stacks, routes)):  # my own IDs: straight into their place
            if route is None or not row_bytes[s]:
                continue
            if stack.kind == ROUTED:
                first = sum(route.counts[:k])
                ids = route.values[first:first + route.counts[k]]
            else:
                ids = route.values
            if ids.size:
                serving[s].take(ids, axis=0, out=asked.view(rows, k, s, stack.dtype, stack.width), mode="clip")
        counters.record("lookup.gather", start, kind=counters.PHASE, detail=self.name)
        start = perf_counter()
        exchange_rows(found, served.peer_bytes, asked.peer_bytes, self.comm, out=rows, skip_self=True)
        self._phase("lookup.rows", start, served.peer_bytes, asked.peer_bytes, 1)
        start = perf_counter()
        out = []
        for s, (stack, route) in enumerate(zip(stacks, routes)):
            if route is None:
                out.append(None)
            elif stack.kind == REPLICATED:
                out.append(serving[s].take(route.values, axis=0, mode="clip"))
            elif stack.kind == ROUTED:
                out.append(asked.rows_of(rows, s, stack.dtype, stack.width))
            else:  # columns of every replica side by side, the padding sliced off
                full = np.empty((route.u, r * stack.width), stack.dtype)
                for o in range(r):
                    full[:, o * stack.width:(o + 1) * stack.width] = asked.view(rows, o, s, stack.dtype, stack.width)
                out.append(full[:, :stack.e])
        counters.record("lookup.assemble", start, kind=counters.PHASE, detail=self.name)
        return out

    # -- update -------------------------------------------------------------------------------------
    def gradient_sums(self, gids: list, grads: list, problem: Problem | None = None, bad=None) -> list:
        """Every stack's touched local rows and the sums of every replica's gradients
        for each. Collective.

        Args:
            gids: as :meth:`lookup`.
            grads: every stack's C-contiguous ``(n, e)`` gradients of its IDs in the
                lookup dtype (``None`` where ``gids`` is ``None``, or for a stack that
                is not trainable).
            problem, bad: as :meth:`lookup`.

        Returns:
            per stack ``(rows, sums)``: unique local rows ``int[m]`` (stack IDs for
            column-wise and replicated stacks) and their ``(m, width)`` sums (float32
            for float16 tables), or ``None`` for a stack that is not trainable.

        Raises:
            as :meth:`lookup`; nothing is returned (so nothing is updated) on error.
        """
        routes, problem = self._safe_route("update", gids, True, True, problem, bad)
        return self.update(routes, None, problem, bad, grads=grads)

    def update(self, routes: list, sums: list | None, problem: Problem | None = None, bad=None, *, grads=None,
               what: str | None = None) -> list:
        """:meth:`gradient_sums` of routes made by :meth:`route` and every stack's
        gradients already summed per unique ID (``sums``, ``(u, e)`` in the routes'
        order; ``None`` for a stack that is not trainable), or of ``grads`` per ID
        (routes made with ``need_groups``). Collective."""
        sending = [s.trainable for s in self.stacks]
        # raises on every replica for any replica's problem: past it, every replica's input is good
        send_counts, recv_counts, per_stack = self._header("update", routes, problem, bad, sending=sending, what=what)
        if not any(sending):
            return [None] * len(self.stacks)  # the checks were all there was to do
        if sums is None:
            sums = self._coalesce(routes, grads)
        start = perf_counter()
        ids = self._send_ids(routes, send_counts, sending)
        their = exchange_rows(ids, send_counts, recv_counts, self.comm,
                              out=self.buffers.get("their_ids", sum(recv_counts), self.id_dtype))
        moved = self._moved(send_counts, recv_counts, ids.itemsize)
        return self._exchange_sums(routes, sums, per_stack, recv_counts, self._their_ids(their, recv_counts),
                                   start, moved)

    def backward(self, context: Lookup, sums: list, problem: Problem | None = None, what: str | None = None) -> list:
        """:meth:`update` for the IDs of a lookup made with ``keep=True``: the IDs are
        where the lookup left them, so only the agreement and the gradient sums
        (``sums`` per stack, in the lookup's unique order) move. Collective (every
        replica passes the context of the same lookup).

        Raises:
            TypeError, ValueError: on every replica, for any replica's ``problem``.
            RuntimeError: replicas passing the contexts of different lookups.
        """
        routes = context.routes
        sending = [s.trainable for s in self.stacks]
        _, _, per_stack = self._header("update", routes, problem, None, seq=context.seq, sending=sending, what=what)
        if not any(sending):
            return [None] * len(self.stacks)
        recv = [sum(c) for c in zip(*[ids[1] for s, ids in zip(self.stacks, context.their_ids) if s.trainable])] \
            or [0] * self.r
        return self._exchange_sums(routes, sums, per_stack, recv, context.their_ids, perf_counter(), (0, 0))

    def _coalesce(self, routes: list, grads: list) -> list:
        """Every trainable stack's gradients summed per unique ID, in the order sent."""
        start = perf_counter()
        out = []
        for stack, route, g in zip(self.stacks, routes, grads):
            if route is None or g is None or not stack.trainable:
                out.append(None)
                continue
            out.append(sum_groups(g, route.perm, route.starts, dtype=stack.acc))
        counters.record("update.coalesce", start, kind=counters.PHASE, detail=self.name)
        return out

    def _exchange_sums(self, routes: list, sums: list, per_stack: np.ndarray, recv_counts: list,
                       their_ids: list, start: float, moved: tuple) -> list:
        """Send every stack's gradient sums to the replicas that hold their rows, sum what
        arrives per row: per stack ``(rows, sums)`` or ``None``. The phase
        ``update.exchange`` began at ``start`` and ``moved`` ``(sent, received)`` bytes
        of IDs already."""
        r, stacks = self.r, self.stacks
        if self.single:
            stack, acc, e = stacks[0], stacks[0].acc, stacks[0].e
            if not stack.trainable:
                return [None]
            mine = sums[0] if sums[0] is not None else np.zeros((0, e), acc)
            send_counts = [routes[0].counts[o] for o in range(r)] if routes[0] is not None else [0] * r
            received = exchange_rows(mine, send_counts, recv_counts, self.comm,
                                     out=self.buffers.get("their_sums", (sum(recv_counts), e), acc))
            self._phase("update.exchange", start, send_counts, recv_counts, e * acc.itemsize, moved)
            start = perf_counter()
            rows, perm, starts = group(their_ids[0][0])
            total = sum_groups(received, perm, starts)
            counters.record("update.sum", start, kind=counters.PHASE, detail=self.name)
            return [(rows.astype(np.intp), total)]
        row_bytes = np.array([s.row_bytes("sums") if s.trainable else 0 for s in stacks], np.int64)
        theirs = np.array([ids[1] for ids in their_ids], np.int64).T if their_ids else np.zeros((r, 0), np.int64)
        sent, got = _Layout(per_stack, row_bytes, pad=True), _Layout(theirs, row_bytes, pad=True)
        send = self.buffers.get("send_sums", sent.total, np.uint8)
        for s, (stack, route, total) in enumerate(zip(stacks, routes, sums)):
            if total is None:
                continue
            if stack.kind == ROUTED:
                at = np.cumsum([0] + route.counts)
                for o in range(r):
                    if route.counts[o]:
                        sent.view(send, o, s, stack.acc, stack.e)[...] = total[at[o]:at[o + 1]]
            elif stack.kind == COLUMN:
                c = stack.width
                for o in range(r):
                    part = sent.view(send, o, s, stack.acc, c)
                    cols = total[:, o * c:(o + 1) * c]
                    part[:, :cols.shape[1]] = cols
                    part[:, cols.shape[1]:] = 0
            else:
                for o in range(r):
                    sent.view(send, o, s, stack.acc, stack.e)[...] = total
        received = exchange_rows(send, sent.peer_bytes, got.peer_bytes, self.comm,
                                 out=self.buffers.get("recv_sums", got.total, np.uint8))
        self._phase("update.exchange", start, sent.peer_bytes, got.peer_bytes, 1, moved)
        start = perf_counter()
        out = []
        for s, stack in enumerate(stacks):
            if not stack.trainable:
                out.append(None)
                continue
            width = stack.width if stack.kind == COLUMN else stack.e
            ids = their_ids[s][0]
            values = got.rows_of(received, s, stack.acc, width)
            rows, perm, starts = group(ids)
            out.append((rows.astype(np.intp), sum_groups(values, perm, starts)))
        counters.record("update.sum", start, kind=counters.PHASE, detail=self.name)
        return out

    def _moved(self, send_counts, recv_counts, row_bytes: int) -> tuple[int, int]:
        """``(sent, received)`` payload bytes of an exchange of rows of ``row_bytes``,
        without this replica's own part (as the collective counters)."""
        k = self.k
        return (sum(send_counts) - send_counts[k]) * row_bytes, (sum(recv_counts) - recv_counts[k]) * row_bytes

    def _phase(self, name: str, start: float, send_counts, recv_counts, row_bytes: int, more=(0, 0)) -> None:
        """Record a phase whose exchanges moved rows of ``row_bytes`` (and ``more``
        bytes of an exchange before them)."""
        sent, received = self._moved(send_counts, recv_counts, row_bytes)
        counters.record(name, start, sent + more[0], received + more[1], kind=counters.PHASE, detail=self.name)


class SparseTokenExchange:
    """The sparse exchange of one TOKEN table (implements :class:`.exchange.Exchange`):
    a :class:`SparseExchange` of one routed stack holding the table row-wise.

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
        rows = -(-num_tokens // self.r)  # local rows per replica, ceil(t/r)
        self.id_dtype = np.dtype(np.int32 if rows < 2 ** 31 else np.int64)
        self.router = StackRouter(ROUTED, num_tokens, self.r, self.k, row_wise_rows=rows,
                                  shard_bytes=rows * encoding * 4, id_dtype=self.id_dtype)
        acc = np.dtype(np.float32) if spec.dtype == np.float16 else spec.dtype
        stack = ExchangeStack(ROUTED, self.router, encoding, encoding, spec.dtype, acc, np.zeros(self.r, np.int64))
        self.exchange = SparseExchange([stack], comm, spec.name, spec.code, self._bad_index,
                                       lambda codes, op: spec.require_same_table(codes, op))

    @property
    def use_slots(self) -> bool:
        """Whether lookups deduplicate with the position array (else a bitmap or a sort)."""
        return self.router.use_slots

    @use_slots.setter
    def use_slots(self, value: bool) -> None:
        self.router.use_slots = value

    def reserve(self, capacity: int, dtype) -> None:
        """Allocate the buffers for ``capacity`` unique IDs per partition (``r * capacity``
        per direction) of a table of lookup ``dtype``, once: a call within the limits
        never grows them."""
        n, e = self.r * capacity, self.e
        acc = np.float32 if dtype == np.float16 else dtype
        for name, shape, kind in (("wanted", n, self.id_dtype), ("found", (n, e), dtype), ("rows", (n, e), dtype),
                                  ("their_ids", n, self.id_dtype), ("their_sums", (n, e), acc)):
            self.exchange.buffers.get(name, shape, kind)
        self.router.buffers.get("ids", n, self.id_dtype)

    def _bad_index(self, replica: int, table: int, value: int) -> IndexError:
        return IndexError(f"host embedding {self.name!r}: replica {replica} passed index {value}, expected indices "
                          f"in [0, {self.t}) (pass clip_indices=True to clip instead); nothing was looked up or "
                          f"updated")

    def _check(self, flat: np.ndarray, problem: Problem | None):
        """This replica's first out-of-range index as ``(0, value)``, or ``None``."""
        # flat is int64 (HostEmbedding._prepare): one pass, as unsigned a negative index exceeds any table
        if problem is None and flat.size and flat.view(np.uint64).max() >= self.t:
            return 0, int(flat[np.argmax((flat < 0) | (flat >= self.t))])
        return None

    def lookup(self, shard: np.ndarray, flat: np.ndarray, problem: Problem | None = None) -> np.ndarray:
        """:meth:`.exchange.Exchange.lookup` (``shard``: the ``(ceil(t/r), e)`` TOKEN
        shard; returns a new array)."""
        bad = self._check(flat, problem)
        rows, routes, _ = self.exchange.lookup([shard], [flat], problem, bad)
        start = perf_counter()
        out = aligned_empty((flat.size, self.e), shard.dtype)  # a new array, which DLPack consumers can share
        if flat.size:
            rows[0].take(routes[0].inverse, axis=0, mode="clip", out=out)
        counters.record("lookup.expand", start, kind=counters.PHASE, detail=self.name)
        return out

    def gradient_sums(self, flat: np.ndarray, grads: np.ndarray | None, problem: Problem | None = None,
                      trainable: bool = True):
        """:meth:`.exchange.Exchange.gradient_sums` (``rows`` sorted; ``sums`` float32 for
        float16 tables, else the table dtype)."""
        self.exchange.stacks[0].trainable = trainable
        bad = self._check(flat, problem)
        return self.exchange.gradient_sums([flat], [grads], problem, bad)[0]
