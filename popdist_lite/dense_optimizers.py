"""Dense optimizers for numpy parameters (local, no communication).

Wrap one in :class:`popdist_lite.CrossReplicaOptimizer` for data-parallel training.
Every optimizer here is element-wise, so it can also update a flat shard of the
parameters (replicated tensor sharding, ``shard_optimizer_state=True``).

Updates are computed in float32 (float64 for float64 parameters) from float32
optimizer state, whatever the parameter dtype, and written back once: a float16
parameter is rounded once per step, to nearest or stochastically (see
:mod:`popdist_lite.stochastic_rounding`), instead of accumulating float16 roundings.
"""

from __future__ import annotations

import numpy as np

from .stochastic_rounding import StochasticRounding
from .validation import check_number

__all__ = ["DenseOptimizer", "SGD", "MomentumSGD", "Adam"]


class DenseOptimizer:
    """Base of the element-wise dense optimizers.

    ``update(params, grads)`` changes ``params`` in place; state is kept per parameter
    name in :attr:`state` (float32 arrays of the parameter's shape, or float64 for
    float64 parameters).
    """

    def __init__(self):
        self.state: dict[str, dict[str, np.ndarray]] = {}

    def _new_value(self, name: str, w: np.ndarray, g: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def begin_step(self) -> None:
        """Called once per :meth:`update` before any parameter (step counters)."""

    def update(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray], *,
               rounding: StochasticRounding | None = None, replicated: bool = True) -> None:
        """Update ``params`` in place from ``grads`` (same keys and shapes).

        Args:
            params: name -> float array (float16/32/64).
            grads: name -> float array of the same shape (any float dtype; used in
                float32, or float64 for float64 parameters).
            rounding: how float16 parameters are rounded (default: to nearest).
            replicated: whether every replica computes this same update (dense
                weights) rather than only this one (a shard); selects the random stream
                of stochastic rounding.
        """
        self.begin_step()
        for name, w in params.items():
            cdt = np.result_type(w.dtype, np.float32)
            new = self._new_value(name, w.astype(cdt), np.asarray(grads[name]).astype(cdt, copy=False))
            if rounding is not None:
                w[...] = rounding.cast(new, w.dtype, replicated=replicated)
            else:
                w[...] = new.astype(w.dtype, copy=False)

    def _slot(self, name: str, slot: str, like: np.ndarray) -> np.ndarray:
        slots = self.state.setdefault(name, {})
        if slot not in slots:
            slots[slot] = np.zeros(like.shape, like.dtype)
        return slots[slot]

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this process."""
        return int(sum(a.nbytes for slots in self.state.values() for a in slots.values()))


class MomentumSGD(DenseOptimizer):
    """SGD with momentum, as TensorFlow's ``MomentumOptimizer`` (the half-precision
    tutorial's choice):
    ``v <- momentum * v + g``; ``w <- w - learning_rate * v``. ``momentum=0`` is plain
    SGD (no state).

    Raises:
        ValueError: a learning rate or momentum that is negative or not finite.
    """

    def __init__(self, learning_rate: float, momentum: float = 0.0):
        super().__init__()
        self.learning_rate = check_number("MomentumSGD", "learning_rate", learning_rate)
        self.momentum = check_number("MomentumSGD", "momentum", momentum)

    @property
    def velocity(self) -> dict[str, np.ndarray]:
        """name -> velocity (kept for the original attribute name)."""
        return {name: slots["velocity"] for name, slots in self.state.items() if "velocity" in slots}

    def _new_value(self, name, w, g):
        if self.momentum:
            v = self._slot(name, "velocity", w)
            v *= self.momentum
            v += g
            g = v
        return w - self.learning_rate * g


class SGD(MomentumSGD):
    """Plain SGD, ``w <- w - learning_rate * g`` (``MomentumSGD`` with momentum 0)."""

    def __init__(self, learning_rate: float):
        super().__init__(learning_rate, momentum=0.0)


class Adam(DenseOptimizer):
    """Adam (Kingma & Ba, 2015), the paper's form with bias correction::

        t <- t + 1;  m <- beta1 m + (1 - beta1) g;  v <- beta2 v + (1 - beta2) g**2
        w <- w - learning_rate * (m / (1 - beta1**t)) / (sqrt(v / (1 - beta2**t)) + epsilon)

    ``t`` counts :meth:`update` calls. State (``m``, ``v``) is float32, so the warning of
    Graphcore's half- and mixed-precision tutorial about epsilon = 1e-8 underflowing in
    float16 does not apply.

    Raises:
        ValueError: a negative learning rate, betas outside ``[0, 1)``, epsilon <= 0.
    """

    def __init__(self, learning_rate: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8):
        super().__init__()
        self.learning_rate = check_number("Adam", "learning_rate", learning_rate)
        self.beta1 = check_number("Adam", "beta1", beta1, 0.0, 1.0, high_open=True)
        self.beta2 = check_number("Adam", "beta2", beta2, 0.0, 1.0, high_open=True)
        self.epsilon = check_number("Adam", "epsilon", epsilon, low_open=True)
        self.steps = 0

    def begin_step(self):
        self.steps += 1

    def _new_value(self, name, w, g):
        m, v = self._slot(name, "m", w), self._slot(name, "v", w)
        m *= self.beta1
        m += (1 - self.beta1) * g
        v *= self.beta2
        v += (1 - self.beta2) * g * g
        m_hat = m / (1 - self.beta1 ** self.steps)
        v_hat = v / (1 - self.beta2 ** self.steps)
        return w - self.learning_rate * m_hat / (np.sqrt(v_hat) + self.epsilon)

    def state_bytes(self) -> int:
        return super().state_bytes() + 8  # the step counter
