"""All-reduce: every replica receives the reduction over replicas; :func:`all_reduce`
(checked, blocking) and :func:`all_reduce_start` (unchecked, non-blocking, in place:
data-parallel gradient buckets overlapped with backward)."""

from __future__ import annotations

from time import perf_counter

import numpy as np
from mpi4py import MPI

from .. import counters
from ..calls import next_call_number
from ._common import as_array, buf, check_out, default_comm
from ._reduce import F16, REDUCIBLE, combine, f16_all_reduce, f16_gather, f16_padded, finish_mean
from .agreement import Problem, agree, register_op

register_op("all_reduce")

OPS = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
_NAMES = tuple(OPS)
#: The dtypes each op reduces (complex numbers have no order: no max or min).
_DTYPES_OF = {op: REDUCIBLE if op in ("sum", "mean") else frozenset(d for d in REDUCIBLE if d.kind != "c")
              for op in OPS}


def _op_name(code: int) -> str:
    return repr(_NAMES[code])


def all_reduce(x, op: str = "sum", *, comm=None, out: np.ndarray | None = None) -> np.ndarray:
    """Reduce ``x`` element-wise over replicas; every replica gets the result.

    Args:
        x: array (or scalar) of a numeric dtype (integers, float16/32/64, complex64/128),
            the same shape and dtype on every replica.
        op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``, the same on every replica.
            ``"mean"`` of integers is float64; complex arrays take ``"sum"`` and
            ``"mean"`` only (MPI sums them natively).
        out: optional preallocated C-contiguous array of ``x.shape`` and ``x.dtype`` to
            receive into (not for ``"mean"`` of integers); may be ``x`` itself (in place).

    float16 travels as float16 (half the bytes of float32) and is combined in float64,
    then rounded once: the result is the float16 rounding of the exact sum (or mean,
    max, min), not an accumulation of float16 roundings. Algorithm: an ``Alltoall``
    reduce-scatter of float16 chunks and an ``Allgather`` of the float16 results (see
    :mod:`popdist_lite.collectives._reduce`); the same on Open MPI and MPICH. With
    ``out`` the float16 result is written into ``out``.

    Returns:
        array of ``x.shape`` (``out`` when given); ``x.dtype`` (float64 for the mean of
        integers).

    Raises:
        ValueError: on every replica, for an unknown ``op``, ops that differ between
            replicas, shapes that differ, or an ``out`` that does not fit.
        TypeError: on every replica, for a non-numeric dtype, dtypes that differ, or
            ``"max"``/``"min"`` of a complex dtype.
    """
    comm = default_comm(comm)
    x = as_array(x)
    problem = None
    if op not in OPS:
        problem = Problem(ValueError, f"argument op: expected one of {list(OPS)}, got {op!r}")
    elif x.dtype not in _DTYPES_OF[op]:
        problem = Problem(TypeError, f"argument x: expected a numeric dtype, got {x.dtype}" if x.dtype not in REDUCIBLE
                          else f"argument op: {op!r} of {x.dtype}: complex dtypes have no order (only 'sum' and 'mean')")
    elif out is not None and op == "mean" and x.dtype.kind in "iu":
        problem = Problem(ValueError, "argument out: not supported for the mean of integers (the result is float64)")
    else:
        problem = check_out(out, x.shape, x.dtype)
    agree("all_reduce", x, comm, problem=problem, extra=_NAMES.index(op) if op in OPS else -1, same_from=0,
          extra_name="op", extra_format=_op_name)
    if x.dtype == F16:
        return f16_all_reduce(x, comm, op, out=out)
    if out is not None:  # receive straight into the caller's array
        result = out
        send = MPI.IN_PLACE if out is x else buf(x)
    else:
        result = np.empty_like(x)
        send = buf(x)
    start = perf_counter()
    comm.Allreduce(send, buf(result), op=OPS[op])
    n = x.nbytes * (comm.size - 1)
    counters.record("all_reduce", start, n, n)
    return finish_mean(result, op, comm.size)


