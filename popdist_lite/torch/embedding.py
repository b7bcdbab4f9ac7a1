"""Sharded host embeddings as ``torch.nn.Module``\\ s whose backward applies the update.

:class:`HostEmbedding` and :class:`HostEmbeddingBag` hold no ``nn.Parameter``: the table
is a :func:`popdist_lite.create_host_embedding` table, partitioned over the replicas, and
its optimizer (the table's ``optimizer_spec``: SGD, SGD-GA, momentum, Adagrad, Adam) runs
on the host inside the backward pass. That is how fbgemm's
``SplitTableBatchedEmbeddingBagsCodegen`` (TorchRec's fused embeddings) and the TF-IPU
host-embedding guide's lookup gradient work: the backward updates the table in place and
returns no gradient for it.

The lookup is one ``torch.autograd.Function`` (:class:`_HostLookup`):

- forward: the table's exchange (:meth:`popdist_lite.HostEmbedding.lookup` or
  :meth:`~popdist_lite.HostEmbedding.lookup_bags`); the indices reach it as
  ``Tensor.numpy()`` views and the rows come back through ``torch.from_numpy``, no copy.
- backward: the table's update (:meth:`~popdist_lite.HostEmbedding.apply_gradients` or
  :meth:`~popdist_lite.HostEmbedding.apply_bag_gradients`) with the output's gradient,
  again without a copy. Autograd only calls a Function's backward when one of its inputs
  requires a gradient, so each module holds a zero-element ``anchor`` tensor that does
  (not a parameter: optimizers and :class:`~popdist_lite.torch.DistributedDataParallel`
  never see it); its gradient is ``None``.

Every replica runs the same graph, so the lookups and updates are collectives in the same
order everywhere; an error found on one replica (a bad index, a malformed bag) is raised
on every replica by the table's checks (the bag module hands its own check of the torch
arguments to the table's lookup) or, at construction, by :mod:`._agree`.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

import popdist_lite as pl

from popdist_lite.collectives import Problem

from ._agree import agree_signatures

__all__ = ["HostEmbedding", "HostEmbeddingBag"]

_DTYPES = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}
_OPS = ("mean", "sum")
_MODES = ("sum", "mean", "sqrtn")
_names = itertools.count()
_BAGS = "torch.HostEmbeddingBag"  # how a bag argument's problem is named when raised
_NO_IDS = np.zeros(0, np.int64)
_NO_LENGTHS = np.zeros(0, np.int64)


class _BagProblem(Problem):
    """A malformed torch argument of :class:`HostEmbeddingBag` on one replica, handed to
    the table's lookup: the table's first agreement (the collective it runs anyway)
    raises it on every replica as ``torch.HostEmbeddingBag: replica k: ...``, whichever
    collective carries it, so the module's check costs no collective of its own."""

    __slots__ = ()

    def raise_as(self, op: str, replica: int):
        Problem.raise_as(self, _BAGS, replica)


class _HostLookup(torch.autograd.Function):
    """forward(anchor, module, arguments, *tensors) = ``module._lookup(arguments)``; backward applies
    ``module._update(arguments, grad)`` once (a second backward through a retained graph
    finds the update done and applies nothing). ``tensors`` are the caller's index,
    offset and weight tensors, saved so that autograd's version counters reject an
    in-place change between forward and backward."""

    @staticmethod
    def forward(ctx, anchor, module, arguments, *tensors):
        ctx.module, ctx.arguments, ctx.applied = module, arguments, False
        ctx.save_for_backward(*tensors)
        return module._lookup(arguments)

    @staticmethod
    def backward(ctx, grad):
        ctx.saved_tensors  # noqa: B018  (raises if the indices were modified in place)
        if not ctx.applied:
            ctx.applied = True
            ctx.module._apply_gradient(ctx.arguments, grad)
        return (None,) * len(ctx.needs_input_grad)


