"""Multivalent features: bags of IDs per sample, pooled with a combiner. Pure numpy.

Source: SparseCore ``FeatureSpec``/``TableSpec`` combiners ``"sum"``, ``"mean"``,
``"sqrtn"`` (jax-tpu-embedding; divisors 1, the sum of the weights, the square root of the
sum of the squared weights) and TorchRec's pooled embedding bags (SUM/MEAN). Used by
:meth:`HostEmbedding.lookup_bags` and :meth:`HostEmbedding.apply_bag_gradients`.

Bags, on one replica:

- ragged: ``values`` ``int[n]`` and ``lengths`` ``int[B]`` (``lengths.sum() == n``;
  bag ``b`` is the next ``lengths[b]`` values), or
- padded: ``values`` ``int[..., L]`` (batch shape ``values.shape[:-1]``), positions equal
  to ``padding_id`` are not part of their bag;
- optional ``weights`` of ``values.shape`` (float; default 1 per ID).

Bag ``b`` with IDs ``i`` and weights ``w_i`` pools to ``sum_i w_i * row_i / d_b`` with
``d_b = 1`` (``"sum"``), ``sum_i w_i`` (``"mean"``) or ``sqrt(sum_i w_i**2)``
(``"sqrtn"``). An empty bag (or a divisor of 0) pools to a row of zeros. The gradient
of the pooled row ``g_b`` reaches each ID as ``g_b * w_i / d_b`` (weights are constants).

Where pooling happens: the rows of a bag's IDs come back from their owners (whatever
replica they live on) before the bag is pooled on the replica that holds the bag, so
the divisor is always the bag's whole weight sum. TorchRec#2362 pooled partial bags on
each shard and divided by the *local* count; that cannot happen here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._buffers import aligned_empty
from ._segment import sum_groups

COMBINERS = ("sum", "mean", "sqrtn")


@dataclass
class Bags:
    """Bags flattened for one lookup: ``ids`` ``int64[n]`` (padding removed, bag order),
    ``scale`` ``float64[n]`` (``w_i / d_b``), ``starts``/``sizes`` ``int[B]`` of each bag's
    run in ``ids``, ``shape``: the batch shape (the output is ``shape + (e,)``); ``bag``
    ``int[n]``: each ID's bag; ``unit``: every bag holds exactly one ID of scale 1, so
    pooling and its gradient are the identity (no arithmetic, no copy)."""

    ids: np.ndarray
    scale: np.ndarray
    starts: np.ndarray
    sizes: np.ndarray
    shape: tuple
    bag: np.ndarray | None = None
    unit: bool = False


def make_bags(values, lengths=None, weights=None, combiner: str = "sum", padding_id=None) -> Bags:
    """Validate and flatten one replica's bags (format in the module docstring).

    Raises:
        ValueError: unknown combiner, ``lengths`` that do not add up to ``values.size``,
            negative lengths, ``weights`` of another shape, ``lengths`` with 2-D values.
        TypeError: non-integer ``values``/``lengths`` or non-float ``weights``.
    """
    if combiner not in COMBINERS:
        raise ValueError(f"argument combiner: expected one of {', '.join(map(repr, COMBINERS))}, got {combiner!r}")
    values = np.asarray(values)
    if values.dtype.kind not in "iu":
        raise TypeError(f"argument values: expected an integer dtype, got {values.dtype}")
    if weights is not None:
        weights = np.asarray(weights)
        if weights.shape != values.shape:
            raise ValueError(f"argument weights: expected the shape of values {values.shape}, got {weights.shape}")
        if weights.dtype.kind not in "fiu":
            raise TypeError(f"argument weights: expected a real dtype, got {weights.dtype}")
    if lengths is not None:
        lengths = np.asarray(lengths)
        if values.ndim != 1:
            raise ValueError(f"argument lengths: expected 1-D values with lengths (ragged), got values of "
                             f"shape {values.shape}; pass padded 2-D values without lengths")
        if lengths.dtype.kind not in "iu" or lengths.ndim != 1:
            raise TypeError(f"argument lengths: expected a 1-D integer array, got {lengths.dtype}{list(lengths.shape)}")
        if (lengths < 0).any() or int(lengths.sum()) != values.size:
            raise ValueError(f"argument lengths: expected non-negative lengths adding up to values.size = "
                             f"{values.size}, got a sum of {int(lengths.sum())} (min {int(lengths.min(initial=0))})")
        ids = values.astype(np.int64)
        w = np.ones(ids.size) if weights is None else weights.astype(np.float64).reshape(-1)
        sizes = lengths.astype(np.intp)
        shape = (lengths.size,)
    else:
        if values.ndim < 1:
            raise ValueError("argument values: expected at least 1 dimension (bags on the last axis)")
        shape = values.shape[:-1]
        ids = values.reshape(-1).astype(np.int64)
        w = np.ones(ids.size) if weights is None else weights.astype(np.float64).reshape(-1)
        width = values.shape[-1]
        if padding_id is None:
            sizes = np.full(int(np.prod(shape, dtype=np.int64)), width, dtype=np.intp)
        else:
            real = ids != padding_id
            sizes = real.reshape(-1, width).sum(axis=1).astype(np.intp) if width else \
                np.zeros(int(np.prod(shape, dtype=np.int64)), dtype=np.intp)
            ids, w = ids[real], w[real]
    starts = np.cumsum(sizes) - sizes
    bag = None
    if combiner == "sum" and weights is None:
        scale = w  # ones
    else:
        bag = np.repeat(np.arange(sizes.size), sizes)
        if combiner == "sum":
            divisor = np.ones(sizes.size)
        elif combiner == "mean":
            divisor = np.bincount(bag, weights=w, minlength=sizes.size)
        else:
            divisor = np.sqrt(np.bincount(bag, weights=w * w, minlength=sizes.size))
        with np.errstate(divide="ignore", invalid="ignore"):
            inverse = np.where(divisor != 0, 1.0 / divisor, 0.0)
        scale = w * inverse[bag]
    unit = ids.size == sizes.size and bool((sizes == 1).all()) and bool((scale == 1).all())
    if unit:
        bag = None
    elif bag is None:
        bag = np.repeat(np.arange(sizes.size), sizes)
    return Bags(ids, scale, starts, sizes, tuple(shape), bag, unit)


def acc_dtype(dtype) -> np.dtype:
    """Accumulation dtype for a table dtype (float32 for float16)."""
    return np.dtype(np.float32) if np.dtype(dtype) == np.float16 else np.dtype(dtype)


def pool(rows: np.ndarray, bags: Bags, overwrite_rows: bool = False) -> np.ndarray:
    """Pool looked-up rows ``(n, e)`` (in ``bags.ids`` order) to ``bags.shape + (e,)``,
    in the rows' dtype (accumulated in float32 for float16).

    Bags of one ID of scale 1 (``bags.unit``) return ``rows`` itself, reshaped. Else
    the rows are scaled (in place when ``overwrite_rows`` and they are already in the
    accumulation dtype) and each bag's run is summed in order: one ``sum`` over a
    ``(B, L, e)`` view when every bag holds ``L`` IDs, else
    :func:`._segment.sum_groups` (a sparse matrix product). The result is a new array
    aligned for zero-copy hand-over (:func:`._buffers.aligned_empty`), except for unit
    bags, which return the caller's rows.
    """
    n, e = rows.shape
    out_shape = bags.shape + (e,)
    if bags.unit:
        return rows.reshape(out_shape)
    acc = acc_dtype(rows.dtype)
    if overwrite_rows and rows.dtype == acc:
        weighted = rows
        weighted *= bags.scale.astype(acc, copy=False)[:, None]
    else:
        weighted = rows.astype(acc) * bags.scale.astype(acc, copy=False)[:, None]
    count = bags.sizes.size
    out = aligned_empty((count, e), acc)
    sizes = bags.sizes
    if n == 0:
        out[...] = 0
    elif sizes.size and (sizes == sizes[0]).all():
        np.sum(weighted.reshape(count, int(sizes[0]), e), axis=1, out=out)
    else:
        full = np.flatnonzero(sizes)
        sums = sum_groups(weighted, np.arange(n), bags.starts[full])
        if full.size < count:
            out[...] = 0
        out[full] = sums
    if out.dtype != rows.dtype:
        final = aligned_empty((count, e), rows.dtype)
        final[...] = out
        out = final
    return out.reshape(out_shape)


def unpool(grads: np.ndarray, bags: Bags, e: int, dtype) -> np.ndarray:
    """Gradient of each ID ``(n, e)`` from the gradient of the pooled rows
    ``bags.shape + (e,)``: ``g_b * w_i / d_b`` (in the accumulation dtype, then
    ``dtype``). Unit bags (one ID of scale 1 each) pass ``grads`` through, reshaped and
    cast to ``dtype`` only when it differs (no copy)."""
    grads = np.asarray(grads)
    g = grads.reshape(-1, e)
    if bags.unit:
        return g.astype(dtype, copy=False)
    acc = acc_dtype(dtype)
    per_id = np.take(g, bags.bag, axis=0).astype(acc, copy=False)
    per_id *= bags.scale.astype(acc, copy=False)[:, None]
    return per_id.astype(dtype, copy=False)
