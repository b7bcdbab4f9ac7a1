"""Reduce-scatter-sum: sum over replicas, each replica keeps its own slice."""

from __future__ import annotations

from time import perf_counter

import numpy as np
from mpi4py import MPI

from .. import counters
from ._common import as_array, buf, check_out, default_comm
from ._reduce import F16, REDUCIBLE, f16_reduce_scatter, f16_reduce_scatter_v, finish_mean
from .agreement import Problem, agree, register_op

register_op("reduce_scatter_sum")


def reduce_scatter_sum(x, *, comm=None, out: np.ndarray | None = None) -> np.ndarray:
    """Sum ``x`` over replicas and give replica ``k`` the slice ``k`` of the sum.

    The ``reduce-scatter-sum`` of the TF-IPU host-embedding guide's TOKEN strategy
    (section 15.3.1).

    Args:
        x: array with ``x.shape[0] == r`` (the number of replicas), the same shape and
            a numeric dtype on every replica. float16 travels as float16 (an ``Alltoall``
            of the chunks), is summed exactly in float64 and rounded once, so the result
            is the float16 rounding of the exact sum.
        out: optional preallocated C-contiguous ``x.shape[1:]`` array of ``x.dtype``
            (float16 results are written into it too).

    Returns:
        ``x.shape[1:]`` array of ``x.dtype`` (``out`` when given): ``sum over replicas j
        of x_j[k]`` on replica ``k``.

    Raises:
        ValueError, TypeError: on every replica, for a wrong first dimension, shapes or
            dtypes that differ between replicas, a non-numeric dtype or an ``out`` that
            does not fit.
    """
    return reduce_scatter(x, "sum", comm=comm, out=out)


def reduce_scatter(x, op: str = "sum", *, comm=None, out: np.ndarray | None = None) -> np.ndarray:
    """:func:`reduce_scatter_sum`, or with ``op="mean"`` the sum divided by ``r`` (for
    float16, divided before the single rounding, so a mean never overflows where the
    sum would). Same arguments, checks and errors (``out`` is not supported for the
    mean of integers, which is float64); ``op`` must be the same everywhere (it is not
    re-checked: callers pass a constant)."""
    if op not in ("sum", "mean"):
        raise ValueError(f"reduce_scatter: argument op: expected 'sum' or 'mean', got {op!r}")
    comm = default_comm(comm)
    x = as_array(x)
    problem = None
    if x.ndim == 0 or x.shape[0] != comm.size:
        problem = Problem(ValueError, f"argument x: expected x.shape[0] == {comm.size} (the number of replicas), "
                                      f"got shape {x.shape}")
    elif x.dtype not in REDUCIBLE:
        problem = Problem(TypeError, f"argument x: expected a numeric dtype for a sum, got {x.dtype}")
    elif out is not None and op == "mean" and x.dtype.kind in "iu":
        problem = Problem(ValueError, "argument out: not supported for the mean of integers (the result is float64)")
    else:
        problem = check_out(out, x.shape[1:], x.dtype)
    agree("reduce_scatter_sum", x, comm, problem=problem, same_from=0)
    if x.dtype == F16:
        return f16_reduce_scatter(x, comm, op, out=out)
    result = out if out is not None else np.empty(x.shape[1:], dtype=x.dtype)
    start = perf_counter()
    comm.Reduce_scatter_block(buf(x), buf(result), op=MPI.SUM)
    n = result.nbytes * (comm.size - 1)
    counters.record("reduce_scatter_sum", start, n, n)
    return finish_mean(result, op, comm.size)


def reduce_scatter_sum_v(x: np.ndarray, counts: np.ndarray, *, comm=None) -> np.ndarray:
    """Ragged reduce-scatter-sum: replica ``k`` keeps rows ``[offset_k, offset_k + counts[k])``.

    Used after :func:`all_gather_v`, whose ``counts`` it takes, so ``counts`` and
    ``x.shape`` are the same on every replica by construction (not re-checked).

    Args:
        x: ``(counts.sum(), *row_shape)`` numeric array (float16: float16 on the wire,
            summed exactly and rounded once, as :func:`reduce_scatter_sum`).
        counts: ``int64[r]`` rows per replica.

    Returns:
        ``(counts[k], *row_shape)`` on replica ``k``: those rows summed over replicas.
    """
    comm = default_comm(comm)
    x = as_array(x)
    if x.dtype == F16:
        return f16_reduce_scatter_v(x, counts, comm)
    row = int(np.prod(x.shape[1:], dtype=np.int64))
    out = np.empty((int(counts[comm.rank]), *x.shape[1:]), dtype=x.dtype)
    start = perf_counter()
    comm.Reduce_scatter(buf(x), buf(out), np.asarray(counts, dtype=np.int64) * row, op=MPI.SUM)
    counters.record("reduce_scatter_sum_v", start, x.nbytes - out.nbytes, out.nbytes * (comm.size - 1))
    return out