class _HostTableModule(torch.nn.Module):
    """What :class:`HostEmbedding` and :class:`HostEmbeddingBag` share: the table, its
    arguments, the gradient reduction and loss scaling, the autograd plumbing."""

    def __init__(self, kind: str, num_embeddings: int, embedding_dim: int, *, partition_strategy: str,
                 optimizer_spec, dtype, seed: int, padding_idx, op: str, grad_scaler, name, extra: tuple,
                 problem, table_options: dict):
        super().__init__()
        pl.init()
        comm = table_options.get("comm") or pl.replica_comm()
        if problem is None:
            problem = _check_common(num_embeddings, padding_idx, op, dtype)
        if problem is None and padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.name = name if name is not None else f"torch.{kind}.{next(_names)}"
        agree_signatures(f"popdist_lite.torch.{kind}({self.name!r})",
                         (num_embeddings, embedding_dim, padding_idx, op, str(dtype), *extra), comm, problem)
        if isinstance(table_options.get("master_weights"), torch.dtype):
            table_options["master_weights"] = _DTYPES.get(table_options["master_weights"],
                                                          table_options["master_weights"])
        #: The :class:`popdist_lite.HostEmbedding` table (its ``spec``, ``local_shard``,
        #: ``optimizer_state``, ``state()``).
        self.table = pl.create_host_embedding(self.name, [num_embeddings, embedding_dim], dtype=_DTYPES[dtype],
                                              partition_strategy=partition_strategy, optimizer_spec=optimizer_spec,
                                              seed=seed, **table_options)
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.dtype, self.op, self.grad_scaler = dtype, op, grad_scaler
        self._comm = comm
        # A zero-element leaf that requires a gradient: autograd calls the lookup's
        # backward only when an input does. Not a Parameter: nothing else sees it.
        self._anchor = torch.empty(0, requires_grad=True)

    def _run(self, arguments, *tensors) -> torch.Tensor:
        if self.training and torch.is_grad_enabled() and self.table.spec.trainable:
            return _HostLookup.apply(self._anchor, self, arguments, *tensors)
        return self._lookup(arguments)

    def _apply_gradient(self, arguments, grad: torch.Tensor) -> None:
        """The table's update with ``grad``, the gradient of this replica's output
        (scaled by the loss scale when a :class:`GradScaler` is attached). Collective."""
        grad = grad.detach()
        if grad.dtype != self.dtype:
            grad = grad.to(self.dtype)
        grad = grad.contiguous().numpy()
        scale = 1.0
        if self.grad_scaler is not None:
            scale = self.grad_scaler.get_scale()
            if self.grad_scaler._found_overflow(grad):
                return  # every replica skips: the verdict is agreed
        if self.op == "mean":
            scale *= self._comm.size
        self._update(arguments, grad, scale)

    def get_embedding_tensor(self, master: bool = False) -> torch.Tensor:
        """The full ``(num_embeddings, embedding_dim)`` table on every replica, as
        TF-IPU's ``HostEmbedding.get_embedding_tensor``. Collective (an all-gather).

        Args:
            master: the FP32 master weights (``master_weights=``) instead of the
                values lookups serve.

        Returns:
            a new CPU tensor (``self.dtype``; the master dtype with ``master=True``).
        """
        return torch.from_numpy(self.table.get_embedding_tensor(master=master))

    def extra_repr(self) -> str:
        spec = self.table.spec
        return (f"{self.num_embeddings}, {self.embedding_dim}, name={self.name!r}, "
                f"partition_strategy={spec.partition_strategy!r}, exchange={spec.exchange!r}, "
                f"optimizer_spec={spec.optimizer_spec}, dtype={self.dtype}, op={self.op!r}"
                + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""))


