"""Data parallelism for a torch model's dense parameters over the replicas.

- :func:`broadcast_parameters`: every replica takes the root's parameters and buffers
  (sorted by name, as Horovod's ``broadcast_parameters``, so every replica goes in the
  same order).
- :func:`all_reduce_gradients`: a blocking, fused all-reduce of the gradients after
  backward (Horovod's tensor fusion: one message per dtype).
- :class:`DistributedDataParallel`: the shape of ``torch.nn.parallel.DistributedDataParallel``:
  gradients are all-reduced in flat buckets, each started without blocking
  (:func:`popdist_lite.collectives.all_reduce_start`) as soon as its last gradient is
  ready, while backward still computes the rest, and waited for when backward ends.

``allreduce_gradients`` is an alias of :func:`all_reduce_gradients` (the earlier
spelling), kept for existing code.

Host embeddings (:mod:`popdist_lite.torch.embedding`) hold no ``nn.Parameter``, so none of
these ever touches them: their updates happen in their own backward.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

import popdist_lite as pl

from popdist_lite.calls import numbered
from popdist_lite.collectives import Problem, all_reduce_start

from ._agree import agree_signatures

__all__ = ["broadcast_parameters", "all_reduce_gradients", "allreduce_gradients", "DistributedDataParallel"]

_OPS = ("mean", "sum")
# dtypes reduced in the bucket's own memory (float16 as all_reduce does: float16 on the
# wire, summed in float64, rounded once); bfloat16 has no numpy dtype: it travels as float32.
_WIRE_DTYPES = (torch.float16, torch.float32, torch.float64)


def broadcast_parameters(module_or_state_dict, root: int = 0) -> None:
    """Overwrite every replica's parameters and buffers in place with the root replica's.
    Collective.

    Args:
        module_or_state_dict: a ``torch.nn.Module`` (its ``state_dict()``: parameters and
            buffers) or a dict of name -> CPU tensor; the same names, shapes and dtypes
            on every replica.
        root: the source replica.

    Tensors go one by one in sorted name order (no copy for contiguous tensors:
    ``Tensor.numpy()`` views are the MPI buffers).

    Raises:
        ValueError: on every replica, when the names, shapes or dtypes differ between
            replicas (naming the replica and the first tensor that differs), or ``root``
            is out of range.
    """
    if isinstance(module_or_state_dict, torch.nn.Module):
        tensors = module_or_state_dict.state_dict()
    else:
        tensors = dict(module_or_state_dict)
    tensors = {name: t for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    pl.init()
    comm = pl.replica_comm()
    signature = [(name, tuple(tensors[name].shape), str(tensors[name].dtype)) for name in sorted(tensors)]
    agree_signatures("broadcast_parameters", signature, comm)
    pl.broadcast_parameters({name: _bits(t) for name, t in tensors.items()}, root=root)


def all_reduce_gradients(module: torch.nn.Module, op: str = "mean") -> None:
    """All-reduce the gradients of ``module``'s parameters in place: one fused
    all-reduce per dtype. Blocking; collective.

    A parameter that requires a gradient but has none on this replica contributes zeros
    and gets the reduced gradient (a new ``.grad``). float16 gradients travel as float16
    (:func:`popdist_lite.all_reduce`), bfloat16 ones as float32.

    Args:
        module: the model; its parameters that require a gradient, in
            ``named_parameters()`` order, the same on every replica.
        op: ``"mean"`` (default, as ``DistributedDataParallel``) or ``"sum"``.

    Raises:
        ValueError, TypeError: on every replica, when the fused buffers differ.
    """
    grads = {}
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads[name] = p.grad.detach().float().numpy() if p.grad.dtype == torch.bfloat16 else p.grad.detach().numpy()
    reduced = pl.all_reduce_gradients(grads, op=op)
    for name, p in module.named_parameters():
        if name in reduced:
            p.grad.copy_(torch.from_numpy(reduced[name]))


#: Alias of :func:`all_reduce_gradients` (the earlier spelling).
allreduce_gradients = all_reduce_gradients


class _Bucket:
    """A flat gradient buffer for some parameters of one dtype, all-reduced as one."""

    def __init__(self, index: int, params: list[torch.nn.Parameter]):
        self.index, self.params = index, params
        self.offsets = np.cumsum([0] + [p.numel() for p in params]).tolist()
        self.flat = torch.zeros(self.offsets[-1], dtype=params[0].dtype)
        self.views = [self.flat[a:b].view_as(p) for p, a, b in zip(params, self.offsets, self.offsets[1:])]
        self.slot = {id(p): i for i, p in enumerate(params)}
        self.ready: set[int] = set()
        self.pending = None  # the started all-reduce (popdist_lite.collectives.PendingAllReduce)
        self.wire = None  # the array on the wire: flat's numpy view, or a float32 copy

    def launch(self, op: str, comm, numbered_on) -> None:
        self.wire = self.flat.numpy() if self.flat.dtype in _WIRE_DTYPES else self.flat.float().numpy()
        self.pending = all_reduce_start(self.wire, op, comm=comm, numbered_on=numbered_on)

    def finish(self) -> None:
        """Wait for the reduction (the bucket's numbered call): the reduced values in ``flat``."""
        self.pending.wait()
        if self.flat.dtype not in _WIRE_DTYPES:  # a float32 copy travelled
            self.flat.copy_(torch.from_numpy(self.wire))
        self.pending = self.wire = None
        self.ready.clear()


class DistributedDataParallel(torch.nn.Module):
    """Data-parallel training of ``module``'s dense parameters, in the manner of
    ``torch.nn.parallel.DistributedDataParallel`` (Li et al., "PyTorch Distributed",
    VLDB 2020), on popdist-lite's replicas (MPI), not a ``torch.distributed`` process group.

    At construction (collective): every replica's parameters that require a gradient are
    compared (names, shapes, dtypes; an error names the replica and the parameter), then
    broadcast from replica 0 with the buffers (:func:`broadcast_parameters`), and
    grouped into buckets of at most ``bucket_cap_mb`` MiB of one dtype, in reverse order
    of ``module.parameters()`` (about the order backward produces their gradients).

    In backward: each parameter's ``register_post_accumulate_grad_hook`` copies its
    gradient into its bucket (nothing to copy when ``.grad`` is already the bucket's view);
    when a bucket is full, it and every earlier full bucket not yet started are started
    (:func:`popdist_lite.collectives.all_reduce_start`: an ``Iallreduce``, or for float16
    the ``Ialltoall`` of all-reduce's float16 path) on a duplicated communicator, in
    bucket order on every replica. Later hooks test the requests, which lets MPI
    progress them. When backward ends (the autograd engine's ``queue_callback``, as
    DDP), buckets not yet started (parameters without a gradient on this replica
    contribute zeros) are started, and each bucket is waited for in bucket order: one
    numbered collective call ``all_reduce`` per bucket, in the replica communicator's
    sequence (so poprun-lite's stall inspector names a replica that never reaches its
    backward), counted in ``popdist_lite.stats()``. The reduced gradients (the mean over
    replicas for ``op="mean"``) are the parameters' ``.grad``.

    Host embeddings have no parameters and are not touched (they update in their own
    backward). Buffers are broadcast at construction only (not at every forward).

    Args:
        module: the model (CPU).
        bucket_cap_mb: the bucket size limit in MiB (DDP's default 25).
        gradient_as_bucket_view: ``.grad`` of every parameter is a view of its bucket, so
            the reduced gradient needs no copy back (DDP's option of the same name); the
            first backward after ``zero_grad(set_to_none=True)`` copies each gradient in once.
        op: ``"mean"`` (default, as DDP) or ``"sum"``.
        broadcast: broadcast parameters and buffers from replica 0 at construction.

    float16 buckets travel as float16 and are summed in float64, rounded once (as
    :func:`popdist_lite.all_reduce`); bfloat16 buckets travel as float32.

    Raises:
        ValueError: on every replica, when the replicas' parameters differ, or for a bad
            ``op`` or ``bucket_cap_mb``.
    """

    def __init__(self, module: torch.nn.Module, *, bucket_cap_mb: float = 25.0, gradient_as_bucket_view: bool = True,
                 op: str = "mean", broadcast: bool = True):
        super().__init__()
        pl.init()
        comm = pl.replica_comm()
        problem = None
        if op not in _OPS:
            problem = Problem(ValueError, f"argument op: expected 'mean' or 'sum', got {op!r}")
        elif not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
            problem = Problem(ValueError, f"argument bucket_cap_mb: expected a number > 0, got {bucket_cap_mb!r}")
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        signature = [(n, tuple(p.shape), str(p.dtype)) for n, p in named]
        agree_signatures("DistributedDataParallel", signature, comm, problem)
        self.module = module
        self.op, self.gradient_as_bucket_view = op, bool(gradient_as_bucket_view)
        if broadcast:
            broadcast_parameters(module)
        self._comm = numbered(comm, "comm_dup", comm.Dup)  # the buckets' requests never mix with the library's collectives
        self._numbered_on = comm  # ... but their calls are numbered in the replica communicator's sequence
        self._buckets = _make_buckets([p for _, p in named], int(bucket_cap_mb * 2 ** 20))
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}
        self._next = 0  # the first bucket not started in this backward
        self._queued = False
        self._sync = True
        for b in self._buckets:
            for p in b.params:
                if self.gradient_as_bucket_view:
                    p.grad = b.views[b.slot[id(p)]] if p.grad is None else _into(b, p)
                p.register_post_accumulate_grad_hook(self._on_gradient)

    def forward(self, *args, **kwargs):
        if self._next or self._queued:  # a backward that raised: finish its requests first
            self._wait()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Inside, backward accumulates gradients locally without reducing them (as
        DDP's ``no_sync``); the first backward after it reduces the accumulated sum."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    @property
    def buckets(self) -> list[list[str]]:
        """The buckets, in launch order, as lists of parameter names."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        return [[names[id(p)] for p in b.params] for b in self._buckets]

    def _on_gradient(self, p: torch.nn.Parameter) -> None:
        if not self._sync:
            return
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._wait)
            self._queued = True
        b = self._bucket_of[id(p)]
        _into(b, p, assign=self.gradient_as_bucket_view)
        b.ready.add(id(p))
        for started in self._buckets[:self._next]:
            started.pending.test()  # lets MPI progress the started buckets
        while self._next < len(self._buckets) and len(self._buckets[self._next].ready) == len(
                self._buckets[self._next].params):
            self._buckets[self._next].launch(self.op, self._comm, self._numbered_on)
            self._next += 1

    def _wait(self) -> None:
        """End of backward: start the rest (missing gradients as zeros), wait for all,
        hand the reduced gradients to the parameters."""
        for b in self._buckets[self._next:]:
            for p in b.params:
                if id(p) not in b.ready:
                    b.views[b.slot[id(p)]].zero_()
                    p.grad = b.views[b.slot[id(p)]] if self.gradient_as_bucket_view else None
            b.launch(self.op, self._comm, self._numbered_on)
        self._next = len(self._buckets)
        for b in self._buckets:
            b.finish()
            for p, view in zip(b.params, b.views):
                if p.grad is None or not self.gradient_as_bucket_view:
                    if p.grad is None:
                        p.grad = view.clone()
                    else:
                        p.grad.copy_(view)
        self._next, self._queued = 0, False


def _make_buckets(params: list[torch.nn.Parameter], cap_bytes: int) -> list[_Bucket]:
    """Buckets of one dtype and at most ``cap_bytes`` each (a larger parameter gets
    its own), filled in reverse parameter order."""
    buckets, open_ = [], {}
    for p in reversed(params):
        group = open_.setdefault(p.dtype, [])
        if group and (sum(q.numel() for q in group) + p.numel()) * p.element_size() > cap_bytes:
            buckets.append(group)
            group = open_[p.dtype] = []
        group.append(p)
    buckets.extend(g for g in open_.values() if g)
    return [_Bucket(i, g) for i, g in enumerate(buckets)]


def _into(b: _Bucket, p: torch.nn.Parameter, assign: bool = True) -> torch.Tensor:
    """Put ``p.grad`` into its slot of ``b`` (a copy unless it is the slot itself); with
    ``assign`` the slot becomes ``p.grad``."""
    view = b.views[b.slot[id(p)]]
    if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
        view.copy_(p.grad)
        if assign:
            p.grad = view
    return view


def _bits(t: torch.Tensor) -> np.ndarray:
    """A numpy view of ``t``'s memory for a bit-for-bit copy (bfloat16 as int16)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy()
