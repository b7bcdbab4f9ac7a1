"""dtype handling for reductions: which dtypes reduce, and the float16 path.

float16 is never widened on the wire. MPI has no portable float16 sum (Open MPI has
no ``MPI_SUM`` for it; MPICH's ``MPIX_C_FLOAT16`` is an extension), and a
user-defined ``MPI.Op`` applied pairwise down a reduction tree rounds to float16 at
every level. So a float16 reduction here is built from data movement only:

- reduce-scatter: an ``Alltoall`` of the float16 chunks (chunk ``k`` of every replica
  goes to replica ``k``; the bits travel as ``uint16``, a predefined type on every MPI),
  then a local sum of the ``r`` received chunks in float64 and one rounding to float16.
  Every float16 value is a multiple of ``2**-24`` below ``2**16``, so float64 (53-bit
  significand) holds the sum of up to ``2**13`` of them exactly: the result is the
  float16 rounding of the *exact* sum (round-to-nearest-even), not an accumulation of
  float16 roundings (nor the double rounding a float32 accumulator can cause).
- all-reduce: the same reduce-scatter on the flattened, zero-padded array, then an
  ``Allgather`` of the float16 result chunks.

Bytes sent (and received) per replica: ``(r-1)/r * n * 2`` for the reduce-scatter
and twice that for the all-reduce, i.e. half of what the same reduce-scatter and
all-gather move in float32 (the ring-algorithm optimum). Each float16 reduction is
one record in :mod:`popdist_lite.counters` under the collective's name, with the
bytes of the ``Alltoall``/``Allgather`` rows of the counters' table and the seconds of
the whole reduction (MPI calls and the float64 combine, as MPI's own reductions
include their arithmetic).
"""

from __future__ import annotations

from time import perf_counter

import numpy as np

from .. import counters

#: dtypes the sums accept; complex64/complex128 are MPI's ``C_FLOAT_COMPLEX`` /
#: ``C_DOUBLE_COMPLEX`` (mpi4py maps them from the array), which MPI sums natively (no
#: max or min: complex numbers have no order).
REDUCIBLE = frozenset(np.dtype(t) for t in (
    np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64,
    np.uint8, np.uint16, np.uint32, np.uint64, np.complex64, np.complex128))
F16 = np.dtype(np.float16)
_PAIRWISE = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum}


def finish_mean(result: np.ndarray, op: str, r: int) -> np.ndarray:
    """After an MPI sum: divide by ``r`` for ``op == "mean"`` (in place for floats;
    integers give a new float64 array), else return ``result`` as it is."""
    if op != "mean":
        return result
    if result.dtype.kind in "iu":
        return result / r
    result /= np.asarray(r, result.dtype)
    return result


def combine(chunks: np.ndarray, op: str, r: int, out: np.ndarray | None = None) -> np.ndarray:
    """Reduce ``(r, ...)`` float16 chunks over axis 0, wide, rounded once to float16
    (into ``out`` when given: a float16 array of ``chunks.shape[1:]``).

    A loop over the ``r`` chunks (not over elements): numpy's reduction over a short
    leading axis is many times slower than ``r - 1`` vectorised additions.
    """
    if r == 1 or op in ("max", "min"):  # the input itself, or exact in float16: no widening
        if out is None:
            result = chunks[0].copy()
        else:
            result = out
            np.copyto(result, chunks[0])
        for j in range(1, r):
            _PAIRWISE[op](result, chunks[j], out=result)
        return result
    wide = chunks[0].astype(np.float64)
    for j in range(1, r):
        wide += chunks[j]  # float16 -> float64 is exact, and so is the running sum (see module doc)
    if op == "mean":
        wide /= r
    if out is None:
        return wide.astype(F16)
    np.copyto(out, wide, casting="unsafe")  # the one rounding, as astype
    return out


