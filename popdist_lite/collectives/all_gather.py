"""All-gather: every replica receives every replica's array."""

from __future__ import annotations

from time import perf_counter

import numpy as np

from .. import counters
from ._common import as_array, buf, check_out, default_comm
from .agreement import Problem, agree, register_op

register_op("all_gather")
register_op("all_gather_v")


def all_gather(x, *, comm=None, out: np.ndarray | None = None) -> np.ndarray:
    """Gather ``x`` from every replica, stacked in replica order.

    Args:
        x: array of any shape and supported dtype; the same shape and dtype on every replica.
        comm: communicator (default: the replicas, :func:`popdist_lite.replica_comm`).
        out: optional preallocated ``(r, *x.shape)`` C-contiguous array of ``x.dtype``
            to receive into (reused between steps, no allocation).

    Returns:
        ``(r, *x.shape)`` array of ``x.dtype`` (``out`` when given); row ``k`` is
        replica ``k``'s ``x``.

    Raises:
        ValueError, TypeError: on every replica, when shapes or dtypes differ between
            replicas, the dtype is unsupported or ``out`` does not fit; the message
            names the replica.
    """
    comm = default_comm(comm)
    x = as_array(x)
    agree("all_gather", x, comm, problem=check_out(out, (comm.size, *x.shape), x.dtype), same_from=0)
    if out is None:
        out = np.empty((comm.size, *x.shape), dtype=x.dtype)
    start = perf_counter()
    comm.Allgather(buf(x), buf(out))
    n = x.nbytes * (comm.size - 1)
    counters.record("all_gather", start, n, n)
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
    problem = Problem(ValueError, "argument x: expected at least 1 dimension, got a scalar") if x.ndim == 0 else None
    return gather_rows(x, default_comm(comm), problem=problem)


def gather_rows(x: np.ndarray, comm, *, problem=None, name: str = "x") -> tuple[np.ndarray, np.ndarray]:
    """:func:`all_gather_v` for callers that checked ``x`` themselves and pass what
    they found wrong as ``problem`` (raised on every replica, see ``agree``)."""
    signatures = agree("all_gather_v", x, comm, problem=problem, name=name, same_from=1)
    counts = signatures["shape"][:, 0].copy()  # every replica's first dimension
    row = int(np.prod(x.shape[1:], dtype=np.int64))
    out = np.empty((int(counts.sum()), *x.shape[1:]), dtype=x.dtype)
    sizes = counts * row
    start = perf_counter()
    comm.Allgatherv(buf(x), buf(out, (sizes, np.cumsum(sizes) - sizes)))
    counters.record("all_gather_v", start, x.nbytes * (comm.size - 1), out.nbytes - x.nbytes)
    return out, counts
