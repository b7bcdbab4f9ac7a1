"""All-gather: every replica receives every replica's array."""

from __future__ import annotations

import numpy as np

from ._common import SHAPE, agree, as_array, buf, default_comm, record, require_same_shape


def all_gather(x, *, comm=None) -> np.ndarray:
    """Gather ``x`` from every replica, stacked in replica order.

    Args:
        x: array of any shape and supported dtype; the same shape and dtype on every replica.
        comm: communicator (default: the replicas, :func:`popdist_lite.replica_comm`).

    Returns:
        ``(r, *x.shape)`` array of ``x.dtype``; row ``k`` is replica ``k``'s ``x``.

    Raises:
        ValueError, TypeError: on every replica, when shapes or dtypes differ between
            replicas or the dtype is unsupported; the message names the replica.
    """
    comm = default_comm(comm)
    x = as_array(x)
    table = agree("all_gather", x, comm)
    require_same_shape("all_gather", table)
    out = np.empty((comm.size, *x.shape), dtype=x.dtype)
    comm.Allgather(buf(x), buf(out))
    record("all_gather", x.nbytes * (comm.size - 1))
    return out


def all_gather_v(x, *, comm=None) -> tuple[np.ndarray, np.ndarray]:
    """Gather arrays whose first dimension differs per replica (Horovod's ``allgather``).

    Args:
        x: array with at least one dimension; ``x.shape[1:]`` and dtype must agree on
            every replica, ``x.shape[0]`` may differ (and may be 0).

    Returns:
        ``(values, counts)``: ``values`` is the concatenation along axis 0 in replica
        order, shape ``(counts.sum(), *x.shape[1:])``; ``counts`` is ``int64[r]``,
        every replica's ``x.shape[0]``.

    Raises:
        ValueError, TypeError: on every replica, for a scalar ``x`` on any replica or
            trailing shapes/dtypes that differ between replicas.
    """
    x = as_array(x)
    problem = (ValueError, "argument x: expected at least 1 dimension, got a scalar") if x.ndim == 0 else None
    return gather_rows(x, default_comm(comm), problem=problem)


def gather_rows(x: np.ndarray, comm, *, problem=None, name: str = "x") -> tuple[np.ndarray, np.ndarray]:
    """:func:`all_gather_v` for callers that checked ``x`` themselves and pass what
    they found wrong as ``problem`` (raised on every replica, see ``agree``)."""
    table = agree("all_gather_v", x, comm, problem=problem, name=name)
    require_same_shape("all_gather_v", table, name=name, from_axis=1)
    counts = table[:, SHAPE].copy()
    row = int(np.prod(x.shape[1:], dtype=np.int64))
    out = np.empty((int(counts.sum()), *x.shape[1:]), dtype=x.dtype)
    sizes = counts * row
    comm.Allgatherv(buf(x), buf(out, (sizes, np.cumsum(sizes) - sizes)))
    record("all_gather_v", x.nbytes * (comm.size - 1))
    return out, counts
