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

Bytes sent per replica: ``(r-1)/r * n * 2`` for the reduce-scatter and twice that
for the all-reduce, i.e. half of the float32 figure (the ring-algorithm optimum).
"""

from __future__ import annotations

import numpy as np

from ._common import record

REDUCIBLE = frozenset(np.dtype(t) for t in (
    np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64,
    np.uint8, np.uint16, np.uint32, np.uint64))
F16 = np.dtype(np.float16)
_PAIRWISE = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum}


def _combine(chunks: np.ndarray, op: str, r: int) -> np.ndarray:
    """Reduce ``(r, ...)`` float16 chunks over axis 0, wide, rounded once to float16.

    A loop over the ``r`` chunks (not over elements): numpy's reduction over a short
    leading axis is many times slower than ``r - 1`` vectorised additions.
    """
    if r == 1:  # one replica: the reduction is the input (sum, mean, max and min alike)
        return chunks[0].copy()
    if op in ("max", "min"):  # exact in float16: no widening needed
        out = chunks[0].copy()
        for j in range(1, r):
            _PAIRWISE[op](out, chunks[j], out=out)
        return out
    out = chunks[0].astype(np.float64)
    for j in range(1, r):
        out += chunks[j]  # float16 -> float64 is exact, and so is the running sum (see module doc)
    if op == "mean":
        out /= r
    return out.astype(F16)


def f16_reduce_scatter(x: np.ndarray, comm, op: str = "sum") -> np.ndarray:
    """``x``: C-contiguous float16 ``(r, *chunk)``; returns this replica's reduced
    ``chunk`` (float16), every replica's ``x[k]`` combined on replica ``k``."""
    r = comm.size
    send = x.view(np.uint16)
    recv = np.empty_like(send)
    comm.Alltoall(send, recv)
    record("reduce_scatter_sum", send.nbytes * (r - 1) // r if r else 0)
    return _combine(recv.view(F16), op, r)


def f16_reduce_scatter_v(x: np.ndarray, counts: np.ndarray, comm) -> np.ndarray:
    """Ragged float16 reduce-scatter-sum: replica ``k`` gets rows
    ``[offset_k, offset_k + counts[k])`` summed over replicas."""
    r, k = comm.size, comm.rank
    row = int(np.prod(x.shape[1:], dtype=np.int64))
    counts = np.asarray(counts, dtype=np.int64)
    send_sizes = counts * row
    mine = int(counts[k])
    recv = np.empty((r, mine, *x.shape[1:]), dtype=np.uint16)
    recv_sizes = np.full(r, mine * row, dtype=np.int64)
    comm.Alltoallv([x.view(np.uint16), (send_sizes, np.cumsum(send_sizes) - send_sizes)],
                   [recv, (recv_sizes, np.cumsum(recv_sizes) - recv_sizes)])
    record("reduce_scatter_sum", 2 * int(send_sizes.sum() - send_sizes[k]))
    return _combine(recv.view(F16), "sum", r)


def f16_all_reduce(x: np.ndarray, comm, op: str) -> np.ndarray:
    """All-reduce of a float16 array: float16 on the wire, combined in float64, rounded once."""
    r = comm.size
    if r == 1:
        return x.copy()
    flat = x.reshape(-1)
    n = flat.size
    c = -(-n // r)
    padded = np.zeros(r * c, dtype=F16)
    padded[:n] = flat
    chunk = f16_reduce_scatter(padded.reshape(r, c), comm, op)
    out = np.empty((r, c), dtype=np.uint16)
    comm.Allgather(chunk.view(np.uint16), out)
    record("all_reduce", chunk.nbytes * (r - 1))
    return out.view(F16).reshape(-1)[:n].reshape(x.shape)


def mpi_reduce_bytes(nbytes: int, r: int, all_reduce: bool) -> int:
    """Bytes one replica sends in an MPI reduction of ``nbytes`` (ring-algorithm figure:
    ``(r-1)/r * nbytes`` for a reduce-scatter, twice that for an all-reduce)."""
    return (2 if all_reduce else 1) * nbytes * (r - 1) // r if r else 0