class HostEmbedding(_HostTableModule):
    """``torch.nn.Embedding`` over a table sharded across the replicas, updated in the
    backward pass by the table's own optimizer.

    Args:
        num_embeddings, embedding_dim: the table's shape ``(t, e)``.
        partition_strategy: ``"TOKEN"`` (row ``i`` on replica ``i % r``) or ``"ENCODING"``
            (columns split), see :func:`popdist_lite.create_host_embedding`.
        optimizer_spec: a ``popdist_lite.HostEmbedding*OptimizerSpec`` (SGD, SGD-GA,
            momentum, Adagrad, Adam); ``None`` or a learning rate of 0: not trainable.
        dtype: ``torch.float16``, ``torch.float32`` or ``torch.float64``: the lookup dtype
            (outputs and gradients).
        seed: seed of the table's default initializer (uniform in ``[-0.05, 0.05)``, the
            same table for any replica count and strategy).
        padding_idx: positions holding this index read as zeros and receive no update
            (``nn.Embedding``'s behaviour with its zero-initialised padding row; the row
            itself is never read). Negative values count from the end.
        op: how the replicas' gradients combine: ``"mean"`` (default: the gradient of the
            mean of the replicas' losses, what ``DistributedDataParallel`` does for dense
            parameters, so embedding and dense updates follow the same global loss) or
            ``"sum"``. The division by the replica count happens after the sum, in float32.
        grad_scaler: a :class:`popdist_lite.torch.GradScaler` when the loss is scaled: the
            gradient is divided by its scale, and a gradient with inf/NaN on any replica
            skips the update on every replica and is reported to the scaler.
        name: the table's name (default ``torch.HostEmbedding.<n>``, numbered in
            creation order: the same on every replica when they create their modules in
            the same order).
        **table_options: the rest of :func:`popdist_lite.create_host_embedding`:
            ``master_weights`` (e.g. ``torch.float32`` with ``dtype=torch.float16``),
            ``stochastic_rounding``, ``exchange`` (``"sparse"``/``"dense"``),
            ``max_ids_per_partition``, ``max_unique_ids_per_partition``,
            ``allow_id_dropping``, ``enable_minibatching``, ``track_id_stats``,
            ``initializer``, ``storage`` (a :class:`popdist_lite.DiskStorage`: the
            table's partition on local disk behind a cache of hot rows,
            docs/offload.md), ``comm``.

    Forward: ``input`` an integer tensor of any shape (CPU); returns
    ``input.shape + (embedding_dim,)`` of ``dtype``. Collective.

    Training: in training mode with gradients enabled, the backward of the output applies
    one optimizer step to the rows looked up (every replica's gradients for a row summed,
    divided by the replica count for ``op="mean"``), once, however many times the graph is
    run backward (``retain_graph=True``). Under ``torch.no_grad()``, in eval mode, or for
    a table that is not trainable, a lookup records nothing and never updates.

    Raises:
        ValueError, TypeError: on every replica, for any replica's bad arguments
            (construction) or bad indices (``IndexError`` for out-of-range).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, partition_strategy: str = "TOKEN",
                 optimizer_spec=None, dtype=torch.float32, seed: int = 0, padding_idx: int | None = None,
                 op: str = "mean", grad_scaler=None, name: str | None = None, **table_options):
        super().__init__("HostEmbedding", num_embeddings, embedding_dim, partition_strategy=partition_strategy,
                         optimizer_spec=optimizer_spec, dtype=dtype, seed=seed, padding_idx=padding_idx, op=op,
                         grad_scaler=grad_scaler, name=name, extra=(), problem=None, table_options=table_options)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._run((_numpy(input),), input)

    def _lookup(self, arguments) -> torch.Tensor:
        (indices,) = arguments
        if self.padding_idx is None:
            return torch.from_numpy(self.table.lookup(indices))
        keep = indices != self.padding_idx
        out = np.zeros(indices.shape + (self.embedding_dim,), self.table.dtype)
        out[keep] = self.table.lookup(indices[keep])
        return torch.from_numpy(out)

    def _update(self, arguments, grad: np.ndarray, loss_scale: float) -> None:
        (indices,) = arguments
        if self.padding_idx is None:
            self.table.apply_gradients(indices, grad, loss_scale=loss_scale)
        else:
            keep = indices != self.padding_idx
            self.table.apply_gradients(indices[keep], grad[keep], loss_scale=loss_scale)


class HostEmbeddingBag(_HostTableModule):
    """``torch.nn.EmbeddingBag`` over a table sharded across the replicas: pooled
    lookups of bags of indices, updated in the backward pass (see :class:`HostEmbedding`
    for the table, training and gradient semantics).

    Args:
        mode: the combiner, ``"sum"``, ``"mean"`` (``nn.EmbeddingBag``'s) or ``"sqrtn"``
            (SparseCore's: divided by the square root of the sum of squared weights).
            ``"max"`` is not supported.
        include_last_offset: as ``nn.EmbeddingBag``: ``offsets`` has one more entry than
            there are bags, the last equal to ``input.numel()``.
        padding_idx: entries holding this index are left out of their bag (of the sum
            and of the ``"mean"`` divisor), as ``nn.EmbeddingBag``.
        the others: as :class:`HostEmbedding`.

    Forward ``(input, offsets=None, per_sample_weights=None)``, as ``nn.EmbeddingBag``:

    - ``input`` 2-D ``(B, N)``: ``B`` bags of ``N`` indices, ``offsets`` must be ``None``;
    - ``input`` 1-D with ``offsets`` 1-D: bag ``b`` holds ``input[offsets[b]:offsets[b+1]]``
      (``offsets[0] == 0``, non-decreasing); an empty bag pools to zeros;
    - ``per_sample_weights`` (optional, the shape of ``input``, real): each index's
      weight. With ``"mean"``/``"sqrtn"`` they also set the divisor (the sum of the weights,
      the root of the sum of their squares; ``nn.EmbeddingBag`` allows weights with
      ``"sum"`` only). They are constants: a ``per_sample_weights`` that requires a
      gradient is an error.

    Returns ``(B, embedding_dim)`` of ``dtype``: the table's
    :meth:`~popdist_lite.HostEmbedding.lookup_bags` (bags of one ID of scale 1 are the
    looked-up rows themselves, no copy), and in backward its
    :meth:`~popdist_lite.HostEmbedding.apply_bag_gradients` with the output's gradient.
    Collective: the table's exchange and nothing more; a malformed torch argument on
    any replica travels in the table's own agreement and is raised on every replica.

    Raises:
        ValueError, TypeError: on every replica, for any replica's malformed input,
            offsets or weights (naming the replica and the argument).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, mode: str = "mean",
                 partition_strategy: str = "TOKEN", optimizer_spec=None, dtype=torch.float32, seed: int = 0,
                 padding_idx: int | None = None, include_last_offset: bool = False, op: str = "mean",
                 grad_scaler=None, name: str | None = None, **table_options):
        problem = None
        if mode not in _MODES:
            problem = Problem(ValueError, f"argument mode: expected one of {', '.join(map(repr, _MODES))}, "
                                          f"got {mode!r}")
        super().__init__("HostEmbeddingBag", num_embeddings, embedding_dim, partition_strategy=partition_strategy,
                         optimizer_spec=optimizer_spec, dtype=dtype, seed=seed, padding_idx=padding_idx, op=op,
                         grad_scaler=grad_scaler, name=name, extra=(mode, bool(include_last_offset)),
                         problem=problem, table_options=table_options)
        self.mode, self.include_last_offset = mode, bool(include_last_offset)

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        problem, bags = _make_bags(input, offsets, per_sample_weights, self.include_last_offset, self.padding_idx)
        if problem is not None:  # raised on every replica by the table's lookup
            problem = _BagProblem(problem.error, f"module {self.name!r}: {problem.message}")
            bags = (_NO_IDS, _NO_LENGTHS, None, (0,))
        tensors = [t for t in (input, offsets, per_sample_weights) if t is not None]
        return self._run(_Bags(*bags, problem), *tensors)

    def _lookup(self, bags: "_Bags") -> torch.Tensor:
        pooled = self.table._lookup_bags(bags.values, bags.lengths, bags.weights, self.mode, problem=bags.problem)
        return torch.from_numpy(pooled).reshape(bags.shape + (self.embedding_dim,))

    def _update(self, bags: "_Bags", grad: np.ndarray, loss_scale: float) -> None:
        self.table.apply_bag_gradients(bags.values, grad.reshape(bags.count, self.embedding_dim), bags.lengths,
                                       bags.weights, combiner=self.mode, loss_scale=loss_scale)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", mode={self.mode!r}" + \
            (", include_last_offset=True" if self.include_last_offset else "")


class _Bags:
    """One replica's bags as the table's ragged bags: ``values`` int[n] (padding
    removed), ``lengths`` int64[B], ``weights`` float[n] or None, ``count`` = B bags of
    batch ``shape``; ``problem``: this replica's :class:`_BagProblem` (then no bags),
    raised on every replica by the table's lookup.
    :meth:`popdist_lite.HostEmbedding.lookup_bags` and
    :meth:`~popdist_lite.HostEmbedding.apply_bag_gradients` pool and unpool them
    (SparseCore's combiners, :mod:`popdist_lite.embedding.combiners`)."""

    def __init__(self, values, lengths, weights, shape, problem=None):
        self.values, self.lengths, self.weights, self.shape = values, lengths, weights, shape
        self.count, self.problem = lengths.size, problem


def _numpy(t) -> np.ndarray:
    """A CPU tensor's numpy view (no copy); other objects through ``np.asarray`` (the
    table's checks reject what is not an integer array, on every replica)."""
    if isinstance(t, torch.Tensor):
        return t.detach().numpy() if t.device.type == "cpu" else t.detach().cpu().numpy()
    return np.asarray(t)


def _check_common(num_embeddings, padding_idx, op, dtype) -> Problem | None:
    if dtype not in _DTYPES:
        return Problem(TypeError, f"argument dtype: expected torch.float16, torch.float32 or torch.float64, "
                                  f"got {dtype}")
    if op not in _OPS:
        return Problem(ValueError, f"argument op: expected 'mean' or 'sum', got {op!r}")
    if padding_idx is not None:
        if isinstance(padding_idx, bool) or not isinstance(padding_idx, int) \
                or not -num_embeddings <= padding_idx < num_embeddings:
            return Problem(ValueError, f"argument padding_idx: expected None or an integer in "
                                       f"[-{num_embeddings}, {num_embeddings}), got {padding_idx!r}")
    return None


def _make_bags(input, offsets, weights, include_last_offset: bool, padding_idx):
    """``(problem, (values, lengths, weights, shape))``: ``nn.EmbeddingBag``'s arguments
    as ragged bags (``values`` int[n] without padding, ``lengths`` int64[B], ``weights``
    float[n] or None, the batch ``shape``). Local; the caller raises the :class:`Problem`
    on every replica."""
    if not isinstance(input, torch.Tensor) or input.dim() not in (1, 2):
        got = f"a {input.dim()}-D tensor" if isinstance(input, torch.Tensor) else type(input).__name__
        return Problem(ValueError, f"argument input: expected a 1-D or 2-D tensor, got {got}"), None
    if input.dtype.is_floating_point or input.dtype.is_complex or input.dtype == torch.bool:
        return Problem(TypeError, f"argument input: expected an integer tensor, got {input.dtype}"), None
    values = _numpy(input)
    w = None
    if weights is not None:
        if not isinstance(weights, torch.Tensor) or weights.shape != input.shape or weights.dtype.is_complex:
            got = (f"{weights.dtype}{list(weights.shape)}" if isinstance(weights, torch.Tensor)
                   else type(weights).__name__)
            return Problem(ValueError, f"argument per_sample_weights: expected a real tensor of the shape of input "
                                f"{list(input.shape)}, got {got}"), None
        if weights.requires_grad:
            return Problem(ValueError, "argument per_sample_weights: weights that require a gradient are not supported "
                                "(they are constants of the lookup)"), None
        w = _numpy(weights).reshape(-1)
    if input.dim() == 2:
        if offsets is not None:
            return Problem(ValueError, "argument offsets: expected None with 2-D input (each row is a bag), got a "
                                "tensor"), None
        shape = (values.shape[0],)
        lengths = np.full(values.shape[0], values.shape[1], np.int64)
        values = values.reshape(-1)
    else:
        if offsets is None:
            return Problem(ValueError, "argument offsets: expected a 1-D integer tensor with 1-D input, got None"), None
        o = _numpy(offsets)
        if o.ndim != 1 or o.dtype.kind not in "iu":
            return Problem(TypeError, f"argument offsets: expected a 1-D integer tensor, "
                                      f"got {o.dtype}{list(o.shape)}"), None
        n = values.size
        if include_last_offset and (o.size == 0 or o[-1] != n):
            return Problem(ValueError, f"argument offsets: with include_last_offset, expected a last offset equal to "
                                f"input.numel() = {n}, got {o[-1] if o.size else 'no offsets'}"), None
        starts = o[:-1] if include_last_offset else o
        ends = o[1:] if include_last_offset else np.append(o[1:], n)
        if starts.size and (starts[0] != 0 or np.any(ends < starts) or ends[-1] > n):
            shown = o.tolist() if o.size <= 8 else o[:8].tolist() + ["..."]
            return Problem(ValueError, f"argument offsets: expected non-decreasing offsets starting at 0, at most "
                                f"input.numel() = {n}, got {shown}"), None
        lengths = (ends - starts).astype(np.int64)
        shape = (lengths.size,)
    if padding_idx is not None and values.size:
        keep = values != padding_idx
        bag = np.repeat(np.arange(lengths.size), lengths)
        lengths = np.bincount(bag[keep], minlength=lengths.size).astype(np.int64)
        values = values[keep]
        w = None if w is None else w[keep]
    return None, (values, lengths, w, shape)
