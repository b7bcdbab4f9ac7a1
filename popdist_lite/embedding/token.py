"""TOKEN partitioning: the table is split on the token (row) axis.

Row ``i`` lives on replica ``i % r`` at local row ``i // r``; every replica holds
``ceil(t/r)`` rows (padding rows at the end are never read). Source: the TF-IPU
host-embedding guide, section 15.3.1, "Token strategy" pseudo-code.

Lookup (the guide's algorithm): all-gather the indices, gather ``index // r`` from the
local shard for the indices whose ``index % r`` is this replica and zeros for the
others (the guide gathers every index, then zeroes: the same rows, but a disk table
would read rows it does not own), reduce-scatter-sum so each replica gets its own
positions back.

Update (our design, the transpose of the lookup): the reduce-scatter's adjoint is an
all-gather, so every replica all-gathers the gradients (it already has the gathered
indices), keeps the rows it owns, coalesces duplicates with a segment sum and applies
SGD once per row. Bytes per replica: ``N_total * e`` received for both directions.
"""

from __future__ import annotations

import numpy as np

from ..collectives.all_gather import gather_rows
from ..collectives.reduce_scatter import reduce_scatter_sum_v
from ._segment import segment_sum


class TokenPartition:
    name = "TOKEN"

    def __init__(self, num_tokens: int, encoding: int, num_replicas: int, replica: int):
        self.t, self.e, self.r, self.k = num_tokens, encoding, num_replicas, replica
        self.rows = -(-num_tokens // num_replicas)
        self.shard_shape = (self.rows, encoding)

    def shard_from_block(self, block: np.ndarray, first_row: int, shard: np.ndarray) -> None:
        """Copy the rows of ``block`` (global rows ``first_row...``) that this replica owns."""
        start = (self.k - first_row) % self.r
        mine = block[start::self.r]
        local0 = (first_row + start) // self.r
        shard[local0:local0 + len(mine)] = mine

    def lookup(self, shard: np.ndarray, gathered: np.ndarray, counts: np.ndarray, comm) -> np.ndarray:
        if self.r == 1:
            rows = np.take(shard, gathered, axis=0)
        else:  # only the rows this replica owns are read (a disk table reads no others from its file)
            mine = (gathered % self.r) == self.k
            rows = np.zeros((len(gathered), shard.shape[1]), dtype=shard.dtype)
            rows[mine] = np.take(shard, gathered[mine] // self.r, axis=0)
        return reduce_scatter_sum_v(rows, counts, comm=comm)

    def gradient_sums(self, gathered: np.ndarray, counts: np.ndarray, grads: np.ndarray, comm):
        """Owned local rows and the sum of every replica's gradients for each."""
        all_grads, _ = gather_rows(grads, comm, name="grads")
        mine = (gathered % self.r) == self.k
        return segment_sum(gathered[mine] // self.r, all_grads[mine], dtype=np.float32 if grads.dtype == np.float16 else None)

    def assemble(self, shards: np.ndarray) -> np.ndarray:
        """Full ``(t, e)`` table from all-gathered shards ``(r, ceil(t/r), e)``."""
        return shards.transpose(1, 0, 2).reshape(self.rows * self.r, self.e)[:self.t]