class PendingAllReduce:
    """An all-reduce started by :func:`all_reduce_start`: :meth:`test` lets MPI progress
    it, :meth:`wait` completes it."""

    __slots__ = ("x", "op", "comm", "numbered_on", "request", "padded", "recv", "sent")

    def __init__(self, x: np.ndarray, op: str, comm, numbered_on):
        self.x, self.op, self.comm, self.numbered_on = x, op, comm, numbered_on
        self.padded = self.recv = self.request = None
        r = comm.size
        if r == 1:  # nothing moves
            self.sent = 0
        elif x.dtype == F16:  # the first half of the float16 all-reduce: an Ialltoall of the chunks
            self.padded = f16_padded(x, r)
            self.recv = np.empty(self.padded.shape, dtype=np.uint16)
            self.request = comm.Ialltoall(self.padded.view(np.uint16), self.recv)
            self.sent = self.padded.nbytes - self.padded.nbytes // r
        else:
            self.request = comm.Iallreduce(MPI.IN_PLACE, buf(x), op=OPS[op])
            self.sent = x.nbytes * (r - 1)

    def test(self) -> bool:
        """Whether the MPI part started so far is done (MPI progresses it meanwhile)."""
        return self.request is None or self.request.Test()

    def wait(self) -> np.ndarray:
        """Take this call's number (on ``numbered_on``, recorded for the stall inspector
        from now on), wait for the reduction and return ``x``, which now holds it.
        Counted as one ``all_reduce`` (its seconds: this wait)."""
        next_call_number(self.numbered_on, "all_reduce")
        start = perf_counter()
        x, r, moved = self.x, self.comm.size, self.sent
        if self.request is not None:
            self.request.Wait()
        if self.padded is not None:  # float16: combine in float64, round once, gather the chunks
            chunk = combine(self.recv.view(F16), self.op, r)
            gathered, more = f16_gather(chunk, self.comm)
            x.reshape(-1)[:] = gathered[:x.size]
            moved += more
        elif r > 1:
            finish_mean(x, self.op, r)
        counters.record("all_reduce", start, moved, moved)
        self.request = self.padded = self.recv = None
        return x


def all_reduce_start(x: np.ndarray, op: str = "sum", *, comm, numbered_on=None) -> PendingAllReduce:
    """Start reducing ``x`` element-wise over the replicas of ``comm``, in place,
    without blocking; ``.wait()`` on the result completes it (``.test()`` lets MPI
    progress it meanwhile). Unchecked: for buffers whose shape, dtype and ``op`` every
    replica agreed beforehand (``popdist_lite.torch.DistributedDataParallel`` agrees
    its buckets at construction); every replica must start, and wait for, the same
    calls in the same order.

    float16 stays float16 on the wire and is combined in float64 and rounded once, as
    in :func:`all_reduce` (an ``Ialltoall`` here, the combine and an ``Allgather`` in
    the wait); other dtypes are one ``Iallreduce``.

    The call is numbered (:func:`popdist_lite.calls.next_call_number`) when it is waited
    for, the point where a replica can be stuck, so the stall inspector names it while a
    replica waits; ``numbered_on`` is the communicator whose numbers it takes (default
    ``comm``): a duplicate that keeps non-blocking calls apart from the collectives of
    its parent can number them in the parent's sequence, which the stall inspector
    follows. Counted as ``all_reduce`` when waited for.

    Args:
        x: C-contiguous, writeable array of a dtype :func:`all_reduce` sums, not ``"mean"``
            of integers; it holds the result after the wait.
        op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"`` (complex: sum and mean).
        comm: the communicator the data moves on.
        numbered_on: the communicator whose call numbers the wait takes.

    Raises:
        ValueError, TypeError: on this replica only (unchecked), for an ``op``, dtype or
            array it cannot reduce in place.
    """
    if op not in OPS:
        raise ValueError(f"all_reduce_start: argument op: expected one of {list(OPS)}, got {op!r}")
    if not isinstance(x, np.ndarray) or x.dtype not in _DTYPES_OF[op] or (op == "mean" and x.dtype.kind in "iu"):
        raise TypeError(f"all_reduce_start: argument x: cannot reduce {getattr(x, 'dtype', type(x).__name__)} "
                        f"in place with {op!r}")
    if not (x.flags.c_contiguous and x.flags.writeable):
        raise ValueError("all_reduce_start: argument x: expected a writeable C-contiguous array")
    return PendingAllReduce(x, op, comm, comm if numbered_on is None else numbered_on)
