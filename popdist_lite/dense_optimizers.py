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
    float64 parameters), one array per name in :attr:`slot_names`, created by
    :meth:`init` (Optax's ``init(params)``) or at the first update.

    Checkpoints (the ``Stateful`` protocol of :mod:`popdist_lite.checkpoint`): the slots
    (replicated) and the step counter. An optimizer that has state (after :meth:`init`
    or an update) loads into its own arrays, whose shapes and dtypes come from the
    parameters; one without takes the checkpoint's slots, each checked before anything
    is allocated (the load allocates them once their files were checked): a slot of
    this optimizer in a float dtype (:meth:`checkpoint_slot`), and of the shape and
    dtype of its parameter, the live array of the parameter's name in the state being
    loaded (``{"params": params, "opt": opt}``: ``params/w`` for the slots ``w/m``,
    ``w/v``; :meth:`check_claims`). A slot whose parameter is not in that state is
    compared with the parameters at the next update, which has them.
    """

    #: The names of the arrays kept per parameter.
    slot_names: tuple[str, ...] = ()

    def __init__(self):
        self.state: dict[str, dict[str, np.ndarray]] = {}
        self._check_next = False  # state came from a checkpoint: compare it with the parameters first

    def init(self, params: dict[str, np.ndarray]) -> None:
        """Create the (zero) state of every parameter in ``params`` that has none yet,
        shaped as the parameter, in float32 (float64 for float64 parameters)."""
        for name, w in params.items():
            like = np.empty(np.shape(w), np.result_type(np.asarray(w).dtype, np.float32))
            for slot in self.slot_names:
                self._slot(name, slot, like)

    def check_state(self, params: dict[str, np.ndarray]) -> None:
        """Raise ``ValueError`` unless every slot of :attr:`state` has the shape and
        dtype the parameter of its name needs (state loaded into a fresh optimizer is
        checked here, before its first update changes anything)."""
        for name, slots in self.state.items():
            w = params.get(name)
            for slot, array in slots.items():
                want = None if w is None else (np.shape(w), np.result_type(np.asarray(w).dtype, np.float32))
                if want is None or slot not in self.slot_names or (array.shape, array.dtype) != want:
                    expected = "no such slot" if want is None or slot not in self.slot_names else \
                        f"{want[1]}{list(want[0])}"
                    raise ValueError(f"{type(self).__name__}: state {name}/{slot}: expected {expected}, got "
                                     f"{array.dtype}{list(array.shape)} (from a checkpoint of other parameters?)")

    def checkpoint_slot(self, relative: str, shape: tuple, dtype: np.dtype) -> None:
        """Accept a slot ``"<param>/<slot>"`` of a checkpoint for this optimizer's state
        before it has any (see the class docstring).

        Raises:
            ValueError: not a slot of this optimizer, or not a float32/float64 array in
                the machine's byte order.
        """
        _, _, slot = relative.rpartition("/")
        if slot not in self.slot_names:
            raise ValueError(f"{type(self).__name__} keeps {list(self.slot_names) or 'no state'}, not {slot!r}")
        if np.dtype(dtype) not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise ValueError(f"optimizer state is float32 or float64 (native byte order), got {np.dtype(dtype).str}")

    def check_claims(self, claims: dict, live: dict) -> None:
        """Compare the checkpoint's slots ``claims`` (``"<param>/<slot>"`` -> saved
        ``(shape, dtype)``) with the parameters among ``live`` (name -> ``(shape,
        dtype)`` of the state being loaded): a slot of parameter ``w`` must have the
        shape of a live array named ``w`` or ``.../w`` and the dtype its state takes
        (float32, float64 for float64 parameters). Slots of parameters not in ``live``
        are left to the next update's check (:meth:`check_state`).

        Raises:
            ValueError: naming the slot, the shape and dtype it has and those expected.
        """
        for relative, (shape, dtype) in claims.items():
            param = relative.rpartition("/")[0]
            wants = {(tuple(s), np.result_type(d, np.float32)) for name, (s, d) in live.items()
                     if name == param or name.endswith("/" + param)}
            if wants and (tuple(shape), np.dtype(dtype)) not in wants:
                expected = " or ".join(sorted(f"{d}{list(s)}" for s, d in wants))
                raise ValueError(f"{type(self).__name__} slot {relative!r} is {np.dtype(dtype)}{list(shape)}, "
                                 f"its parameter {param!r} needs {expected}")

    def state_dict(self, partition=None) -> dict:
        """The slots (``{"state": {param: {slot: array}}}``, live references; before any
        state exists, an :class:`~popdist_lite.checkpoint.stateful.Allocate` taking the
        checkpoint's) and the step counter of optimizers that count steps."""
        from .checkpoint.partition import Partition
        from .checkpoint.stateful import Allocate

        tree: dict = {"state": {name: dict(slots) for name, slots in self.state.items()} if self.state else
                      Allocate(partition or Partition("replicated"), self.checkpoint_slot,
                               None if partition is not None else self.check_claims)}
        if hasattr(self, "steps"):
            tree["steps"] = int(self.steps)
        return tree

    def validate_state_dict(self, state_dict: dict, saved) -> None:
        steps = state_dict.get("steps")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
            raise ValueError(f"optimizer {saved.name!r}: steps must be an integer >= 0, got {steps!r}")

    def load_state_dict(self, state_dict: dict) -> None:
        """Take the state of :meth:`state_dict` (arrays filled in place, or fresh ones)."""
        loaded = state_dict.get("state", {})
        fresh = not self.state
        self.state = {name: {slot: getattr(a, "local", a) for slot, a in slots.items()}
                      for name, slots in loaded.items()}
        self._check_next = fresh and bool(self.state)
        if "steps" in state_dict and hasattr(self, "steps"):
            self.steps = int(state_dict["steps"])

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
        if self._check_next:
            self.check_state(params)
            self._check_next = False
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
    def slot_names(self) -> tuple[str, ...]:
        return ("velocity",) if self.momentum else ()

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

    slot_names = ("m", "v")

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
