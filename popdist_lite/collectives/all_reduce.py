"""All-reduce: every replica receives the reduction over replicas."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ._common import EXTRA, agree, as_array, buf, default_comm, record, require_same_shape
from ._reduce import F16, REDUCIBLE, f16_all_reduce, mpi_reduce_bytes

OPS = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
_NAMES = tuple(OPS)


def all_reduce(x, op: str = "sum", *, comm=None) -> np.ndarray:
    """Reduce ``x`` element-wise over replicas; every replica gets the result.

    Args:
        x: array (or scalar) of a numeric dtype, the same shape and dtype on every replica.
        op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``, the same on every replica.
            ``"mean"`` of integers is float64.

    float16 travels as float16 (half the bytes of float32) and is combined in float64,
    then rounded once: the result is the float16 rounding of the exact sum (or mean,
    max, min), not an accumulation of float16 roundings. Algorithm: an ``Alltoall``
    reduce-scatter of float16 chunks and an ``Allgather`` of the float16 results (see
    :mod:`popdist_lite.collectives._reduce`); the same on Open MPI and MPICH.

    Returns:
        array of ``x.shape``; ``x.dtype`` (float64 for the mean of integers).

    Raises:
        ValueError: on every replica, for an unknown ``op``, ops that differ between
            replicas, or shapes that differ.
        TypeError: on every replica, for a non-numeric dtype or dtypes that differ.
    """
    comm = default_comm(comm)
    x = as_array(x)
    problem = None
    if op not in OPS:
        problem = (ValueError, f"argument op: expected one of {list(OPS)}, got {op!r}")
    elif x.dtype not in REDUCIBLE:
        problem = (TypeError, f"argument x: expected a numeric dtype, got {x.dtype}")
    table = agree("all_reduce", x, comm, problem=problem, extra=_NAMES.index(op) if op in OPS else -1)
    bad = np.flatnonzero(table[:, EXTRA] != table[0, EXTRA])
    if bad.size:
        r = int(bad[0])
        raise ValueError(f"all_reduce: argument op: replica {r} passed {_NAMES[table[r, EXTRA]]!r}, "
                         f"expected {_NAMES[table[0, EXTRA]]!r} as on replica 0")
    require_same_shape("all_reduce", table)
    if x.dtype == F16:
        return f16_all_reduce(x, comm, op)
    out = np.empty_like(x)
    comm.Allreduce(buf(x), buf(out), op=OPS[op])
    record("all_reduce", mpi_reduce_bytes(x.nbytes, comm.size, all_reduce=True))
    if op == "mean":
        return out / comm.size if out.dtype.kind in "iu" else out / np.asarray(comm.size, out.dtype)
    return out
