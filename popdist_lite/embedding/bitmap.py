"""Deduplication of integer keys with a bitmap: ``O(size + n)``, no sort.

Worth it when the key space is at most a few dozen times the number of keys (the
callers decide with their own thresholds); the bitmap is allocated once and kept
between calls, all False.
"""

from __future__ import annotations

import numpy as np


class Bitmap:
    """A ``bool[size]`` bitmap (all False between calls) for keys in ``[0, size)``.

    Args:
        size: the key space.
    """

    def __init__(self, size: int):
        self.seen = np.zeros(size, dtype=bool)
        self._position: np.ndarray | None = None

    def unique(self, keys: np.ndarray) -> np.ndarray:
        """The distinct ``keys``, sorted (``intp``); ``keys`` must lie in ``[0, size)``."""
        seen = self.seen
        seen[keys] = True
        unique = np.flatnonzero(seen)
        seen[unique] = False
        return unique

    def unique_inverse(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(unique, inverse)``: :meth:`unique` and the position of each key in it
        (``unique[inverse] == keys``)."""
        if self._position is None:
            self._position = np.empty(self.seen.size, dtype=np.intp)
        unique = self.unique(keys)
        self._position[unique] = np.arange(unique.size)
        return unique, self._position[keys]
