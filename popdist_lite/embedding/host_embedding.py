"""Sharded host embedding tables: every replica owns a private partition of the table;
lookups and updates cross replicas with collectives.

The API follows TensorFlow-IPU's ``create_host_embedding`` / ``HostEmbedding``
(the TF-IPU host-embedding guide, section 15); the partition strategies are in
:mod:`.token` and :mod:`.encoding`.
"""

from __future__ import annotations

import contextlib
import functools
from time import perf_counter
from typing import Callable

import numpy as np

from .. import counters, progress, topology
from ..collectives import Problem, agree_objects, all_gather
from ..collectives.all_gather import gather_rows
from . import combiners
from .encoding import EncodingPartition
from .exchange import DenseExchange, Exchange
from .id_limits.enforcer import IdLimitEnforcer
from .optimizer_specs import EmbeddingOptimizerSpec, HostEmbeddingSGDGAOptimizerSpec
from .shard import Shard, initialize
from .sparse import SparseTokenExchange
from .state import TableState, check_arrays
from .storage import DiskStorage, as_storage
from .storage.disk import Prefetch
from .table_spec import TableSpec
from .token import TokenPartition

PARTITIONS = {"TOKEN": TokenPartition, "ENCODING": EncodingPartition}
#: A disk table's counters on the timeline (a counter event after each lookup and
#: update) and in the progress records (summed over the process's disk tables).
TIMELINE_COUNTERS = progress.STORAGE_FIELDS


