"""Dense optimizers for numpy parameters (local, no communication).

Wrap one in :class:`popdist_lite.CrossReplicaOptimizer` for data-parallel training.
"""

from __future__ import annotations

import math

import numpy as np


class MomentumSGD:
    """SGD with momentum, as TensorFlow's ``MomentumOptimizer`` (the seed's choice):
    ``v <- momentum * v + g``; ``w <- w - learning_rate * v``. ``momentum=0`` is plain SGD.

    Raises:
        ValueError: a learning rate or momentum that is negative or not finite.
    """

    def __init__(self, learning_rate: float, momentum: float = 0.0):
        for arg, value in (("learning_rate", learning_rate), ("momentum", momentum)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"MomentumSGD: argument {arg}: expected a finite number >= 0, got {value!r}")
        self.learning_rate = float(learning_rate)
        self.momentum = float(momentum)
        self.velocity: dict[str, np.ndarray] = {}

    def update(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> None:
        """Update ``params`` in place from ``grads`` (same keys and shapes)."""
        for name, w in params.items():
            g = grads[name]
            if self.momentum:
                v = self.velocity.get(name)
                if v is None:
                    v = self.velocity[name] = np.zeros_like(w)
                v *= self.momentum
                v += g
                g = v
            w -= (self.learning_rate * g).astype(w.dtype, copy=False)
