"""All-reduce: every replica receives the reduction over replicas."""

from __future__ import annotations

from time import perf_counter

import numpy as np
from mpi4py import MPI

from .. import counters
from ._common import as_array, buf, check_out, default_comm
from ._reduce import F16, REDUCIBLE, f16_all_reduce, finish_mean
from .agreement import Problem, agree, register_op

register_op("all_reduce")

OPS = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
_NAMES = tuple(OPS)


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
    elif x.dtype not in REDUCIBLE:
        problem = Problem(TypeError, f"argument x: expected a numeric dtype, got {x.dtype}")
    elif x.dtype.kind == "c" and op in ("max", "min"):
        problem = Problem(TypeError, f"argument op: {op!r} of {x.dtype}: complex dtypes have no order "
                                     f"(only 'sum' and 'mean')")
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
