"""Broadcast: every replica receives the root replica's array."""

from __future__ import annotations

from time import perf_counter

import numpy as np

from .. import counters
from ._common import as_array, buf, check_out, default_comm
from .agreement import Problem, agree, register_op

register_op("broadcast")


def broadcast(x, root: int = 0, *, comm=None, out: np.ndarray | None = None) -> np.ndarray:
    """Copy the root replica's ``x`` to every replica.

    Args:
        x: array of the same shape and dtype on every replica (non-root values are ignored).
        root: replica index of the source, the same on every replica.
        out: optional preallocated C-contiguous array of ``x.shape`` and ``x.dtype`` that
            non-root replicas receive into (may be ``x`` itself: in place); ignored on the root.

    Returns:
        the root's array; on the root this is ``x`` itself (no copy), elsewhere ``out``
        when given.

    Raises:
        ValueError: on every replica, for a root out of range or different between
            replicas, or shapes that differ.
        TypeError: on every replica, for dtypes that differ or are unsupported.
    """
    comm = default_comm(comm)
    x = as_array(x)
    problem = None
    if not isinstance(root, (int, np.integer)) or not 0 <= root < comm.size:
        problem = Problem(ValueError, f"argument root: expected an integer in [0, {comm.size}), got {root!r}")
    else:
        problem = check_out(out, x.shape, x.dtype)
    agree("broadcast", x, comm, problem=problem, extra=int(root) if problem is None else -1, same_from=0,
          extra_name="root")
    if comm.rank == root:
        out = x
    elif out is None:
        out = np.empty_like(x)
    start = perf_counter()
    comm.Bcast(buf(out), root=root)
    counters.record("broadcast", start, out.nbytes * (comm.size - 1) if comm.rank == root else 0,
                    0 if comm.rank == root else out.nbytes)
    return out