class HostEmbedding:
    """A ``(t, e)`` embedding table partitioned over the replicas.

    Create it with :func:`create_host_embedding`. Every method that moves data is a
    collective: every replica must call it, in the same order, though each may pass
    indices of a different shape (ragged batches).

    Attributes:
        spec: the table's :class:`~popdist_lite.embedding.table_spec.TableSpec` (the
            checked arguments of :func:`create_host_embedding`).
        name: table name (used in error messages).
        shape: ``(t, e)``.
        dtype: the lookup dtype (float16, float32 or float64): lookups return it and
            gradients travel in it.
        master_dtype: the storage dtype, ``dtype`` unless FP32 master weights were asked
            for (``master_weights=np.float32``).
        partition_strategy: ``"TOKEN"`` or ``"ENCODING"``.
        exchange: ``"sparse"`` (TOKEN only: deduplicated all-to-all, :mod:`.sparse`) or
            ``"dense"`` (the TF-IPU guide's algorithm, :class:`.exchange.DenseExchange`). Both
            feed the same optimizer step.
        optimizer_spec: an :class:`EmbeddingOptimizerSpec`, or ``None`` (not trainable).
        optimizer_state: this replica's optimizer state (arrays for its own rows only).
        stochastic_rounding: the :class:`StochasticRounding` used when updated rows are
            stored in float16 (owned rows: ``ON`` rounds stochastically with a
            per-replica stream, ``OFF``/``REPLICA_IDENTICAL_ONLY`` round to nearest).
        local_shard: this replica's partition in ``master_dtype``, TOKEN
            ``(ceil(t/r), e)``, ENCODING ``(t, ceil(e/r))``.
        id_limits: the table's :class:`~popdist_lite.embedding.id_limits.settings.IdLimits` (TOKEN
            only), or ``None``.
        storage: ``None`` (in memory) or the table's :class:`DiskStorage`. On a disk
            table ``local_shard`` and the file-backed ``optimizer_state`` slots are
            memory maps of the partition file, up to date after :meth:`state` (which
            writes the cache back); see ``docs/offload.md``.
    """

    def __init__(self, spec: TableSpec, initializer, comm, storage: DiskStorage | None = None):
        self.spec = spec
        self.name, self.shape, self.dtype, self.master_dtype = spec.name, spec.shape, spec.dtype, spec.master_dtype
        self.partition_strategy, self.exchange = spec.partition_strategy, spec.exchange
        self.optimizer_spec, self.stochastic_rounding = spec.optimizer_spec, spec.stochastic_rounding
        self.id_limits = spec.id_limits if spec.id_limits.active else None
        self._comm = comm
        t, e = self.shape
        self._partition = PARTITIONS[spec.partition_strategy](t, e, comm.size, comm.rank)
        self.storage = storage
        row_sum = getattr(self._partition, "row_sum", None)  # ENCODING: a row's columns are spread
        self._shard = Shard(spec.name, self._partition.shard_shape, spec.dtype, spec.master_dtype, spec.optimizer_spec,
                            spec.stochastic_rounding, comm, storage, full_width=e,
                            row_sum=None if row_sum is None else (lambda x: row_sum(x, comm)))
        self._disk, self.local_shard = self._shard.disk, self._shard.weights
        self.optimizer_state = self._shard.optimizer_state
        self._exchange: Exchange = (SparseTokenExchange(spec, comm) if spec.exchange == "sparse"
                                    else DenseExchange(spec.name, self._partition, comm))
        self._limiter = IdLimitEnforcer(spec, comm) if self.id_limits is not None else None
        if spec.exchange == "sparse" and self.id_limits is not None and self.id_limits.capacity is not None:
            self._exchange.reserve(self.id_limits.capacity, self.dtype)
        initialize(self._shard.initial_writes(), self._partition, spec, initializer, comm)
        # Lookups read the serving copy: the master shard itself, its float16 (lookup
        # dtype) rounding kept in step with every update (only written rows are re-cast),
        # or a disk table's rows through its cache.
        self._shard.initialized()
        self._serving = self._shard.serving
        self._registered = 0

    # -- the TensorFlow-IPU API ---------------------------------------------------------
    @contextlib.contextmanager
    def register(self, session=None):
        """Context manager kept from the TensorFlow-IPU API (``with embedding.register(sess):``).

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

    def lookup(self, indices, clip_indices: bool = False) -> np.ndarray:
        """Look up rows of the whole table. Collective.

        Args:
            indices: integer array of any shape, integer dtype and memory layout
                (strided views such as ``ids[k::r]``, negative strides, Fortran order);
                the shape may differ between replicas.
            clip_indices: clip out-of-range indices to ``[0, t)`` (the TensorFlow-IPU API's
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
        flat, _, problem = _prepare(self.spec, indices, clip_indices)
        rows = self._lookup_flat(flat, problem)
        counters.record("lookup", start, kind=counters.PHASE, detail=self.name)
        return rows.reshape(indices.shape + (self.shape[1],))

    def _lookup_flat(self, flat: np.ndarray, problem) -> np.ndarray:
        """``(n, e)`` rows of ``flat`` under the table's ID limits (if any). Collective."""
        if self._limiter is None:
            rows = self._lookup_once(flat, problem)
        else:
            rows = self._limiter.lookup(flat, problem, self._lookup_once)
        if self._disk is not None:
            if not self.spec.trainable:
                self._disk.used()  # a table that is not updated lets its prefetches go at lookups
            self._sample_storage()
        return rows

    def _lookup_once(self, flat: np.ndarray, problem: Problem | None) -> np.ndarray:
        rows = self._exchange.lookup(self._serving, flat, problem)
        if self._disk is not None:
            self._disk.agree(self._comm)  # a disk problem met inside the exchange, raised everywhere
        return rows

    def apply_gradients(self, indices, grads, clip_indices: bool = False, *, loss_scale: float = 1.0) -> None:
        """Update the rows looked up with ``indices`` with the optimizer spec. Collective.

        Every replica's gradients for a row are summed (duplicates accumulate; float16
        gradients are summed in float32: with the dense exchange they travel as float16,
        with the sparse exchange each replica first sums its own duplicates in float32
        and sends those float32 sums to the row's owner), divided by ``loss_scale`` in
        float32, and applied once per row by the replica that owns it (see
        :mod:`popdist_lite.embedding.optimizer_specs`), whichever the exchange. With the SGD
        spec, row ``i`` becomes ``row_i - lr * sum_g``.

        Args:
            indices: as for :meth:`lookup`.
            grads: ``indices.shape + (e,)`` floating array of any memory layout (cast
                to the lookup dtype).
            clip_indices: as for :meth:`lookup`.
            loss_scale: the factor the loss was multiplied by (see
                :mod:`popdist_lite.loss_scaling`); the same on every replica.

        Raises:
            IndexError, TypeError, ValueError: on every replica for any replica's bad
                indices or gradients; the table is left unchanged.
        """
        start = perf_counter()
        indices = np.asarray(indices)
        flat, grads, problem = _prepare(self.spec, indices, clip_indices, grads=grads)
        self._update_flat(flat, grads, problem, loss_scale)
        counters.record("update", start, kind=counters.PHASE, detail=self.name)

    def _update_flat(self, flat: np.ndarray, grads, problem, loss_scale: float = 1.0) -> None:
        """Apply ``grads`` ``(n, e)`` of ``flat`` under the table's ID limits. Collective.
        With minibatching the optimizer steps once per minibatch (each row is in one)."""
        update = functools.partial(self._update_once, loss_scale=loss_scale)
        if self._limiter is None:
            update(flat, grads, problem)
        else:
            self._limiter.update(flat, grads, problem, update)
        if self._disk is not None:
            self._disk.unpin()  # the rows of the lookups before this update may go
            if self.spec.trainable:
                self._disk.used()  # and those of the prefetches due
            self._sample_storage()

    def _update_once(self, flat: np.ndarray, grads, problem: Problem | None, loss_scale: float = 1.0) -> None:
        pairs = self._exchange.gradient_sums(flat, grads, problem, trainable=self.spec.trainable)
        if pairs is not None:
            step = perf_counter()
            self._apply(*pairs, loss_scale)
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
        return self._lookup_bags(values, lengths, weights, combiner, padding_id, clip_indices)

    def _lookup_bags(self, values, lengths=None, weights=None, combiner: str = "sum", padding_id=None,
                     clip_indices: bool = False, *, problem: Problem | None = None) -> np.ndarray:
        """:meth:`lookup_bags`, with the caller's own ``problem`` (its arguments' check,
        e.g. a binding's) raised on every replica by the lookup's agreement before this
        call's own checks."""
        start = perf_counter()
        bags, flat, own = _prepare_bags(self.spec, values, lengths, weights, combiner, padding_id, clip_indices)
        if problem is not None:
            flat = np.zeros(0, dtype=np.int64)
        rows = self._lookup_flat(flat, problem or own)
        out = combiners.pool(rows, bags, overwrite_rows=True)  # the rows are this call's own
        counters.record("lookup_bags", start, kind=counters.PHASE, detail=self.name)
        return out

    def apply_bag_gradients(self, values, grads, lengths=None, weights=None, combiner: str = "sum",
                            padding_id=None, clip_indices: bool = False, *, loss_scale: float = 1.0) -> None:
        """Optimizer update from the gradients of :meth:`lookup_bags`'s output. Collective.

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
        bags, flat, problem = _prepare_bags(self.spec, values, lengths, weights, combiner, padding_id, clip_indices)
        per_id = None
        if problem is None:
            grads = np.asarray(grads)
            if grads.shape != bags.shape + (e,) or grads.dtype.kind != "f":
                problem = Problem(ValueError, f"host embedding {self.name!r}: argument grads: expected a floating "
                                              f"array of shape {bags.shape + (e,)}, got {grads.dtype}{list(grads.shape)}")
                flat = np.zeros(0, dtype=np.int64)
            else:
                per_id = combiners.unpool(grads, bags, e, self.dtype)
        self._update_flat(flat, per_id, problem, loss_scale)
        counters.record("update_bags", start, kind=counters.PHASE, detail=self.name)

    def _apply(self, rows: np.ndarray, sums: np.ndarray, loss_scale: float) -> None:
        """One optimizer step on this replica's ``rows`` (local, sorted, unique) with the
        summed gradients ``sums``, whichever exchange produced them (:meth:`Shard.apply`)."""
        self._shard.apply(rows, sums, loss_scale)

    @property
    def storage_stats(self) -> dict | None:
        """A disk table's counters on this replica since it was created, else ``None``:
        ``hits``, ``misses`` (distinct rows a lookup or update found in the cache, or
        not: absent, or still being read by a prefetch), ``evictions``, ``rows_read``,
        ``rows_written``, ``bytes_read``, ``bytes_written`` (the partition file,
        prefetch reads included), ``disk_seconds`` (time in reads and writes of the
        file, the prefetch thread's included), ``wait_seconds`` (the training loop's
        own time in the file or waiting for a prefetch's read, inside lookups, updates
        and :meth:`prefetch` calls), ``prefetches`` (calls), ``prefetched_rows`` (rows
        the background reads brought in), ``cache_rows`` (capacity), ``file_bytes``."""
        if self._disk is None:
            return None
        return {**self._disk.stats, "cache_rows": self._disk.cache.capacity, "file_bytes": self._disk.file_bytes}

    def _sample_storage(self) -> None:
        """The disk counters as a timeline counter event (when the timeline is on) and
        into the progress slot the poprun-lite agent sends with its ``progress`` records
        (when the stall inspector records)."""
        if counters.events is not None:
            counters.sample(f"disk {self.name}", {k: self._disk.stats[k] for k in TIMELINE_COUNTERS})
        if progress.recording():
            progress.add_storage(self._disk.unpublished())

    # -- prefetch (disk tables) ----------------------------------------------------------
    def prefetch(self, indices, ahead: int = 1) -> Prefetch | None:
        """Start reading the rows of a coming batch into a disk table's cache. Collective
        on a disk table; on an in-memory table it returns ``None`` at once (no
        communication, ``indices`` not looked at).

        The replicas all-gather their ``indices``; each keeps the IDs whose rows it owns
        (TOKEN: ``id % r`` is this replica, local row ``id // r``; ENCODING: every ID, its
        columns of the row), reserves cache slots for the rows not cached (evicting as a
        lookup would) and a background thread reads them while the training loop
        computes. The batch's rows are held in the cache (never evicted) until the table
        has been updated ``ahead + 1`` times from now (a table that is not trainable:
        looked up), i.e. until the update of that batch. Results are bit-identical with
        or without prefetch: only when rows are read changes. The idea is FBGEMM's
        cache prefetch for its UVM/SSD table-batched embeddings and TorchRec's
        ``PrefetchTrainPipelineSparseDist`` (the next batch's rows fetched while this
        batch computes). :meth:`Infeed.prefetch_rows <popdist_lite.infeed.Infeed.prefetch_rows>`
        makes the feed call this for its batches ahead.

        Args:
            indices: integer array of any shape (the batch's IDs, as it will be looked
                up); out-of-range IDs are ignored (the lookup reports them).
            ahead: updates of this table (``int >= 0``) that come before the one of this
                batch: 1 (default) when called during the step before it (that step's
                update comes first), 0 when its update is the next one.

        Returns:
            a :class:`~popdist_lite.embedding.storage.disk.Prefetch` (``wait(timeout)``,
            ``done``: this replica's reads are in the cache; ``rows``, ``reads``), or
            ``None`` for an in-memory table.

        Raises:
            TypeError, ValueError: on every replica, for non-integer ``indices`` or a bad
                ``ahead`` on any replica.
            ValueError: on every replica, when a replica's cache cannot hold the batch's
                rows beside those pinned by lookups and held by the prefetches in flight
                (the message says how many bytes it needs); nothing is held then.
        """
        return self._prefetch(indices, ahead)

    def _prefetch(self, indices, ahead: int = 1, problem: Problem | None = None) -> Prefetch | None:
        """:meth:`prefetch`, with the caller's own ``problem`` raised on every replica."""
        if self._disk is None:
            return None
        start = perf_counter()
        indices = np.asarray(indices)
        flat = np.zeros(0, np.int64)
        if problem is None and (isinstance(ahead, bool) or not isinstance(ahead, (int, np.integer)) or ahead < 0):
            problem = Problem(ValueError, f"host embedding {self.name!r}: prefetch: argument ahead: expected an "
                                          f"integer >= 0, got {ahead!r}")
        if problem is None and indices.dtype.kind not in "iu":
            problem = Problem(TypeError, f"host embedding {self.name!r}: prefetch: argument indices: expected an "
                                         f"integer dtype, got {indices.dtype}")
        if problem is None:
            flat = indices.reshape(-1).astype(np.int64)
        gathered, _ = gather_rows(flat, self._comm, problem=problem, name="indices")
        t = self.shape[0]
        gathered = gathered[(gathered >= 0) & (gathered < t)]
        if self.partition_strategy == "TOKEN":
            r = self._comm.size
            gathered = gathered[gathered % r == self._comm.rank] // r
        job = self._disk.prefetch(np.unique(gathered), int(ahead))
        self._disk.agree(self._comm)  # a cache too small for the batches in flight: raised everywhere
        counters.record("prefetch", start, kind=counters.PHASE, detail=self.name)
        return job

    def wait_prefetch(self, timeout: float | None = None) -> bool:
        """Wait until this replica's reads of every prefetch not yet let go are in the
        cache. Local. True at once for an in-memory table.

        Returns:
            False when ``timeout`` (seconds) passed first."""
        return True if self._disk is None else self._disk.wait_prefetches(timeout)

    def drop_prefetches(self) -> None:
        """Let go of every prefetch's rows (their batches will not come: the feed ended
        or was closed); waits for their reads. Local; nothing for an in-memory table."""
        if self._disk is not None:
            self._disk.drop_prefetches()

    @property
    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state held by this replica (its own rows only)."""
        return self._shard.optimizer_state_bytes

    def state(self) -> TableState:
        """This replica's state of the table: live references to its master partition and
        optimizer state, their layouts and the stochastic-rounding generator states. Local
        (no communication). See :class:`popdist_lite.TableState`. A disk table first
        writes its dirty rows back and empties its cache: its arrays are the partition
        file's memory maps.

        Raises:
            RuntimeError: a disk table's partition file was truncated (the file has no
                name, so nothing can replace it under the table), or its cache's
                background thread failed and broke the cache."""
        self._shard.sync()
        arrays, layouts = self._shard.arrays()
        return TableState(name=self.name, shape=self.shape, dtype=self.dtype, master_dtype=self.master_dtype,
                          partition_strategy=self.partition_strategy, num_replicas=self._comm.size,
                          replica=self._comm.rank, arrays=arrays, layouts=layouts,
                          generators=self.stochastic_rounding.generator_states())

    def load_state(self, arrays: dict[str, np.ndarray], generators: dict[str, dict] | None = None) -> None:
        """Copy ``arrays`` (keys and shapes as in :meth:`state`'s ``arrays``, any subset)
        into this replica's state, restore the ``generators`` states when given, and
        refresh the float16 serving copy. Local (no communication).

        Raises:
            ValueError: an unknown array name, an array whose shape or dtype differs
                from the current one (naming the slot, expected and got), or an unknown
                generator state; checked before anything is written, so nothing is.
        """
        current = self.state()
        check_arrays(self.name, current.arrays, arrays)
        if generators:
            try:
                self.stochastic_rounding.check_generator_states(generators)
            except ValueError as exc:
                raise ValueError(f"host embedding {self.name!r}: load_state: {exc}") from None
        for key, value in arrays.items():
            np.copyto(current.arrays[key], value)
        if generators:
            self.stochastic_rounding.set_generator_states(generators)
        self._shard.loaded()

    # -- checkpoints (the Stateful protocol of popdist_lite.checkpoint) -----------------
    def checkpoint_info(self) -> dict:
        """What a checkpoint's manifest says of the table."""
        arrays = self.state().arrays
        return {"shape": list(self.shape), "dtype": str(np.dtype(self.dtype)),
                "master_dtype": str(np.dtype(self.master_dtype)), "partition_strategy": self.partition_strategy,
                "arrays": sorted(arrays)}

    def state_dict(self) -> dict:
        """The table's state for a checkpoint (:meth:`TableState.state_dict`): live
        references to this replica's partition of the master weights and optimizer
        state, the stochastic-rounding generator states. Local."""
        return self.state().state_dict()

    def validate_state_dict(self, state_dict: dict, saved) -> None:
        """Refuse a checkpoint of a table of another shape, or with generator states this
        table cannot take (before anything changes).

        Raises:
            ValueError: naming the table, what the checkpoint holds and what this table is.
        """
        shape = saved.info.get("shape")
        if shape is not None and tuple(shape) != tuple(self.shape):
            raise ValueError(f"table {saved.name!r} has shape {tuple(shape)}, the table being loaded has "
                             f"{tuple(self.shape)}")
        try:
            self.stochastic_rounding.check_generator_states(state_dict.get("generators", {}))
        except ValueError as exc:
            raise ValueError(f"table {saved.name!r}: {exc}") from None

    def load_state_dict(self, state_dict: dict) -> None:
        """Finish a load: the arrays of :meth:`state_dict` were filled in place (others
        given are copied in), then the generator states are restored and the float16
        serving copy refreshed. Local.

        Raises:
            ValueError: as :meth:`load_state`.
        """
        live = self.state().arrays
        given = {"weights": state_dict.get("weights"),
                 **{f"optimizer/{slot}": v for slot, v in state_dict.get("optimizer", {}).items()}}
        copies = {}
        for key, value in given.items():
            array = value.local if hasattr(value, "local") else value
            if array is not None and array is not live.get(key):
                copies[key] = array
        self.load_state(copies, state_dict.get("generators") or None)

    def get_embedding_tensor(self, master: bool = False) -> np.ndarray:
        """The full ``(t, e)`` table, on every replica. Collective (an all-gather).

        Args:
            master: return the master weights (``master_dtype``) instead of the values
                lookups serve (``dtype``); the same unless ``master_weights`` was given.

        Raises:
            RuntimeError: on every replica, when a disk table's dirty rows cannot be
                written back (a full disk) or its partition file was truncated.
        """
        if self._disk is not None:
            problem = None
            try:
                self._disk.sync()
            except (OSError, RuntimeError) as exc:  # a full disk, a truncated file: raised on every replica
                problem = Problem.of(exc)
            agree_objects(f"host embedding {self.name!r}: get_embedding_tensor", None, self._comm, problem=problem)
            shard = np.array(self.local_shard, dtype=self.master_dtype if master else self.dtype)
        else:
            shard = self.local_shard if master else self._serving
        return self._partition.assemble(all_gather(shard, comm=self._comm))

    def __repr__(self) -> str:
        master = f", master_weights={self.master_dtype}" if self.master_dtype != self.dtype else ""
        return (f"HostEmbedding({self.name!r}, shape={list(self.shape)}, dtype={self.dtype}{master}, "
                f"partition_strategy={self.partition_strategy!r}, exchange={self.exchange!r}, "
                f"id_limits={self.id_limits}, "
                f"local_shard={self.local_shard.shape})")


def create_host_embedding(name: str, shape, dtype=np.float32, partition_strategy: str = "TOKEN",
                          optimizer_spec: EmbeddingOptimizerSpec | None = None,
                          initializer: np.ndarray | Callable | None = None, seed: int = 0,
                          *, master_weights=None, stochastic_rounding=None, exchange: str | None = None,
                          max_ids_per_partition: int | None = None, max_unique_ids_per_partition: int | None = None,
                          allow_id_dropping: bool = False, enable_minibatching: bool = False,
                          track_id_stats: bool = False, storage=None,
                          comm=None) -> HostEmbedding:
    """Create a ``(t, e)`` embedding table partitioned over the replicas. Collective.

    Args:
        name: table name.
        shape: ``[t, e]``, number of tokens (rows) and encoding size (columns).
        dtype: the lookup dtype, float16, float32 (default) or float64: lookups return
            it, rows and gradients travel in it.
        master_weights: ``None`` (store in ``dtype``) or ``np.float32``/``np.float64``:
            the half- and mixed-precision tutorial's FP32 master weights ("Method 2: store and update the parameters in
            FP32"): the table is stored and updated in this dtype and served to lookups
            rounded to ``dtype``; optimizer state is float32 either way.
        stochastic_rounding: ``None``/``"OFF"`` (default), ``"ON"``,
            ``"REPLICA_IDENTICAL_ONLY"``, a :class:`StochasticRoundingBehaviour` or a
            :class:`StochasticRounding`: how updated rows are rounded when the storage
            dtype is float16 (the tutorial's "Method 1"). Rows have one owner, so ``ON`` is
            safe (per-replica stream); ``REPLICA_IDENTICAL_ONLY`` rounds them to nearest.
        partition_strategy: ``"TOKEN"`` (row ``i`` on replica ``i % r``) or
            ``"ENCODING"`` (replica ``k`` holds columns ``[k*c, (k+1)*c)``, ``c = ceil(e/r)``).
        optimizer_spec: an :class:`EmbeddingOptimizerSpec`: :class:`HostEmbeddingOptimizerSpec`
            (SGD), :class:`HostEmbeddingSGDGAOptimizerSpec`, momentum, Adagrad or Adam;
            ``None`` or a learning rate of 0 means not trainable.
        initializer: ``None`` (uniform in ``[-0.05, 0.05)`` as Keras's ``Embedding``,
            from counter-based random blocks of ``seed``, so the table is identical for
            every replica count and strategy), a full ``(t, e)`` array, or a callable
            ``initializer(shape, dtype) -> (t, e) array``; an array or callable must give
            the same table on every replica.
        seed: seed of the default initializer.
        exchange: how lookups and updates move data, the same on every replica:
            ``"sparse"`` (TOKEN only; the default for TOKEN): deduplicated indices go to
            their owner only with all-to-alls (TorchRec row-wise / SparseCore style,
            :mod:`popdist_lite.embedding.sparse`); ``"dense"``: the TF-IPU guide's algorithm
            (all-gather, mask, reduce-scatter-sum for TOKEN; all-gather and all-to-all for
            ENCODING, its only exchange). ``None`` picks the default.
        max_ids_per_partition, max_unique_ids_per_partition: TOKEN tables only: the most
            IDs (with duplicates / distinct) one replica may send to one owner replica in
            one call (SparseCore's ``TableSpec`` limits; ``None``: no limit). The sparse
            exchange's buffers are sized from them once. Exceeding one raises
            :class:`~popdist_lite.embedding.id_limits.settings.IdLimitError` on every replica unless
            one of the next two options is set. Docs: ``docs/minibatching.md``.
        allow_id_dropping: drop the IDs beyond a limit instead (rows read as zeros,
            gradients ignored; the choice is in :mod:`popdist_lite.embedding.id_limits.partitions`).
        enable_minibatching: split an exceeding call into minibatches by ID hash bucket
            instead (:mod:`popdist_lite.embedding.id_limits.enforcer`); results equal one pass.
        track_id_stats: publish per-call ID statistics (:mod:`popdist_lite.embedding.id_limits.stats`)
            even without limits (costs one small all-gather per call).
        storage: ``None``/``"memory"`` (default): the partition and its optimizer state
            are numpy arrays in RAM; a :class:`DiskStorage`: they live in a file on
            local disk behind a cache of hot rows of ``cache_bytes`` (LRU or LFU), with
            the same results (``docs/offload.md``). Every replica must pass the same kind
            (cache sizes may differ). With :class:`HostEmbeddingSGDGAOptimizerSpec` the
            cache must hold the distinct rows of ``accumulation_factor`` calls (its
            application updates every row accumulated since the last one).

    Returns:
        :class:`HostEmbedding`.

    Raises:
        ValueError: an unknown strategy or exchange, ``"sparse"`` with ENCODING, a bad
            shape, or arguments that differ between replicas (on every replica).
        TypeError: an unsupported dtype, master dtype or optimizer spec.
    """
    topology.init()
    comm = topology.replica_comm() if comm is None else comm
    problem = spec = disk = None
    try:
        disk = as_storage(storage)
        spec = TableSpec.from_arguments(
            name, shape, dtype, partition_strategy, optimizer_spec, seed, master_weights=master_weights,
            stochastic_rounding=stochastic_rounding, exchange=exchange, max_ids_per_partition=max_ids_per_partition,
            max_unique_ids_per_partition=max_unique_ids_per_partition, allow_id_dropping=allow_id_dropping,
            enable_minibatching=enable_minibatching, track_id_stats=track_id_stats)
        if disk is not None and spec.trainable and "replicated" in spec.optimizer_spec.state_layouts().values() \
                and not isinstance(spec.optimizer_spec, HostEmbeddingSGDGAOptimizerSpec):
            raise TypeError(f"argument storage: a DiskStorage table cannot take {type(optimizer_spec).__name__} "
                            f"(its update reads state of rows it does not touch); use an in-memory table")
    except (ValueError, TypeError) as exc:
        problem = Problem.of(exc)
    # Creation is rare: a pickled agreement keeps the check simple.
    signature = None if spec is None else spec.signature() + ("memory" if disk is None else "disk",)
    gathered = agree_objects(f"create_host_embedding({name!r})", signature, comm, problem=problem)
    for r, item in enumerate(gathered):
        if item != gathered[0]:
            raise ValueError(f"create_host_embedding({name!r}): replica {r} passed (name, shape, dtype, "
                             f"strategy, optimizer, seed, master weights, stochastic rounding, exchange, id limits, storage) = "
                             f"{item}, expected {gathered[0]} as on replica 0")
    return HostEmbedding(spec, initializer, comm, disk)


def _prepare(spec: TableSpec, indices: np.ndarray, clip_indices: bool, grads=None):
    """Check this replica's arguments to a lookup or update locally (no communication).

    Indices and gradients may have any memory layout (strided views, negative strides,
    Fortran order): what the exchanges get is C-contiguous, as MPI buffers must be,
    copied only when the caller's array is not already C-contiguous in the right dtype.

    Returns ``(flat C-contiguous int64[n], grads C-contiguous (n, e) of the lookup dtype
    or None, Problem or None)``; the problem is raised on every replica by the exchange.
    """
    t, e = spec.shape
    problem = None
    flat = np.zeros(0, dtype=np.int64)
    if indices.dtype.kind not in "iu":
        problem = Problem(TypeError, f"host embedding {spec.name!r}: argument indices: expected an integer "
                                     f"dtype, got {indices.dtype}")
    else:
        # Indices of any layout (strided, negative strides, Fortran order) become one
        # C-contiguous int64 array, as MPI takes them; no copy of C-contiguous int64
        # indices unless clipping writes to them (the exchanges only read).
        flat = indices.reshape(-1).astype(np.int64, order="C", copy=bool(clip_indices))
        if clip_indices:
            np.clip(flat, 0, t - 1, out=flat)
    if grads is not None and problem is None:
        grads = np.asarray(grads)
        want = indices.shape + (e,)
        if grads.shape != want:
            problem = Problem(ValueError, f"host embedding {spec.name!r}: argument grads: expected shape "
                                          f"indices.shape + (e,) = {want}, got {grads.shape}")
        elif grads.dtype.kind != "f":
            problem = Problem(TypeError, f"host embedding {spec.name!r}: argument grads: expected a floating "
                                         f"dtype, got {grads.dtype}")
        else:
            grads = np.ascontiguousarray(grads.reshape(-1, e), dtype=spec.dtype)
    return flat, grads, problem


def _prepare_bags(spec: TableSpec, values, lengths, weights, combiner, padding_id, clip_indices):
    """``(bags, flat, problem)``: a local problem is raised on every replica by the exchange."""
    try:
        bags = combiners.make_bags(values, lengths, weights, combiner, padding_id)
    except (ValueError, TypeError) as exc:
        empty = np.zeros(0, dtype=np.int64)
        bags = combiners.Bags(empty, np.zeros(0), empty, empty, (0,))
        return bags, empty, Problem(type(exc), f"host embedding {spec.name!r}: {exc}")
    flat, _, problem = _prepare(spec, bags.ids, clip_indices)
    return bags, flat, problem
