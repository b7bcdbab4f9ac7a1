"""Sharded host embedding tables: every replica owns a private partition of the table;
lookups and updates cross replicas with collectives.

The API follows TensorFlow-IPU's ``create_host_embedding`` / ``HostEmbedding``
(host-embeddings guide, section 15); the partition strategies are in
:mod:`.token` and :mod:`.encoding`.
"""

from __future__ import annotations

import contextlib
import zlib
from time import perf_counter
from typing import Callable

import numpy as np

from .. import counters, topology
from ..collectives.all_gather import all_gather, gather_rows
from . import combiners
from .encoding import EncodingPartition
from .limiter import Limiter
from .limits import IdLimits
from .optimizer import HostEmbeddingOptimizerSpec
from .sparse import SparseTokenExchange
from .token import TokenPartition

PARTITION_STRATEGIES = {"TOKEN": TokenPartition, "ENCODING": EncodingPartition}
#: Exchanges per strategy; the first is the default (see docs/performance.md for why).
EXCHANGES = {"TOKEN": ("sparse", "dense"), "ENCODING": ("dense",)}
TABLE_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
_INIT_BLOCK_ROWS = 1 << 15


class HostEmbedding:
    """A ``(t, e)`` embedding table partitioned over the replicas.

    Create it with :func:`create_host_embedding`. Every method that moves data is a
    collective: every replica must call it, in the same order, though each may pass
    indices of a different shape (ragged batches).

    Attributes:
        name: table name (used in error messages).
        shape: ``(t, e)``.
        dtype: table dtype (float16, float32 or float64).
        partition_strategy: ``"TOKEN"`` or ``"ENCODING"``.
        exchange: ``"sparse"`` (TOKEN only: deduplicated all-to-all, :mod:`.sparse`) or
            ``"dense"`` (the seed's algorithm, :mod:`.token` / :mod:`.encoding`).
        optimizer_spec: the SGD spec, or ``None`` (not trainable).
        local_shard: this replica's partition, TOKEN ``(ceil(t/r), e)``, ENCODING ``(t, ceil(e/r))``.
        id_limits: the table's :class:`~popdist_lite.embedding.limits.IdLimits` (TOKEN
            only), or ``None``.
    """

    def __init__(self, name: str, shape, dtype, partition_strategy: str,
                 optimizer_spec: HostEmbeddingOptimizerSpec | None, initializer, seed: int, comm,
                 exchange: str = "dense", id_limits: IdLimits | None = None):
        self.name = name
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.partition_strategy = partition_strategy
        self.optimizer_spec = optimizer_spec
        self._comm = comm
        t, e = self.shape
        self._partition = PARTITION_STRATEGIES[partition_strategy](t, e, comm.size, comm.rank)
        self.local_shard = np.zeros(self._partition.shard_shape, dtype=self.dtype)
        self.exchange = exchange
        self._sparse = SparseTokenExchange(name, t, e, comm) if exchange == "sparse" else None
        self.id_limits = id_limits
        self._limiter = None
        if id_limits is not None and id_limits.active:
            self._limiter = Limiter(name, t, comm, id_limits, zlib.crc32(name.encode()) & 0x7FFFFFFF)
            if self._sparse is not None and id_limits.capacity is not None:
                self._size_buffers(id_limits.capacity)
        self._initialize(initializer, seed)
        self._registered = 0

    def _size_buffers(self, capacity: int) -> None:
        """Allocate the sparse exchange's buffers for ``capacity`` unique IDs per partition
        (``r * capacity`` per direction), once: a call within the limits never grows them."""
        b, sp, e = self._sparse.buffers, self._sparse, self.shape[1]
        n = self._comm.size * capacity
        acc = np.float32 if self.dtype == np.float16 else self.dtype
        for name, shape, dtype in (("ids", n, sp.id_dtype), ("wanted", n, sp.id_dtype),
                                   ("found", (n, e), self.dtype), ("rows", (n, e), self.dtype),
                                   ("their_ids", n, sp.id_dtype), ("their_sums", (n, e), acc)):
            b.get(name, shape, dtype)

    # -- initial values -------------------------------------------------------------
    def _initialize(self, initializer, seed: int) -> None:
        t, e = self.shape
        if initializer is None:
            # Counter-based blocks: the same table for any replica count and strategy.
            for first in range(0, t, _INIT_BLOCK_ROWS):
                rng = np.random.default_rng([seed, first // _INIT_BLOCK_ROWS])
                n = min(_INIT_BLOCK_ROWS, t - first)
                block = (rng.random((n, e), dtype=np.float32) * 0.1 - 0.05).astype(self.dtype)
                self._partition.shard_from_block(block, first, self.local_shard)
            return
        table = initializer(self.shape, self.dtype) if callable(initializer) else initializer
        table = np.asarray(table)
        problem = None
        if table.shape != self.shape:
            problem = f"initializer: expected a table of shape {self.shape}, got {table.shape}"
        crc = zlib.crc32(np.ascontiguousarray(table, dtype=self.dtype).tobytes()) if problem is None else -1
        problems = self._comm.allgather((problem, crc))
        for r, (p, _) in enumerate(problems):
            if p:
                raise ValueError(f"host embedding {self.name!r}: replica {r}: {p}")
        crcs = [c for _, c in problems]
        if len(set(crcs)) > 1:
            r = next(i for i, c in enumerate(crcs) if c != crcs[0])
            raise ValueError(f"host embedding {self.name!r}: initializer: replica {r} has a different initial "
                             f"table from replica 0; pass the same array (or a deterministic callable) everywhere")
        self._partition.shard_from_block(table.astype(self.dtype, copy=False), 0, self.local_shard)

    # -- the seed API ------------------------------------------------------------------
    @contextlib.contextmanager
    def register(self, session=None):
        """Context manager kept from the seed API (``with embedding.register(sess):``).

        Lookups and updates also work outside it; inside it, :attr:`registered` is True.
        """
        self._registered += 1
        try:
            yield self
        finally:
            self._registered -= 1

    @property
    def registered(self) -> bool:
        return self._registered > 0

    def _prepare(self, indices, clip_indices: bool, grads=None):
        """Check this replica's arguments locally (no communication).

        Returns ``(flat int64[n], grads (n, e) or None, problem or None)``; the problem
        (an exception type and message) is raised on every replica by the exchange.
        """
        t, e = self.shape
        problem = None
        flat = np.zeros(0, dtype=np.int64)
        if indices.dtype.kind not in "iu":
            problem = (TypeError, f"host embedding {self.name!r}: argument indices: expected an integer "
                                  f"dtype, got {indices.dtype}")
        else:
            flat = indices.reshape(-1).astype(np.int64)
            if clip_indices:
                np.clip(flat, 0, t - 1, out=flat)
        if grads is not None and problem is None:
            grads = np.asarray(grads)
            want = indices.shape + (e,)
            if grads.shape != want:
                problem = (ValueError, f"host embedding {self.name!r}: argument grads: expected shape "
                                       f"indices.shape + (e,) = {want}, got {grads.shape}")
            elif grads.dtype.kind != "f":
                problem = (TypeError, f"host embedding {self.name!r}: argument grads: expected a floating "
                                      f"dtype, got {grads.dtype}")
            else:
                grads = np.ascontiguousarray(grads.reshape(-1, e), dtype=self.dtype)
        return flat, grads, problem

    def _gather_indices(self, flat: np.ndarray, problem):
        """Dense exchange: all-gather the flattened indices and check them on every replica.

        Returns ``(gathered, counts)``.
        Raises TypeError/ValueError/IndexError on every replica for any replica's bad input.
        """
        t = self.shape[0]
        gathered, counts = gather_rows(flat, self._comm, problem=problem, name="indices")
        bad = np.flatnonzero((gathered < 0) | (gathered >= t))
        if bad.size:
            p = int(bad[0])
            r = int(np.searchsorted(np.cumsum(counts), p, side="right"))
            raise IndexError(f"host embedding {self.name!r}: replica {r} passed index {int(gathered[p])}, "
                             f"expected indices in [0, {t}) (pass clip_indices=True to clip instead); "
                             f"nothing was looked up or updated")
        return gathered, counts

    def lookup(self, indices, clip_indices: bool = False) -> np.ndarray:
        """Look up rows of the whole table. Collective.

        Args:
            indices: integer array of any shape and any integer dtype; the shape may
                differ between replicas.
            clip_indices: clip out-of-range indices to ``[0, t)`` (the seed API's
                behaviour) instead of raising.

        Returns:
            ``indices.shape + (e,)`` array of the table dtype.

        Raises:
            IndexError: on every replica, when any replica passes an index outside
                ``[0, t)`` (message names the table, the replica, the value, the range).
            TypeError: on every replica, for non-integer indices on any replica.
        """
        start = perf_counter()
        indices = np.asarray(indices)
        flat, _, problem = self._prepare(indices, clip_indices)
        rows = self._lookup_flat(flat, problem)
        counters.record("lookup", start, kind=counters.PHASE, detail=self.name)
        return rows.reshape(indices.shape + (self.shape[1],))

    def _lookup_flat(self, flat: np.ndarray, problem) -> np.ndarray:
        """``(n, e)`` rows of ``flat`` under the table's ID limits (if any). Collective."""
        if self._limiter is None:
            return self._lookup_once(flat, problem)
        return self._limiter.lookup(flat, problem, self._lookup_once)

    def _lookup_once(self, flat: np.ndarray, problem) -> np.ndarray:
        if self._sparse is not None:
            return self._sparse.lookup(self.local_shard, flat, problem)
        gathered, counts = self._gather_indices(flat, problem)
        return self._partition.lookup(self.local_shard, gathered, counts, self._comm)

    def apply_gradients(self, indices, grads, clip_indices: bool = False) -> None:
        """SGD update: every row ``i`` becomes ``row_i - lr * sum_g`` where ``sum_g`` sums
        every replica's gradients for ``i`` in this call (duplicates accumulate). Collective.

        Args:
            indices: as for :meth:`lookup`.
            grads: ``indices.shape + (e,)`` floating array (cast to the table dtype;
                float16 gradients are summed in float32).
            clip_indices: as for :meth:`lookup`.

        Raises:
            IndexError, TypeError, ValueError: on every replica for any replica's bad
                indices or gradients; the table is left unchanged.
        """
        start = perf_counter()
        indices = np.asarray(indices)
        flat, grads, problem = self._prepare(indices, clip_indices, grads=grads)
        self._update_flat(flat, grads, problem)
        counters.record("update", start, kind=counters.PHASE, detail=self.name)

    def _update_flat(self, flat: np.ndarray, grads, problem) -> None:
        """Apply ``grads`` ``(n, e)`` of ``flat`` under the table's ID limits. Collective."""
        if self._limiter is None:
            self._update_once(flat, grads, problem)
        else:
            self._limiter.update(flat, grads, problem, self._update_once)

    def _update_once(self, flat: np.ndarray, grads, problem) -> None:
        spec = self.optimizer_spec
        trainable = spec is not None and spec.trainable
        if self._sparse is not None:
            pairs = self._sparse.gradient_sums(flat, grads, problem, trainable=trainable)
        else:
            gathered, counts = self._gather_indices(flat, problem)
            pairs = self._partition.gradient_sums(gathered, counts, grads, self._comm) if trainable else None
        if pairs is not None:
            rows, sums = pairs
            step = perf_counter()
            if rows.size:
                updated = self.local_shard[rows].astype(sums.dtype) - spec.learning_rate * sums
                self.local_shard[rows] = updated.astype(self.dtype)
            counters.record("update.apply", step, kind=counters.PHASE, detail=self.name)

    # -- multivalent features ----------------------------------------------------------
    def lookup_bags(self, values, lengths=None, weights=None, combiner: str = "sum", padding_id=None,
                    clip_indices: bool = False) -> np.ndarray:
        """Pooled lookup of bags of IDs (multivalent features). Collective.

        Bags are ragged (``values`` ``int[n]`` with ``lengths`` ``int[B]``) or padded
        (``values`` ``int[..., L]``, ``padding_id`` marks unused positions); ``weights``
        (optional, float, ``values.shape``) weigh each ID. Bag ``b`` pools to
        ``sum_i w_i row_i / d_b`` with ``d_b`` = 1 (``"sum"``), ``sum_i w_i`` (``"mean"``)
        or ``sqrt(sum_i w_i**2)`` (``"sqrtn"``), SparseCore's combiners. The divisor is
        always the whole bag's, even when its IDs live on several replicas (rows are
        pooled after they return; TorchRec#2362 divided by the local part). An empty bag
        pools to zeros. Works with both exchanges, ID limits and minibatching (the IDs go
        through :meth:`lookup`'s path; dropped IDs contribute zeros, divisors unchanged).
        Details: :mod:`popdist_lite.embedding.combiners`.

        Returns:
            ``(B, e)`` (ragged) or ``values.shape[:-1] + (e,)`` (padded), table dtype.

        Raises:
            ValueError, TypeError: on every replica, for any replica's malformed bags
                (see :func:`~popdist_lite.embedding.combiners.make_bags`).
            IndexError, IdLimitError: as :meth:`lookup`.
        """
        start = perf_counter()
        bags, flat, problem = self._prepare_bags(values, lengths, weights, combiner, padding_id, clip_indices)
        rows = self._lookup_flat(flat, problem)
        out = combiners.pool(rows, bags)
        counters.record("lookup_bags", start, kind=counters.PHASE, detail=self.name)
        return out

    def apply_bag_gradients(self, values, grads, lengths=None, weights=None, combiner: str = "sum",
                            padding_id=None, clip_indices: bool = False) -> None:
        """SGD update from the gradients of :meth:`lookup_bags`'s output. Collective.

        Args:
            values, lengths, weights, combiner, padding_id: the same bags as the lookup.
            grads: the gradient of the pooled output, its shape (``(B, e)`` ragged,
                ``values.shape[:-1] + (e,)`` padded). Each ID receives
                ``grads[b] * w_i / d_b``; then as :meth:`apply_gradients`.

        Raises:
            ValueError, TypeError: on every replica, for any replica's malformed bags or
                gradients; nothing is updated.
            IndexError, IdLimitError: as :meth:`apply_gradients`.
        """
        start = perf_counter()
        e = self.shape[1]
        bags, flat, problem = self._prepare_bags(values, lengths, weights, combiner, padding_id, clip_indices)
        per_id = None
        if problem is None:
            grads = np.asarray(grads)
            if grads.shape != bags.shape + (e,) or grads.dtype.kind != "f":
                problem = (ValueError, f"host embedding {self.name!r}: argument grads: expected a floating "
                                       f"array of shape {bags.shape + (e,)}, got {grads.dtype}{list(grads.shape)}")
                flat = np.zeros(0, dtype=np.int64)
            else:
                per_id = combiners.unpool(grads, bags, e, self.dtype)
        self._update_flat(flat, per_id, problem)
        counters.record("update_bags", start, kind=counters.PHASE, detail=self.name)

    def _prepare_bags(self, values, lengths, weights, combiner, padding_id, clip_indices):
        """``(bags, flat, problem)``: a local problem is raised on every replica by the exchange."""
        try:
            bags = combiners.make_bags(values, lengths, weights, combiner, padding_id)
        except (ValueError, TypeError) as exc:
            empty = np.zeros(0, dtype=np.int64)
            bags = combiners.Bags(empty, np.zeros(0), empty, empty, (0,))
            return bags, empty, (type(exc), f"host embedding {self.name!r}: {exc}")
        flat, _, problem = self._prepare(bags.ids, clip_indices)
        return bags, flat, problem

    def get_embedding_tensor(self) -> np.ndarray:
        """The full ``(t, e)`` table, on every replica. Collective (an all-gather)."""
        return self._partition.assemble(all_gather(self.local_shard, comm=self._comm))

    def __repr__(self) -> str:
        return (f"HostEmbedding({self.name!r}, shape={list(self.shape)}, dtype={self.dtype}, "
                f"partition_strategy={self.partition_strategy!r}, exchange={self.exchange!r}, "
                f"id_limits={self.id_limits}, "
                f"local_shard={self.local_shard.shape})")


def create_host_embedding(name: str, shape, dtype=np.float32, partition_strategy: str = "TOKEN",
                          optimizer_spec: HostEmbeddingOptimizerSpec | None = None,
                          initializer: np.ndarray | Callable | None = None, seed: int = 0,
                          *, exchange: str | None = None, max_ids_per_partition: int | None = None,
                          max_unique_ids_per_partition: int | None = None, allow_id_dropping: bool = False,
                          enable_minibatching: bool = False, track_id_stats: bool = False,
                          comm=None) -> HostEmbedding:
    """Create a ``(t, e)`` embedding table partitioned over the replicas. Collective.

    Args:
        name: table name.
        shape: ``[t, e]``, number of tokens (rows) and encoding size (columns).
        dtype: float16, float32 (default) or float64.
        partition_strategy: ``"TOKEN"`` (row ``i`` on replica ``i % r``) or
            ``"ENCODING"`` (replica ``k`` holds columns ``[k*c, (k+1)*c)``, ``c = ceil(e/r)``).
        optimizer_spec: :class:`HostEmbeddingOptimizerSpec`; ``None`` or a learning rate
            of 0 means not trainable.
        initializer: ``None`` (uniform in ``[-0.05, 0.05)`` as Keras's ``Embedding``,
            from counter-based random blocks of ``seed``, so the table is identical for
            every replica count and strategy), a full ``(t, e)`` array, or a callable
            ``initializer(shape, dtype) -> (t, e) array``; an array or callable must give
            the same table on every replica.
        seed: seed of the default initializer.
        exchange: how lookups and updates move data, the same on every replica:
            ``"sparse"`` (TOKEN only; the default for TOKEN): deduplicated indices go to
            their owner only with all-to-alls (TorchRec row-wise / SparseCore style,
            :mod:`popdist_lite.embedding.sparse`); ``"dense"``: the seed's algorithm
            (all-gather, mask, reduce-scatter-sum for TOKEN; all-gather and all-to-all for
            ENCODING, its only exchange). ``None`` picks the default.
        max_ids_per_partition, max_unique_ids_per_partition: TOKEN tables only: the most
            IDs (with duplicates / distinct) one replica may send to one owner replica in
            one call (SparseCore's ``TableSpec`` limits; ``None``: no limit). The sparse
            exchange's buffers are sized from them once. Exceeding one raises
            :class:`~popdist_lite.embedding.limits.IdLimitError` on every replica unless
            one of the next two options is set. Docs: ``docs/minibatching.md``.
        allow_id_dropping: drop the IDs beyond a limit instead (rows read as zeros,
            gradients ignored; the choice is in :mod:`popdist_lite.embedding.limits`).
        enable_minibatching: split an exceeding call into minibatches by ID hash bucket
            instead (:mod:`popdist_lite.embedding.limiter`); results equal one pass.
        track_id_stats: publish per-call ID statistics (:mod:`popdist_lite.id_stats`)
            even without limits (costs one small all-gather per call).

    Returns:
        :class:`HostEmbedding`.

    Raises:
        ValueError: an unknown strategy or exchange, ``"sparse"`` with ENCODING, a bad
            shape, or arguments that differ between replicas (on every replica).
        TypeError: an unsupported dtype.
    """
    topology.init()
    id_limits = None
    comm = topology.replica_comm() if comm is None else comm
    problem = None
    try:
        if partition_strategy not in PARTITION_STRATEGIES:
            raise ValueError(f"argument partition_strategy: expected 'TOKEN' or 'ENCODING', got {partition_strategy!r}")
        allowed = EXCHANGES[partition_strategy]
        if exchange is None:
            exchange = allowed[0]
        elif exchange not in allowed:
            raise ValueError(f"argument exchange: expected one of {', '.join(map(repr, allowed))} for "
                             f"{partition_strategy} tables, got {exchange!r}")
        shape = tuple(int(s) for s in shape)
        if len(shape) != 2 or min(shape) < 1:
            raise ValueError(f"argument shape: expected [t, e] with t, e >= 1, got {list(shape)}")
        if np.dtype(dtype) not in TABLE_DTYPES:
            raise TypeError(f"argument dtype: expected float16, float32 or float64, got {np.dtype(dtype)}")
        if optimizer_spec is not None and not isinstance(optimizer_spec, HostEmbeddingOptimizerSpec):
            raise TypeError(f"argument optimizer_spec: expected a HostEmbeddingOptimizerSpec or None, "
                            f"got {type(optimizer_spec).__name__}")
        id_limits = IdLimits(max_ids_per_partition, max_unique_ids_per_partition, bool(allow_id_dropping),
                             bool(enable_minibatching), bool(track_id_stats))
        if id_limits.active and partition_strategy != "TOKEN":
            raise ValueError("ID limits and track_id_stats apply to TOKEN tables only (an ENCODING table "
                             "sends every ID to every replica)")
        signature = (name, shape, str(np.dtype(dtype)), partition_strategy,
                     optimizer_spec.learning_rate if optimizer_spec else 0.0, seed, exchange,
                     id_limits.signature())
    except (ValueError, TypeError) as exc:
        problem, signature = exc, None
    # Creation is rare: a pickled all-gather keeps the check simple.
    gathered = comm.allgather((type(problem), str(problem)) if problem else (None, signature))
    for r, (error, message) in enumerate(gathered):
        if error is not None:
            raise error(f"create_host_embedding({name!r}): replica {r}: {message}")
    for r, (_, item) in enumerate(gathered):
        if item != gathered[0][1]:
            raise ValueError(f"create_host_embedding({name!r}): replica {r} passed (name, shape, dtype, "
                             f"strategy, learning rate, seed, exchange, id limits) = {item}, expected "
                             f"{gathered[0][1]} "
                             f"as on replica 0")
    return HostEmbedding(name, shape, dtype, partition_strategy, optimizer_spec, initializer, seed, comm,
                         exchange=exchange, id_limits=id_limits if id_limits.active else None)
