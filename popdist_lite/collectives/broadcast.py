"""Broadcast: every replica receives the root replica's array."""

from __future__ import annotations

import numpy as np

from ._common import EXTRA, agree, as_array, buf, default_comm, record, require_same_shape


def broadcast(x, root: int = 0, *, comm=None) -> np.ndarray:
    """Copy the root replica's ``x`` to every replica.

    Args:
        x: array of the same shape and dtype on every replica (non-root values are ignored).
        root: replica index of the source, the same on every replica.

    Returns:
        the root's array; on the root this is ``x`` itself (no copy).

    Raises:
        ValueError: on every replica, for a root out of range or different between
            replicas, or shapes that differ.
        TypeError: on every replica, for dtypes that differ or are unsupported.
    """
    comm = default_comm(comm)
    x = as_array(x)
    problem = None
    if not isinstance(root, (int, np.integer)) or not 0 <= root < comm.size:
        problem = (ValueError, f"argument root: expected an integer in [0, {comm.size}), got {root!r}")
    table = agree("broadcast", x, comm, problem=problem, extra=int(root) if problem is None else -1)
    bad = np.flatnonzero(table[:, EXTRA] != table[0, EXTRA])
    if bad.size:
        r = int(bad[0])
        raise ValueError(f"broadcast: argument root: replica {r} passed {table[r, EXTRA]}, "
                         f"expected {table[0, EXTRA]} as on replica 0")
    require_same_shape("broadcast", table)
    out = x if comm.rank == root else np.empty_like(x)
    comm.Bcast(buf(out), root=root)
    if comm.rank == root:
        record("broadcast", out.nbytes * (comm.size - 1))
    return out
