"""All-to-all: replica ``j`` receives chunk ``j`` of every replica's array."""

from __future__ import annotations

from itertools import accumulate
from math import prod
from time import perf_counter

import numpy as np

from .. import counters
from ._common import as_array, buf, check_out, default_comm
from .agreement import Problem, agree, register_op

register_op("all_to_all")
register_op("all_to_all_v")


def _axis(axis, ndim: int) -> int | None:
    """``axis`` as a non-negative index, or None when out of range."""
    if not isinstance(axis, (int, np.integer)) or not -ndim <= axis < ndim:
        return None
    return int(axis) % ndim


def all_to_all(x, split_axis: int = 0, concat_axis: int = 0, *, comm=None,
               out: np.ndarray | None = None) -> np.ndarray:
    """Split ``x`` into ``r`` chunks along ``split_axis``, send chunk ``j`` to replica ``j``,
    and concatenate the chunks received (in replica order) along ``concat_axis``.

    The TF-IPU host-embedding guide's ``all-to-all(result, slice_dim, concat_dim)``
    (ENCODING strategy, section 15.3.1) and
    TensorFlow's ``all_to_all``.

    Args:
        x: array, the same shape and dtype on every replica, with
            ``x.shape[split_axis]`` divisible by ``r``.
        split_axis, concat_axis: axes of ``x`` (negative values count from the end).
        out: optional preallocated C-contiguous result array (shape below, ``x.dtype``);
            with ``split_axis == concat_axis == 0`` it is received into directly.

    Returns:
        array of ``x.dtype`` (``out`` when given) whose shape is ``x.shape`` with
        ``split_axis`` divided by ``r`` and then ``concat_axis`` multiplied by ``r``.

    Raises:
        ValueError, TypeError: on every replica, for bad axes, an indivisible split
            dimension, or shapes/dtypes that differ between replicas.
    """
    comm = default_comm(comm)
    x = as_array(x)
    r = comm.size
    split, concat = _axis(split_axis, x.ndim), _axis(concat_axis, x.ndim)
    problem = None
    if x.ndim == 0:
        problem = Problem(ValueError, "argument x: expected at least 1 dimension, got a scalar")
    elif split is None or concat is None:
        problem = Problem(ValueError, f"argument split_axis/concat_axis: expected axes in [{-x.ndim}, {x.ndim}), "
                                      f"got {split_axis} and {concat_axis}")
    elif x.shape[split] % r:
        problem = Problem(ValueError, f"argument x: expected x.shape[{split_axis}] divisible by {r} "
                                      f"(the number of replicas), got shape {x.shape}")
    else:
        shape = list(x.shape)
        shape[split] //= r
        shape[concat] *= r
        problem = check_out(out, tuple(shape), x.dtype)
    agree("all_to_all", x, comm, problem=problem, same_from=0)
    m = x.shape[split] // r
    chunk = x.shape[:split] + (m,) + x.shape[split + 1:]
    if split == 0:
        send = x  # already r contiguous chunks
    else:
        send = np.ascontiguousarray(np.moveaxis(x.reshape(x.shape[:split] + (r, m) + x.shape[split + 1:]), split, 0))
    recv = out if out is not None and concat == 0 else np.empty((r, *chunk), dtype=x.dtype)
    start = perf_counter()
    comm.Alltoall(buf(send), buf(recv))
    n = send.nbytes - send.nbytes // r
    counters.record("all_to_all", start, n, n)
    if concat == 0:
        return recv if recv is out else recv.reshape((r * chunk[0],) + chunk[1:])
    result = np.moveaxis(recv.reshape((r, *chunk)), 0, concat).reshape(chunk[:concat] + (r * chunk[concat],) + chunk[concat + 1:])
    if out is None:
        return result
    out[...] = result
    return out


def all_to_all_v(x, splits, *, comm=None) -> tuple[np.ndarray, np.ndarray]:
    """Send rows ``[o_j, o_j + splits[j])`` of ``x`` to replica ``j`` (Horovod's
    ``alltoall(tensor, splits)``): an all-to-all of the counts, then ``Alltoallv``.

    Args:
        x: array with at least one dimension; ``x.shape[1:]`` and dtype the same on
            every replica.
        splits: ``r`` non-negative integers summing to ``x.shape[0]``.

    Returns:
        ``(received, received_splits)``: the rows received, concatenated in replica
        order, shape ``(received_splits.sum(), *x.shape[1:])``, and ``int64[r]``, how
        many came from each replica.

    Raises:
        ValueError, TypeError: on every replica, for bad ``splits`` or mismatched
            trailing shapes or dtypes.
    """
    comm = default_comm(comm)
    x = as_array(x)
    splits = np.asarray(splits)
    problem = None
    if x.ndim == 0:
        problem = Problem(ValueError, "argument x: expected at least 1 dimension, got a scalar")
    elif splits.shape != (comm.size,) or splits.dtype.kind not in "iu" or (splits < 0).any() \
            or splits.sum() != x.shape[0]:
        problem = Problem(ValueError, f"argument splits: expected {comm.size} non-negative integers summing to "
                                      f"x.shape[0] = {x.shape[0]}, got {splits.tolist()}")
    agree("all_to_all_v", x, comm, problem=problem, same_from=1)
    send_counts = splits.astype(np.int64)
    recv_counts = np.empty_like(send_counts)
    start = perf_counter()
    comm.Alltoall(send_counts, recv_counts)
    n = send_counts.itemsize * (comm.size - 1)
    counters.record("all_to_all_v", start, n, n)
    return exchange_rows(x, send_counts, recv_counts, comm), recv_counts


def exchange_rows(x: np.ndarray, send_counts, recv_counts, comm, out: np.ndarray | None = None,
                  name: str = "all_to_all_v", skip_self: bool = False) -> np.ndarray:
    """``Alltoallv`` of whole rows when both sides already know the counts (no checks).

    Args:
        x: C-contiguous ``(sum(send_counts), *row)`` array.
        send_counts, recv_counts: ``r`` rows to send to / receive from each replica
            (ints or an integer array).
        out: optional preallocated C-contiguous ``(sum(recv_counts), *row)`` array to
            receive into.
        name: the counter to record the call under.
        skip_self: leave this replica's own rows out: they are not read from ``x`` and
            their place in ``out`` is not written (for callers that produce them more
            cheaply than MPI's self-copy).

    Counts and displacements are Python integers: for the handful of replicas of a
    host, list arithmetic costs a fraction of the microseconds numpy spends per call
    on tiny arrays.
    """
    k, row = comm.rank, prod(x.shape[1:])
    recv_rows = [int(c) for c in recv_counts]
    send = [int(c) * row for c in send_counts]
    recv = [c * row for c in recv_rows]
    send_at, recv_at = list(accumulate(send, initial=0)), list(accumulate(recv, initial=0))
    if out is None:
        out = np.empty((sum(recv_rows), *x.shape[1:]), dtype=x.dtype)
    sent, received = (send_at[-1] - send[k]) * x.itemsize, (recv_at[-1] - recv[k]) * x.itemsize
    if skip_self:  # after the displacements: the others' rows keep their places
        send[k] = recv[k] = 0
    start = perf_counter()
    comm.Alltoallv([x, (send, send_at[:-1])], [out, (recv, recv_at[:-1])])
    counters.record(name, start, sent, received)
    return out
