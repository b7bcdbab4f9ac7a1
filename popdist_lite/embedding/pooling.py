"""A stack's outputs from its unique rows, and the update's gradient sums from the
outputs' gradients: one sparse matrix per stack and call (:class:`OutputMap`).

The exchange returns each stack's ``u`` unique rows ``U`` (``(u, e)``) and maps every
ID of the call to one of them. Every output row of the stack's features is a weighted
sum of unique rows: a pooled bag ``b`` with IDs ``i`` and weights ``w_i`` is
``sum_i (w_i / d_b) U[inverse_i]`` (``d_b`` the combiner's divisor: 1, the bag's weight
sum, or the square root of its squared weights' sum; SparseCore's combiners and
TorchRec's pooling), a sequence feature's row is ``U[inverse_i]``. So the outputs are
``M @ U`` for an ``(outputs, u)`` sparse matrix ``M``, and the gradient of ``U`` (the
sums the update sends to each row's replica, duplicates coalesced) is ``M.T @ G`` for
the outputs' gradient ``G``: the expansion, the pooling, the unpooling and the
coalescing of the one-table path (:mod:`.combiners`, :func:`._segment.sum_groups`) in
two sparse products (scipy's CSR), and no ``(n, e)`` array of per-ID rows or
gradients. When every output row is one ID of weight 1 (one ID per bag, or a sequence
feature) ``M`` is a selection: the outputs are one ``take`` of ``U`` and the sums one
segment sum.

Pooled rows come out in ``(b, f)`` order for a keyed output (bag ``b`` of every
feature side by side: TorchRec's ``KeyedTensor`` layout, ``(B, F * e)`` with no
transposition) or ``(f, b)`` order (feature after feature), then the sequence rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._buffers import aligned_empty
from ._segment import runs_of, sum_groups

SUM, MEAN, SQRTN = 0, 1, 2
_CODES = {"sum": SUM, "mean": MEAN, "sqrtn": SQRTN}


@dataclass
class FeatureRows:
    """One feature's IDs in its stack's ID array: ``[start, stop)``; ``lengths`` (its
    bags) and ``combiner`` for a pooled feature (``None`` for a sequence feature);
    ``weights`` ``float64[stop - start]`` or ``None``."""

    start: int
    stop: int
    lengths: np.ndarray | None = None
    combiner: str | None = None
    weights: np.ndarray | None = None


class OutputMap:
    """The matrix ``M`` of one stack's call (module docstring).

    Args:
        features: the stack's features (:class:`FeatureRows`), in the order of its IDs.
        inverse: ``intp[n]``, each ID's unique row.
        u: the number of unique rows.
        keyed: pooled rows in ``(b, f)`` order (every pooled feature has the same
            number of bags), else ``(f, b)``.

    Attributes:
        rows: output rows (pooled bags, then sequence IDs).
        pooled_rows: how many of them are pooled bags.
        index: the unique row of each output row when ``M`` is a selection, else ``None``.
        matrix: the scipy CSR matrix otherwise.
    """

    def __init__(self, features: list, inverse: np.ndarray, u: int, keyed: bool = False):
        self.u = u
        pooled = [f for f in features if f.lengths is not None]
        sequence = [f for f in features if f.lengths is None]
        n = len(inverse)
        # positions (in the stack's ID array) of the IDs of the pooled rows, in row order
        lengths = np.concatenate([f.lengths for f in pooled]).astype(np.intp) if pooled else np.zeros(0, np.intp)
        bags = lengths.size
        self.pooled_rows = bags
        if pooled and len(pooled) == len(features) and pooled[0].start == 0 and pooled[-1].stop == n and \
                all(a.stop == b.start for a, b in zip(pooled, pooled[1:])):
            ids_at = None  # the pooled IDs are the whole array, in order
        else:
            ids_at = np.concatenate([np.arange(f.start, f.stop) for f in pooled]) if pooled else np.zeros(0, np.intp)
        scale = self._scale(pooled, lengths, bags)
        unit = bool((lengths == 1).all()) and (scale is None or bool((scale == 1).all()))
        seq_at = np.concatenate([np.arange(f.start, f.stop) for f in sequence]) if sequence else None
        if keyed and len(pooled) > 1:
            per = len(pooled)
            b = pooled[0].lengths.size
            order = np.arange(bags).reshape(per, b).T.reshape(-1)  # (b, f) row -> its (f, b) bag
        else:
            order = None
        self.rows = bags + (0 if seq_at is None else seq_at.size)
        if unit:
            at = np.arange(bags) if ids_at is None else ids_at
            if order is not None:
                at = at[order]
            if seq_at is not None:
                at = np.concatenate([at, seq_at])
            self.index, self.matrix = inverse[at], None
            return
        self.index = None
        starts = np.zeros(bags + 1, np.intp)
        np.cumsum(lengths, out=starts[1:])
        pos = np.arange(starts[-1])  # pooled IDs, (f, b) order: their position among the pooled IDs
        if order is not None:  # the pooled IDs regrouped bag (b, f) after bag
            lengths_bf = lengths[order]
            first_bf = starts[:-1][order]
            run = np.zeros(lengths_bf.size + 1, np.intp)
            np.cumsum(lengths_bf, out=run[1:])
            pos = np.repeat(first_bf - run[:-1], lengths_bf) + np.arange(run[-1])
            indptr = run
        else:
            indptr = starts
        at = pos if ids_at is None else ids_at[pos]
        data = np.ones(pos.size) if scale is None else scale[pos]
        columns = inverse[at]
        if seq_at is not None:
            indptr = np.concatenate([indptr, indptr[-1] + np.arange(1, seq_at.size + 1)])
            columns = np.concatenate([columns, inverse[seq_at]])
            data = np.concatenate([data, np.ones(seq_at.size)])
        from scipy.sparse import csr_array  # 0.17 s to import: only where bags are pooled

        self.matrix = csr_array((data, columns, indptr), shape=(self.rows, u))

    @staticmethod
    def _scale(pooled: list, lengths: np.ndarray, bags: int) -> np.ndarray | None:
        """``w_i / d_b`` of every pooled ID in ``(f, b)`` order, or ``None`` when all are 1."""
        weighted = any(f.weights is not None for f in pooled)
        combiners = {f.combiner for f in pooled}
        if not weighted and combiners <= {"sum"}:
            return None
        n = int(lengths.sum())
        w = np.concatenate([f.weights if f.weights is not None else np.ones(f.stop - f.start) for f in pooled]) \
            if weighted else np.ones(n)
        bag = np.repeat(np.arange(bags), lengths)
        code = np.repeat(np.array([_CODES[f.combiner] for f in pooled]), [f.lengths.size for f in pooled])
        divisor = np.ones(bags)
        if (code == MEAN).any():
            divisor = np.where(code == MEAN, np.bincount(bag, weights=w, minlength=bags), divisor)
        if (code == SQRTN).any():
            divisor = np.where(code == SQRTN, np.sqrt(np.bincount(bag, weights=w * w, minlength=bags)), divisor)
        with np.errstate(divide="ignore", invalid="ignore"):
            inverse = np.where(divisor != 0, 1.0 / divisor, 0.0)
        return w * inverse[bag]

    def forward(self, unique: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The ``(rows, e)`` outputs from the unique rows ``(u, e)``, in their dtype
        (into ``out`` when given; else a new 64-byte-aligned array)."""
        rows, e = self.rows, unique.shape[1]
        if out is None:
            out = aligned_empty((rows, e), unique.dtype)
        if self.index is not None:
            if rows:
                unique.take(self.index, axis=0, out=out, mode="clip")
            return out
        acc = np.float32 if unique.dtype == np.float16 else unique.dtype
        if rows:
            np.copyto(out, self.matrix @ unique.astype(acc, copy=False), casting="unsafe")
        return out

    def backward(self, grads: np.ndarray, acc) -> np.ndarray:
        """The ``(u, e)`` sums of ``acc`` dtype of the outputs' gradients ``(rows, e)``
        per unique row (``M.T @ grads``)."""
        if self.index is not None:
            if not self.rows:
                return np.zeros((self.u, grads.shape[1]), acc)
            perm, starts = runs_of(self.index, self.u)
            return sum_groups(grads, perm, starts, dtype=acc)
        return np.asarray(self.matrix.T @ grads.astype(acc, copy=False)).astype(acc, copy=False)
