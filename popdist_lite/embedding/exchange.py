"""The exchange interface: how a table's lookups and updates cross replicas.

A :class:`HostEmbedding` holds its partition of the table (:mod:`.token`,
:mod:`.encoding`) and one :class:`Exchange`, chosen when the table is created:

- ``"sparse"`` (TOKEN): :class:`~popdist_lite.embedding.sparse.SparseTokenExchange`,
  deduplicated IDs to their owner only;
- ``"dense"`` (TOKEN and ENCODING): :class:`DenseExchange`, the TF-IPU host-embedding
  guide's algorithms (section 15.3.1): every replica's indices are all-gathered, then the
  partition's ``lookup``/``gradient_sums`` move the rows.

Both check every replica's arguments on every replica before any row moves, and feed
the same optimizer step with ``(rows, sums)``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..collectives.all_gather import gather_rows
from ..collectives import Problem


class Exchange(Protocol):
    """What a table's exchange does (every method is a collective)."""

    def lookup(self, shard: np.ndarray, flat: np.ndarray, problem: Problem | None = None) -> np.ndarray:
        """Rows of the whole table for this replica's indices.

        Args:
            shard: this replica's partition (the values lookups serve).
            flat: C-contiguous ``int64[n]`` indices (``n`` may differ per replica, may be 0).
            problem: this replica's own :class:`Problem`, raised on every replica.

        Returns:
            ``(n, e)`` array of ``shard.dtype``.

        Raises:
            IndexError: on every replica, for an index outside ``[0, t)`` on any replica.
            TypeError, ValueError: on every replica, for any replica's ``problem``.
        """

    def gradient_sums(self, flat: np.ndarray, grads: np.ndarray | None, problem: Problem | None = None,
                      trainable: bool = True) -> tuple[np.ndarray, np.ndarray] | None:
        """The local rows of this replica's partition touched by any replica and the
        sum of every replica's gradients for each.

        Args:
            flat: C-contiguous ``int64[n]`` indices.
            grads: C-contiguous ``(n, e)`` gradients in the lookup dtype.
            problem: as for :meth:`lookup`.
            trainable: when False only the checks run and ``None`` is returned.

        Returns:
            ``(rows, sums)``: unique local rows ``int[m]`` and their ``(m, c)`` gradient
            sums (float32 for float16 tables), or ``None``.

        Raises:
            as :meth:`lookup`; nothing is returned (so nothing is updated) on error.
        """


class DenseExchange:
    """The dense exchange of a TOKEN or ENCODING table (implements :class:`Exchange`):
    all-gather every replica's indices, check them on every replica, then run the
    partition's algorithm (:class:`~.token.TokenPartition`, :class:`~.encoding.EncodingPartition`).

    Args:
        name: the table's name (error messages).
        partition: the table's partition.
        comm: the replica communicator.
    """

    def __init__(self, name: str, partition, comm):
        self.name, self.partition, self.comm = name, partition, comm

    def _gather_indices(self, flat: np.ndarray, problem: Problem | None):
        """``(gathered, counts)``: every replica's indices, after checking them on every
        replica (TypeError/ValueError/IndexError on every replica for any replica's bad input)."""
        t = self.partition.t
        gathered, counts = gather_rows(flat, self.comm, problem=problem, name="indices")
        bad = np.flatnonzero((gathered < 0) | (gathered >= t))
        if bad.size:
            p = int(bad[0])
            r = int(np.searchsorted(np.cumsum(counts), p, side="right"))
            raise IndexError(f"host embedding {self.name!r}: replica {r} passed index {int(gathered[p])}, "
                             f"expected indices in [0, {t}) (pass clip_indices=True to clip instead); "
                             f"nothing was looked up or updated")
        return gathered, counts

    def lookup(self, shard, flat, problem=None):
        gathered, counts = self._gather_indices(flat, problem)
        return self.partition.lookup(shard, gathered, counts, self.comm)

    def gradient_sums(self, flat, grads, problem=None, trainable=True):
        gathered, counts = self._gather_indices(flat, problem)
        return self.partition.gradient_sums(gathered, counts, grads, self.comm) if trainable else None
