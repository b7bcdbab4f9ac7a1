"""Reduce-scatter-sum: sum over replicas, each replica keeps its own slice."""

from __future__ import annotations

from time import perf_counter

import numpy as np
from mpi4py import MPI

from .. import counters
from ._common import agree, as_array, buf, check_out, default_comm
from ._reduce import REDUCIBLE, to_wire, from_wire


def reduce_scatter_sum(x, *, comm=None, out: np.ndarray | None = None) -> np.ndarray:
    """Sum ``x`` over replicas and give replica ``k`` the slice ``k`` of the sum.

    This is the seed's ``reduce-scatter-sum`` (host-embeddings guide, TOKEN strategy).

    Args:
        x: array with ``x.shape[0] == r`` (the number of replicas), the same shape and
            a numeric dtype on every replica. float16 is summed in float32 and rounded once.
        out: optional preallocated C-contiguous ``x.shape[1:]`` array of ``x.dtype``.

    Returns:
        ``x.shape[1:]`` array of ``x.dtype`` (``out`` when given): ``sum over replicas j
        of x_j[k]`` on replica ``k``.

    Raises:
        ValueError, TypeError: on every replica, for a wrong first dimension, shapes or
            dtypes that differ between replicas, or a non-numeric dtype.
    """
    comm = default_comm(comm)
    x = as_array(x)
    problem = None
    if x.ndim == 0 or x.shape[0] != comm.size:
        problem = (ValueError, f"argument x: expected x.shape[0] == {comm.size} (the number of replicas), "
                               f"got shape {x.shape}")
    elif x.dtype not in REDUCIBLE:
        problem = (TypeError, f"argument x: expected a numeric dtype for a sum, got {x.dtype}")
    else:
        problem = check_out(out, x.shape[1:], x.dtype)
    agree("reduce_scatter_sum", x, comm, problem=problem, same_from=0)
    work = to_wire(x)
    result = out if out is not None and work is x else np.empty(x.shape[1:], dtype=work.dtype)
    start = perf_counter()
    comm.Reduce_scatter_block(buf(work), buf(result), op=MPI.SUM)
    n = result.nbytes * (comm.size - 1)
    counters.record("reduce_scatter_sum", start, n, n)
    if out is None:
        return from_wire(result, x.dtype)
    if result is not out:
        out[...] = result
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
    work = to_wire(x)
    row = int(np.prod(x.shape[1:], dtype=np.int64))
    out = np.empty((int(counts[comm.rank]), *x.shape[1:]), dtype=work.dtype)
    start = perf_counter()
    comm.Reduce_scatter(buf(work), buf(out), np.asarray(counts, dtype=np.int64) * row, op=MPI.SUM)
    counters.record("reduce_scatter_sum_v", start, work.nbytes - out.nbytes, out.nbytes * (comm.size - 1))
    return from_wire(out, x.dtype)
