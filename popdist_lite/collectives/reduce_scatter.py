"""Reduce-scatter-sum: sum over replicas, each replica keeps its own slice."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ._common import agree, as_array, buf, default_comm, record, require_same_shape
from ._reduce import F16, REDUCIBLE, f16_reduce_scatter, f16_reduce_scatter_v, mpi_reduce_bytes


def reduce_scatter_sum(x, *, comm=None) -> np.ndarray:
    """Sum ``x`` over replicas and give replica ``k`` the slice ``k`` of the sum.

    This is the seed's ``reduce-scatter-sum`` (host-embeddings guide, TOKEN strategy).

    Args:
        x: array with ``x.shape[0] == r`` (the number of replicas), the same shape and
            a numeric dtype on every replica. float16 travels as float16 (an ``Alltoall``
            of the chunks), is summed exactly in float64 and rounded once, so the result
            is the float16 rounding of the exact sum.

    Returns:
        ``x.shape[1:]`` array of ``x.dtype``: ``sum over replicas j of x_j[k]`` on replica ``k``.

    Raises:
        ValueError, TypeError: on every replica, for a wrong first dimension, shapes or
            dtypes that differ between replicas, or a non-numeric dtype.
    """
    return reduce_scatter(x, "sum", comm=comm)


def reduce_scatter(x, op: str = "sum", *, comm=None) -> np.ndarray:
    """:func:`reduce_scatter_sum`, or with ``op="mean"`` the sum divided by ``r`` (for
    float16, divided before the single rounding, so a mean never overflows where the
    sum would). Same arguments, checks and errors; ``op`` must be the same everywhere
    (it is not re-checked: callers pass a constant)."""
    if op not in ("sum", "mean"):
        raise ValueError(f"reduce_scatter: argument op: expected 'sum' or 'mean', got {op!r}")
    comm = default_comm(comm)
    x = as_array(x)
    problem = None
    if x.ndim == 0 or x.shape[0] != comm.size:
        problem = (ValueError, f"argument x: expected x.shape[0] == {comm.size} (the number of replicas), "
                               f"got shape {x.shape}")
    elif x.dtype not in REDUCIBLE:
        problem = (TypeError, f"argument x: expected a numeric dtype for a sum, got {x.dtype}")
    table = agree("reduce_scatter_sum", x, comm, problem=problem)
    require_same_shape("reduce_scatter_sum", table)
    if x.dtype == F16:
        return f16_reduce_scatter(x, comm, op)
    out = np.empty(x.shape[1:], dtype=x.dtype)
    comm.Reduce_scatter_block(buf(x), buf(out), op=MPI.SUM)
    record("reduce_scatter_sum", mpi_reduce_bytes(x.nbytes, comm.size, all_reduce=False))
    if op == "mean":
        return out / comm.size if out.dtype.kind in "iu" else out / np.asarray(comm.size, out.dtype)
    return out


def reduce_scatter_sum_v(x: np.ndarray, counts: np.ndarray, *, comm=None) -> np.ndarray:
    """Ragged reduce-scatter-sum: replica ``k`` keeps rows ``[offset_k, offset_k + counts[k])``.

    Used after :func:`all_gather_v`, whose ``counts`` it takes, so ``counts`` and
    ``x.shape`` are the same on every replica by construction (not re-checked).

    Args:
        x: ``(counts.sum(), *row_shape)`` numeric array.
        counts: ``int64[r]`` rows per replica.

    Returns:
        ``(counts[k], *row_shape)`` on replica ``k``: those rows summed over replicas.
    """
    comm = default_comm(comm)
    x = as_array(x)
    if x.dtype == F16:
        return f16_reduce_scatter_v(x, counts, comm)
    row = int(np.prod(x.shape[1:], dtype=np.int64))
    sizes = np.asarray(counts, dtype=np.int64) * row
    out = np.empty((int(counts[comm.rank]), *x.shape[1:]), dtype=x.dtype)
    comm.Reduce_scatter(buf(x), buf(out), sizes, op=MPI.SUM)
    record("reduce_scatter_sum", (int(sizes.sum()) - int(sizes[comm.rank])) * x.itemsize)
    return out
