"""dtype handling for reductions: which dtypes reduce, and float16 through float32."""

from __future__ import annotations

import numpy as np

REDUCIBLE = frozenset(np.dtype(t) for t in (
    np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64,
    np.uint8, np.uint16, np.uint32, np.uint64))


def to_wire(x: np.ndarray) -> np.ndarray:
    """The array to reduce: float16 is widened to float32 (MPI has no portable float16 sum)."""
    return x.astype(np.float32) if x.dtype == np.float16 else x


def from_wire(out: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Back to the caller's dtype, rounding a float16 result once."""
    return out.astype(dtype, copy=False)
