"""Scratch arrays reused between steps (no allocation on the hot path once warm), and
new arrays aligned for zero-copy hand-over."""

from __future__ import annotations

from math import prod

import numpy as np


class Buffers:
    """Named scratch arrays that grow (by doubling) and never shrink.

    ``get(name, shape, dtype)`` returns a C-contiguous view of the first
    ``prod(shape)`` elements of the array kept under ``name``; the view is valid until
    the next ``get`` of the same name.
    """

    def __init__(self):
        self._arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, shape, dtype) -> np.ndarray:
        if isinstance(shape, (int, np.integer)):
            size = int(shape)
            shape = None  # one dimension: the slice itself
        else:
            shape = tuple(shape)
            size = prod(shape)
        a = self._arrays.get(name)
        if a is None or a.dtype != dtype or a.size < size:
            dtype = np.dtype(dtype)
            grown = 2 * a.size if a is not None and a.dtype == dtype else 0
            a = self._arrays[name] = np.empty(max(size, grown, 16), dtype=dtype)
        return a[:size] if shape is None else a[:size].reshape(shape)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._arrays.values())


#: Byte alignment of the lookup results handed to the caller: XLA's CPU client (JAX's
#: ``jax.numpy.from_dlpack``) shares a host buffer only when its data starts on a
#: 64-byte boundary and copies it otherwise; numpy aligns to 16.
ALIGNMENT = 64


def aligned_empty(shape: tuple, dtype) -> np.ndarray:
    """A new C-contiguous array whose data starts on an :data:`ALIGNMENT`-byte boundary
    (a view into a slightly larger byte array, which it keeps alive)."""
    dtype = np.dtype(dtype)
    nbytes = prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)