def _reduce_scatter(x: np.ndarray, comm, op: str, out: np.ndarray | None):
    """The float16 reduce-scatter without recording: ``(chunk, bytes moved each way)``."""
    r = comm.size
    send = x.view(np.uint16)
    recv = np.empty_like(send)
    comm.Alltoall(send, recv)
    moved = send.nbytes - send.nbytes // r  # all but my own chunk, each way
    return combine(recv.view(F16), op, r, out), moved


def f16_reduce_scatter(x: np.ndarray, comm, op: str = "sum", out: np.ndarray | None = None) -> np.ndarray:
    """``x``: C-contiguous float16 ``(r, *chunk)``; returns this replica's reduced
    ``chunk`` (float16; ``out`` when given), every replica's ``x[k]`` combined on
    replica ``k``. Recorded as ``reduce_scatter_sum``."""
    start = perf_counter()
    result, moved = _reduce_scatter(x, comm, op, out)
    counters.record("reduce_scatter_sum", start, moved, moved)
    return result


def f16_reduce_scatter_v(x: np.ndarray, counts: np.ndarray, comm) -> np.ndarray:
    """Ragged float16 reduce-scatter-sum: replica ``k`` gets rows
    ``[offset_k, offset_k + counts[k])`` summed over replicas. Recorded as
    ``reduce_scatter_sum_v`` (sent: all but my own rows; received: my rows x (r - 1))."""
    start = perf_counter()
    r, k = comm.size, comm.rank
    row = int(np.prod(x.shape[1:], dtype=np.int64))
    counts = np.asarray(counts, dtype=np.int64)
    send_sizes = counts * row
    mine = int(counts[k])
    recv = np.empty((r, mine, *x.shape[1:]), dtype=np.uint16)
    recv_sizes = np.full(r, mine * row, dtype=np.int64)
    comm.Alltoallv([x.view(np.uint16), (send_sizes, np.cumsum(send_sizes) - send_sizes)],
                   [recv, (recv_sizes, np.cumsum(recv_sizes) - recv_sizes)])
    result = combine(recv.view(F16), "sum", r)
    counters.record("reduce_scatter_sum_v", start, 2 * int(send_sizes.sum() - send_sizes[k]), 2 * mine * row * (r - 1))
    return result


def f16_padded(x: np.ndarray, r: int) -> np.ndarray:
    """``x`` flattened and zero-padded to ``(r, ceil(n / r))`` float16: the chunks of a
    float16 all-reduce's reduce-scatter."""
    flat = x.reshape(-1)
    c = -(-flat.size // r)
    padded = np.zeros(r * c, dtype=F16)
    padded[:flat.size] = flat
    return padded.reshape(r, c)


def f16_gather(chunk: np.ndarray, comm) -> tuple[np.ndarray, int]:
    """The second half of a float16 all-reduce: ``Allgather`` every replica's reduced
    ``chunk``; ``(the r * c float16 values, bytes moved each way)``."""
    r = comm.size
    gathered = np.empty((r, chunk.size), dtype=np.uint16)
    comm.Allgather(chunk.view(np.uint16), gathered)
    return gathered.view(F16).reshape(-1), chunk.nbytes * (r - 1)  # own bytes x (r - 1) out, the others' in


def f16_all_reduce(x: np.ndarray, comm, op: str, out: np.ndarray | None = None) -> np.ndarray:
    """All-reduce of a float16 array: float16 on the wire, combined in float64, rounded
    once; into ``out`` when given (a float16 array of ``x.shape``, may be ``x``).
    Recorded as one ``all_reduce`` with the bytes of its ``Alltoall`` and ``Allgather``."""
    start = perf_counter()
    r = comm.size
    if r == 1:  # the reduction of one replica is its input; nothing moves
        if out is None:
            result = x.copy()
        else:
            result = out
            if out is not x:
                np.copyto(out, x)
        counters.record("all_reduce", start)
        return result
    chunk, moved = _reduce_scatter(f16_padded(x, r), comm, op, None)
    gathered, more = f16_gather(chunk, comm)
    moved += more
    counters.record("all_reduce", start, moved, moved)
    result = gathered[:x.size].reshape(x.shape)
    if out is None:
        return result
    np.copyto(out, result)
    return out
