"""Receive buffers: reuse the arrays of batches the training loop has dropped.

Freshly allocated large arrays cost page faults on first touch (numpy's allocator
returns big blocks to the system when they are freed), which slows the receive of large
batches (figures in docs/infeed.md). So the replica keeps the arrays of its last few
batches and receives into one again only when nothing else refers to it any more (its
reference count shows that only this pool holds it: no batch, view or slice of it is
alive in the training loop). Otherwise it allocates a new one. The pool outlives a
feed session (:func:`shared_pool`), so the next epoch's feed receives into the arrays the
last one left.
"""

from __future__ import annotations

import collections
import sys

import numpy as np

#: References to a pooled array when only the pool holds it: the pool's deque, the
#: local variable in :meth:`BufferPool.empty` and the argument of ``sys.getrefcount``.
_FREE_REFCOUNT = 3


class BufferPool:
    """Arrays of recent batches, handed out again once the training loop drops them."""

    def __init__(self, size: int):
        self.arrays: collections.deque[np.ndarray] = collections.deque(maxlen=max(1, size))

    def resize(self, size: int) -> "BufferPool":
        """Keep at most ``size`` (>= 1) arrays from now on, the most recent ones."""
        if self.arrays.maxlen != max(1, size):
            self.arrays = collections.deque(self.arrays, maxlen=max(1, size))
        return self

    def empty(self, shape: tuple, dtype: np.dtype) -> np.ndarray:
        """An array of ``shape``/``dtype`` nobody else refers to: the most recently used
        dropped one (likeliest to be in cache), or a new one."""
        for i in reversed(range(len(self.arrays))):
            a = self.arrays[i]
            if a.shape == shape and a.dtype == dtype and sys.getrefcount(a) <= _FREE_REFCOUNT:
                del self.arrays[i]
                self.arrays.append(a)
                return a
        a = np.empty(shape, dtype=dtype)
        self.arrays.append(a)
        return a


_shared = BufferPool(1)


def shared_pool(size: int) -> BufferPool:
    """This process's pool, kept between feed sessions, holding at most ``size`` arrays."""
    return _shared.resize(size)
