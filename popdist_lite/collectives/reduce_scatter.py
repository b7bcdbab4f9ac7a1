"""Reduce-scatter-sum: sum over replicas, each replica keeps its own slice."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ._common import agree, as_array, buf, default_comm, require_same_shape
from ._reduce import REDUCIBLE, to_wire, from_wire


def reduce_scatter_sum(x, *, comm=None) -> np.ndarray:
    """Sum ``x`` over replicas and give replica ``k`` the slice ``k`` of the sum.

    This is the seed's ``reduce-scatter-sum`` (host-embeddings guide, TOKEN strategy).

    Args:
        x: array with ``x.shape[0] == r`` (the number of replicas), the same shape and
            a numeric dtype on every replica. float16 is summed in float32 and rounded once.

    Returns:
        ``x.shape[1:]`` array of ``x.dtype``: ``sum over replicas j of x_j[k]`` on replica ``k``.

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
    table = agree("reduce_scatter_sum", x, comm, problem=problem)
    require_same_shape("reduce_scatter_sum", table)
    work = to_wire(x)
    out = np.empty(x.shape[1:], dtype=work.dtype)
    comm.Reduce_scatter_block(buf(work), buf(out), op=MPI.SUM)
    return from_wire(out, x.dtype)


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
    comm.Reduce_scatter(buf(work), buf(out), np.asarray(counts, dtype=np.int64) * row, op=MPI.SUM)
    return from_wire(out, x.dtype)
