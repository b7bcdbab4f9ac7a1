"""ENCODING partitioning: the table is split on the encoding (column) axis.

Replica ``k`` holds columns ``[k*c, (k+1)*c)`` of every row, ``c = ceil(e/r)``,
zero-padded past ``e``. Source: the TF-IPU host-embedding guide, section 15.3.1,
"Encoding strategy" pseudo-code.

Lookup (the guide's algorithm): all-gather the indices, gather every index's ``c``
columns from the local shard, all-to-all so replica ``j`` receives its own indices'
column slices from every replica, transpose ``[r, n, c] -> [n, r, c]``, flatten to
``[n, r*c]``, slice off the padding.

Update (our design, the transpose of the lookup): pad the gradients to ``r*c``
columns, split them into ``r`` column slices and all-to-all them back so replica ``k``
receives the gradients for its columns for every replica's indices; coalesce
duplicates with a segment sum and apply SGD once per row.
"""

from __future__ import annotations

import numpy as np

from ..collectives.all_reduce import all_reduce
from ..collectives.all_to_all import exchange_rows
from ._segment import segment_sum


class EncodingPartition:
    name = "ENCODING"

    def __init__(self, num_tokens: int, encoding: int, num_replicas: int, replica: int):
        self.t, self.e, self.r, self.k = num_tokens, encoding, num_replicas, replica
        self.cols = -(-encoding // num_replicas)
        self.shard_shape = (num_tokens, self.cols)

    def shard_from_block(self, block: np.ndarray, first_row: int, shard: np.ndarray) -> None:
        """Copy this replica's columns of ``block`` (global rows ``first_row...``)."""
        mine = block[:, self.k * self.cols:(self.k + 1) * self.cols]
        shard[first_row:first_row + len(block), :mine.shape[1]] = mine

    def lookup(self, shard: np.ndarray, gathered: np.ndarray, counts: np.ndarray, comm) -> np.ndarray:
        n = int(counts[self.k])
        rows = np.take(shard, gathered, axis=0)
        recv = exchange_rows(rows, counts, np.full(self.r, n, dtype=np.int64), comm)
        return recv.reshape(self.r, n, self.cols).transpose(1, 0, 2).reshape(n, self.r * self.cols)[:, :self.e]

    def gradient_sums(self, gathered: np.ndarray, counts: np.ndarray, grads: np.ndarray, comm):
        """All rows touched by any replica and the sums of their gradients in my columns."""
        n = grads.shape[0]
        padded = np.zeros((n, self.r * self.cols), dtype=grads.dtype)
        padded[:, :self.e] = grads
        send = np.ascontiguousarray(padded.reshape(n, self.r, self.cols).transpose(1, 0, 2)).reshape(self.r * n, self.cols)
        recv = exchange_rows(send, np.full(self.r, n, dtype=np.int64), counts, comm)
        return segment_sum(gathered, recv, dtype=np.float32 if grads.dtype == np.float16 else None)

    def row_sum(self, x: np.ndarray, comm) -> np.ndarray:
        """``(u, c) -> (u,)``: each touched row's sum over all ``e`` columns, i.e. my
        columns summed locally, then over replicas (every replica holds the same touched
        rows, so the all-reduce lines up). Used by row-wise optimizers."""
        return all_reduce(np.ascontiguousarray(x.sum(axis=1)), comm=comm)

    def assemble(self, shards: np.ndarray) -> np.ndarray:
        """Full ``(t, e)`` table from all-gathered shards ``(r, t, c)``."""
        return shards.transpose(1, 0, 2).reshape(self.t, self.r * self.cols)[:, :self.e]
