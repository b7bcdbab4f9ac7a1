"""This replica's rows of a host table (or of a stack of tables): :class:`Shard`.

What a replica holds of a table, whatever its placement and exchange: the master
weights (in memory, or in a partition file on local disk behind a cache of hot rows,
:class:`~popdist_lite.embedding.storage.disk.DiskRows`), the serving copy lookups read
(the master rows themselves, or their float16 rounding kept in step with every update),
the optimizer state of its rows and the stochastic rounding of updated float16 rows.
The exchanges gather rows with :meth:`Shard.take` and hand the summed gradients of the
touched rows to :meth:`Shard.apply`, which runs the optimizer spec once per row
(:mod:`popdist_lite.embedding.optimizer_specs`). Used by :class:`popdist_lite.HostEmbedding`
(one table) and by the collections (:mod:`popdist_lite.embedding.collection`), which
stack tables of one kind into one shard, as FBGEMM's table-batched embeddings do.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np

from ..collectives import Problem, agree_objects
from .optimizer_specs import EmbeddingOptimizerSpec, HostEmbeddingSGDGAOptimizerSpec, UpdateContext
from .state import layout_of
from .storage import DiskStorage
from .storage.disk import DiskRows
from .storage.rowfile import DROP_BYTES

_NO_ROWS = np.zeros(0, np.int64)


class Shard:
    """This replica's ``(rows, width)`` part of a table or stack.

    Args:
        name: names the shard in errors and its disk file.
        shape: ``(rows, width)`` of this replica's part.
        dtype: the lookup dtype (what :meth:`take` returns).
        master_dtype: the storage dtype of the weights.
        optimizer_spec: an :class:`EmbeddingOptimizerSpec` or ``None`` (not trainable).
        stochastic_rounding: the :class:`~popdist_lite.StochasticRounding` of updated
            float16 rows, or a :class:`RowRounding` (a stack's tables, each with its own).
        comm: the replica communicator (disk problems are agreed on it).
        storage: ``None`` (in memory) or a :class:`DiskStorage`.
        replicated: the rows are the same on every replica (a data-parallel table): the
            replica-identical rounding stream rounds them, so they stay the same.
        row_sum: ``x: (u, width) -> (u,)``, each touched row's sum over all its columns
            (across replicas when its columns are spread; default: a local sum).
        full_width: the table's row width ``e`` (``width`` unless columns are spread).

    Attributes:
        weights: the master weights ``(rows, width)`` (a disk shard's: the partition
            file's memory map, up to date after :meth:`sync`).
        serving: what lookups gather from (``take``): ``weights``, its float16 copy, or
            a disk shard's cache-backed rows.
        optimizer_state: slot -> array (this replica's rows only).
        disk: the :class:`DiskRows` of a disk shard, else ``None``.

    Raises:
        OSError, ValueError: on every replica, when a disk shard's file cannot be made
            on some replica (no such directory, no space, a cache smaller than a row).
    """

    def __init__(self, name: str, shape: tuple, dtype, master_dtype, optimizer_spec: EmbeddingOptimizerSpec | None,
                 stochastic_rounding, comm, storage: DiskStorage | None = None, *, replicated: bool = False,
                 row_sum=None, full_width: int | None = None):
        self.name, self.shape = name, tuple(shape)
        self.dtype, self.master_dtype = np.dtype(dtype), np.dtype(master_dtype)
        self.optimizer_spec, self.stochastic_rounding = optimizer_spec, stochastic_rounding
        self._rounding = stochastic_rounding if isinstance(stochastic_rounding, RowRounding) else \
            RowRounding([(0, self.shape[0], stochastic_rounding)])
        self.trainable = optimizer_spec is not None and optimizer_spec.trainable
        self.comm, self.replicated = comm, replicated
        self._row_sum, self.full_width = row_sum, full_width or self.shape[1]
        self.disk: DiskRows | None = None
        self._accumulated = _NO_ROWS  # SGD-GA on disk: local rows touched since the last application
        if storage is None:
            self.weights = np.zeros(self.shape, dtype=self.master_dtype)
            self.optimizer_state = optimizer_spec.init_state(self.shape) if self.trainable else {}
        else:  # a partition file holds one row at least (a table-wise table's replicas without it: one unused)
            self.shape = (max(self.shape[0], 1), self.shape[1])
            self.disk = _open_disk(name, self.shape, self.master_dtype, optimizer_spec, storage, comm)
            self.weights, self.optimizer_state = self.disk.weights, self.disk.slots
        self.serving = None  # set by initialized()

    def initial_writes(self):
        """What the initial rows are written to (``target[rows] = values``): the weights,
        or for a disk shard a writer that drops the file's pages every
        :data:`~popdist_lite.embedding.storage.rowfile.DROP_BYTES` written. Call
        :meth:`initialized` afterwards."""
        return self.weights if self.disk is None else _Writes(self.disk)

    def initialized(self) -> None:
        """The initial rows are in place: make the serving copy (release a disk shard's pages)."""
        if self.disk is not None:
            self.disk.release_pages()
            self.serving = self.disk.serving(self.dtype)
        else:
            self.serving = self.weights if self.master_dtype == self.dtype else self.weights.astype(self.dtype)

    # -- lookups and updates ----------------------------------------------------------------
    def update_context(self) -> UpdateContext:
        if self._row_sum is None:
            return UpdateContext(width=self.full_width)
        return UpdateContext(width=self.full_width, row_sum=self._row_sum)

    def apply(self, rows: np.ndarray, sums: np.ndarray, loss_scale: float = 1.0) -> None:
        """One optimizer step on this replica's ``rows`` (local, sorted, unique) with the
        summed gradients ``sums`` ``(u, width)``, divided by ``loss_scale`` in float32
        (at least). Collective for a disk shard (its problems are agreed)."""
        sums = sums.astype(np.result_type(sums.dtype, np.float32), copy=False)
        if loss_scale != 1.0:
            sums = sums / np.asarray(loss_scale, sums.dtype)
        if self.disk is not None:
            rows, sums, accumulated = self._with_accumulated_rows(rows, sums)
            self.disk.update(rows, functools.partial(self._apply_rows, rows, sums), self.comm)
            self._accumulated = accumulated
            return
        result = self.optimizer_spec.apply(self.weights, rows, sums, self.optimizer_state, self.update_context())
        if result is not None:
            written, values = result
            self.weights[written] = self._rounding.cast(written, values, self.master_dtype, self.replicated)
            if self.serving is not self.weights:
                self.serving[written] = self.weights[written].astype(self.dtype)

    def _with_accumulated_rows(self, rows: np.ndarray, sums: np.ndarray):
        """A disk shard's update reads and writes only the rows it is given; SGD-GA's
        application (every ``accumulation_factor``-th call) also changes the rows
        accumulated by the calls before. So that call is given them too, with zero sums
        (adding 0 to their accumulators changes nothing), and the spec's own ``apply``
        runs unchanged on the compact partition: the same rows, in the same ascending
        order, as the in-memory shard's application (so the same stochastic rounding
        draws). Returns ``(rows, sums, the rows accumulated after this call)``; the
        cache must hold the distinct rows of ``accumulation_factor`` calls."""
        spec = self.optimizer_spec
        if not isinstance(spec, HostEmbeddingSGDGAOptimizerSpec):
            return rows, sums, _NO_ROWS
        due = np.union1d(self._accumulated, rows).astype(np.int64, copy=False)
        if (int(self.optimizer_state["calls"][0]) + 1) % spec.accumulation_factor:
            return rows, sums, due
        full = np.zeros((due.size,) + sums.shape[1:], sums.dtype)
        full[np.searchsorted(due, rows)] = sums
        return due, full, _NO_ROWS

    def _apply_rows(self, rows: np.ndarray, sums: np.ndarray, shard: np.ndarray, state: dict):
        """A disk shard's optimizer step on its touched ``rows`` read out as a compact
        ``(u, c)`` partition: ``(written positions, values in the master dtype)`` or ``None``."""
        result = self.optimizer_spec.apply(shard, np.arange(len(sums)), sums, state, self.update_context())
        if result is None:
            return None
        written, values = result
        return written, self._rounding.cast(rows[written], values, self.master_dtype, self.replicated)

    # -- state ------------------------------------------------------------------------------
    def sync(self) -> None:
        """A disk shard writes its dirty rows back and empties its cache, so that
        :attr:`weights` and the file-backed slots are its truth (nothing in memory).

        Raises:
            RuntimeError: the partition file was truncated (it has no name, so nothing
                can replace it), or the cache's background thread broke the cache."""
        if self.disk is not None:
            self.disk.sync()

    def arrays(self) -> tuple[dict, dict]:
        """``(arrays, layouts)``: live references to ``"weights"`` and every
        ``"optimizer/<slot>"``, and each one's layout (``"table"``, ``"row"``,
        ``"replicated"``: :class:`~popdist_lite.embedding.state.TableState`). Call
        :meth:`sync` first on a disk shard."""
        arrays, layouts = {"weights": self.weights}, {"weights": "table"}
        declared = self.optimizer_spec.state_layouts() if self.optimizer_state else {}
        for slot, array in self.optimizer_state.items():
            arrays[f"optimizer/{slot}"] = array
            layouts[f"optimizer/{slot}"] = declared.get(slot) or layout_of(array, self.shape)
        return arrays, layouts

    def loaded(self, rows: slice = slice(None)) -> None:
        """The weights or state of ``rows`` were written from outside (a load): refresh
        the serving copy (a disk shard: drop the file's pages, rebuild SGD-GA's
        accumulated rows)."""
        if self.disk is not None:
            if isinstance(self.optimizer_spec, HostEmbeddingSGDGAOptimizerSpec):
                self._accumulated = np.flatnonzero(self.optimizer_state["touched"]).astype(np.int64)
            self.disk.release_pages()
        elif self.serving is not self.weights:
            np.copyto(self.serving[rows], self.weights[rows], casting="unsafe")

    @property
    def optimizer_state_bytes(self) -> int:
        return int(sum(a.nbytes for a in self.optimizer_state.values()))


def _open_disk(name: str, shape: tuple, master_dtype, optimizer_spec, storage: DiskStorage, comm) -> DiskRows:
    """This replica's partition file and cache. Collective: a replica that cannot make
    its file (no such directory, no space, a cache smaller than one row) fails them all."""
    problem, disk = None, None
    try:
        disk = DiskRows(name, comm.rank, shape, master_dtype, optimizer_spec, storage)
    except (OSError, ValueError) as exc:
        problem = Problem.of(exc)
    try:
        agree_objects(f"create_host_embedding({name!r}, storage={storage})", None, comm, problem=problem)
    except BaseException:
        if disk is not None:
            disk.close()  # another replica failed: this one's file goes now, not when collected
        raise
    return disk


class RowRounding:
    """The stochastic rounding of a shard whose rows belong to several tables (a stack),
    each table with its own :class:`~popdist_lite.StochasticRounding`: a table's updated
    rows are rounded with its streams, in their order, as the table alone would round
    them (the same draws whatever else the stack holds).

    Args:
        tables: ``(first row, rows, rounding)`` of each table in the shard (ranges
            apart; tables without rows here are left out).
    """

    def __init__(self, tables: list):
        held = sorted((int(first), rounding) for first, n, rounding in tables if n > 0) or \
            [(0, tables[0][2])]
        self.starts = np.array([first for first, _ in held], np.int64)
        self.roundings = [rounding for _, rounding in held]

    def cast(self, rows: np.ndarray, values: np.ndarray, dtype, replicated: bool) -> np.ndarray:
        """``values`` of the shard's ``rows`` (ascending) as ``dtype``: float16 through
        each row's table's rounding (:meth:`popdist_lite.StochasticRounding.cast`),
        wider dtypes a plain cast."""
        first = self.roundings[0]
        if len(self.roundings) == 1 or np.dtype(dtype) != np.float16 or not first.stochastic(replicated):
            return first.cast(values, dtype, replicated=replicated)  # one table, or no random draws
        rows = np.asarray(rows)
        cuts = np.searchsorted(rows, self.starts[1:])  # rows ascending: each table's rows are one run
        out = np.empty(values.shape, np.float16)
        for rounding, a, b in zip(self.roundings, np.concatenate([[0], cuts]), np.concatenate([cuts, [rows.size]])):
            if b > a:
                out[a:b] = rounding.cast(values[a:b], dtype, replicated=replicated)
        return out


class _Writes:
    """The rows a disk shard's initial values are written into: the partition file's
    weights map, its pages written back and dropped every
    :data:`~popdist_lite.embedding.storage.rowfile.DROP_BYTES`, as the file's reads and writes."""

    def __init__(self, disk: DiskRows):
        self.disk, self.pending = disk, 0

    def __setitem__(self, key, value) -> None:
        self.disk.weights[key] = value
        # the records' bytes, not the weights': every page of a record written is dirtied
        self.pending += (np.shape(value)[0] if np.ndim(value) else 1) * self.disk.record.itemsize
        if self.pending >= DROP_BYTES:
            self.disk.release_pages()
            self.pending = 0

    def view(self, start: int, stop: int) -> "_Rows":
        """Rows ``[start, stop)`` as a target of their own (a table's rows in a stack)."""
        return _Rows(self, start, stop)


class _Rows:
    """Rows ``[start, stop)`` of a :class:`_Writes` target (indices relative to ``start``)."""

    def __init__(self, writes: _Writes, start: int, stop: int):
        self.writes, self.start, self.stop = writes, start, stop
        self.shape = (stop - start, writes.disk.shard_shape[1])

    def __setitem__(self, key, value) -> None:
        rows = range(self.start, self.stop)
        if isinstance(key, tuple):
            first, *rest = key
            self.writes[(_shift(first, rows),) + tuple(rest)] = value
        else:
            self.writes[_shift(key, rows)] = value


def _shift(key, rows: range):
    """A row index of a :class:`_Rows` as one of the whole target."""
    if isinstance(key, slice):
        part = rows[key]
        return slice(part.start, part.stop, part.step)
    return rows[key] if isinstance(key, (int, np.integer)) else np.asarray(rows)[key]


#: Rows per block of the default initializer (each block its own random stream).
INIT_BLOCK_ROWS = 1 << 15


def default_blocks(shape: tuple, dtype, seed: int, low: float = -0.05, high: float = 0.05):
    """The default initial table, block by block: ``(first row, rows)`` uniform in
    ``[low, high)``, from counter-based random blocks of ``seed`` (block ``i`` of
    :data:`INIT_BLOCK_ROWS` rows from ``default_rng([seed, i])``), so the table is the
    same for every replica count, strategy and placement, and no replica makes more
    than a block of it at once."""
    t, e = shape
    for first in range(0, t, INIT_BLOCK_ROWS):
        rng = np.random.default_rng([seed, first // INIT_BLOCK_ROWS])
        n = min(INIT_BLOCK_ROWS, t - first)
        yield first, (rng.random((n, e), dtype=np.float32) * (high - low) + low).astype(dtype)


def initial_table(initializer, shape: tuple, dtype):
    """``(table, problem, crc)`` of a given initializer (an array or
    ``initializer(shape, dtype)``): the table in ``dtype``, a :class:`Problem` when it
    has another shape, and the crc32 of its bytes that replicas compare."""
    table = np.asarray(initializer(shape, dtype) if callable(initializer) else initializer)
    if table.shape != tuple(shape):
        return None, Problem(ValueError, f"initializer: expected a table of shape {tuple(shape)}, got "
                                         f"{table.shape}"), None
    table = np.ascontiguousarray(table, dtype=dtype)
    return table, None, zlib.crc32(table.tobytes())


def different_table(what: str, crcs: list) -> ValueError | None:
    """The error when replicas' initial tables (``crcs``, in replica order) differ."""
    if len(set(crcs)) > 1:
        r = next(i for i, c in enumerate(crcs) if c != crcs[0])
        return ValueError(f"{what}: initializer: replica {r} has a different initial table from replica 0; pass "
                          f"the same array (or a deterministic callable) everywhere")
    return None


def initialize(shard, partition, spec, initializer, comm) -> None:
    """Write the initial values of this replica's ``shard`` of the table of ``spec``
    (collective when ``initializer`` is given: every replica must pass the same table).
    ``partition`` has ``shard_from_block(block, first_row, shard)`` (the strategies'
    partitions, :class:`~popdist_lite.embedding.placement.TableLayout`).

    Raises:
        ValueError: on every replica, for a table of the wrong shape on any replica or
            tables that differ between replicas.
    """
    if initializer is None:
        for first, block in default_blocks(spec.shape, spec.master_dtype, spec.seed):
            partition.shard_from_block(block, first, shard)
        return
    table, problem, crc = initial_table(initializer, spec.shape, spec.master_dtype)
    crcs = agree_objects(f"host embedding {spec.name!r}", crc, comm, problem=problem)  # creation is rare
    error = different_table(f"host embedding {spec.name!r}", crcs)
    if error is not None:
        raise error
    partition.shard_from_block(table, 0, shard)
