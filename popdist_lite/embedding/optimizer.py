"""Optimizer specs for host embeddings (the seed's ``HostEmbeddingOptimizerSpec``)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class HostEmbeddingOptimizerSpec:
    """SGD with a constant learning rate, applied by the replica that owns each row.

    ``row_i <- row_i - learning_rate * (sum of every replica's gradients for row i)``;
    duplicate indices accumulate. A learning rate of 0 makes the table not trainable
    (the seed's convention). Source: host-embeddings guide, section 15
    (``tensorflow.python.ipu.embedding_ops.HostEmbeddingOptimizerSpec``).

    Raises:
        ValueError: a negative, infinite or NaN learning rate.
    """

    learning_rate: float

    def __post_init__(self):
        lr = self.learning_rate
        if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
            raise ValueError(f"HostEmbeddingOptimizerSpec: argument learning_rate: expected a finite "
                             f"number >= 0, got {lr!r}")

    @property
    def trainable(self) -> bool:
        return self.learning_rate > 0
