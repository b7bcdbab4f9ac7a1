"""Stochastic rounding to float16 with numpy, and TensorFlow-IPU's three modes.

Source: Graphcore's tutorial "TensorFlow 1 on the IPU: training a model using half- and
mixed-precision", "Method 1: Using stochastic rounding":
instead of always rounding to the nearest representable number, round up or down
with a probability such that the expected value after rounding equals the value
before rounding. TensorFlow-IPU's ``StochasticRoundingBehaviour`` enum has the modes
``OFF``, ``ON`` and ``REPLICA_IDENTICAL_ONLY``; here they mean:

- ``OFF``: round to nearest (ties to even) everywhere, as ``astype(np.float16)``.
- ``ON``: stochastic rounding everywhere. *Replicated* tensors (dense weights that
  every replica updates redundantly from the same reduced gradients) draw their
  random numbers from a stream seeded identically on every replica, so they stay
  bit-identical; *owned* tensors (embedding rows, which live on one replica, and the
  shards of replicated tensor sharding) draw from a per-replica stream.
- ``REPLICA_IDENTICAL_ONLY``: stochastic rounding only for replicated tensors (with
  the identical stream); owned tensors round to nearest.

The replicated stream stays identical only if every replica rounds the same shapes in
the same order; the library's own callers (:class:`popdist_lite.CrossReplicaOptimizer`)
do so by construction.
"""

from __future__ import annotations

import enum

import numpy as np

__all__ = ["StochasticRoundingBehaviour", "StochasticRounding", "stochastic_round", "round_to_nearest",
           "as_stochastic_rounding"]

F16 = np.dtype(np.float16)
_F16_MAX = float(np.finfo(np.float16).max)
_INF16 = np.float16(np.inf)


class StochasticRoundingBehaviour(enum.Enum):
    """TensorFlow-IPU's modes (``ipu.config.StochasticRoundingBehaviour``); see the module doc."""

    OFF = "OFF"
    ON = "ON"
    REPLICA_IDENTICAL_ONLY = "REPLICA_IDENTICAL_ONLY"

    @classmethod
    def parse(cls, value) -> "StochasticRoundingBehaviour":
        """Accept a member, its name (any case), ``True`` (ON), or ``False``/``None`` (OFF).

        Raises:
            ValueError: anything else.
        """
        if isinstance(value, cls):
            return value
        if value is None or value is False:
            return cls.OFF
        if value is True:
            return cls.ON
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        raise ValueError(f"stochastic rounding: expected one of {list(cls.__members__)} (or True/False), got {value!r}")


def round_to_nearest(x) -> np.ndarray:
    """``x`` rounded to float16, round-to-nearest-even (numpy's ``astype``; beyond 65520 -> inf)."""
    with np.errstate(over="ignore"):
        return np.asarray(x).astype(F16)


def stochastic_round(x, rng: np.random.Generator) -> np.ndarray:
    """Round ``x`` to float16 stochastically and without bias.

    Each element ``v`` between the adjacent float16 values ``lo <= v < hi`` becomes
    ``hi`` with probability ``(v - lo) / (hi - lo)`` and ``lo`` otherwise, so
    ``E[result] = v``. Computed in float64, which holds ``v - lo`` exactly for float32
    or float16 input; the gap ``hi - lo`` is the float16 ulp at ``v``, subnormals
    included (``2**-24`` below ``2**-14``). Values already representable are unchanged.
    NaN, infinities and magnitudes above float16's largest finite value (65504) round
    to nearest (so beyond 65520 they become inf, as ``astype`` does).

    Args:
        x: float array (any shape; float16/32/64).
        rng: the random generator to draw one uniform number per element from.

    Returns:
        float16 array of ``x``'s shape.
    """
    v = np.asarray(x, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        near = v.astype(F16)
        near64 = near.astype(np.float64)
        above = near64 > v
        lo = np.where(above, np.nextafter(near, -_INF16), near)
        hi = np.where(above, near, np.nextafter(near, _INF16))
        lo64 = lo.astype(np.float64)
        p = (v - lo64) / (hi.astype(np.float64) - lo64)
    out = np.where(rng.random(v.shape) < p, hi, lo)
    special = ~np.isfinite(v) | (np.abs(v) > _F16_MAX)
    if special.any():
        out[special] = near[special]
    return out


class StochasticRounding:
    """Rounding policy for weights stored in float16: a mode and two random streams.

    Args:
        mode: :class:`StochasticRoundingBehaviour` (or its name, or a bool).
        seed: seeds both streams; use the same seed on every replica.
        replica: this replica's index for the per-replica stream (default: from
            :func:`popdist_lite.replica_id` at first use).

    Raises:
        ValueError: an unknown mode.
    """

    def __init__(self, mode=StochasticRoundingBehaviour.ON, seed: int = 0, replica: int | None = None):
        self.mode = StochasticRoundingBehaviour.parse(mode)
        self.seed = int(seed)
        self._identical = np.random.default_rng([self.seed, 0x5EED, 0])
        self._replica = replica
        self._own: np.random.Generator | None = None

    def _own_stream(self) -> np.random.Generator:
        if self._own is None:
            if self._replica is None:
                from . import topology
                topology.init()
                self._replica = topology.replica_id()
            self._own = np.random.default_rng([self.seed, 0x5EED, 1, int(self._replica)])
        return self._own

    def stochastic(self, replicated: bool) -> bool:
        """Whether a ``replicated`` (or owned) tensor is rounded stochastically in this mode."""
        if self.mode is StochasticRoundingBehaviour.OFF:
            return False
        return replicated or self.mode is StochasticRoundingBehaviour.ON

    def round(self, x, *, replicated: bool) -> np.ndarray:
        """``x`` rounded to float16 under this policy.

        Args:
            x: float array.
            replicated: True for a tensor every replica computes identically and must
                keep identical (uses the replica-identical stream); False for a tensor
                only this replica owns.

        Returns:
            float16 array of ``x``'s shape.
        """
        if not self.stochastic(replicated):
            return round_to_nearest(x)
        return stochastic_round(x, self._identical if replicated else self._own_stream())

    def cast(self, x, dtype, *, replicated: bool) -> np.ndarray:
        """``x`` as ``dtype``: float16 goes through :meth:`round`, wider types are a plain cast."""
        if np.dtype(dtype) == F16:
            return self.round(x, replicated=replicated)
        return np.asarray(x).astype(dtype, copy=False)

    def _streams(self) -> dict[str, np.random.Generator]:
        return {"per_replica": self._own_stream(), "replica_identical": self._identical}

    def generator_states(self) -> dict[str, dict]:
        """The bit-generator states of both streams (``Generator.bit_generator.state``,
        JSON-able): ``{"per_replica": ..., "replica_identical": ...}``."""
        return {name: rng.bit_generator.state for name, rng in self._streams().items()}

    def check_generator_states(self, states: dict[str, dict]) -> None:
        """Raise ``ValueError`` unless ``states`` could be given to :meth:`set_generator_states`
        (known stream names, states each stream's bit generator takes: tried on a new
        one of its class)."""
        streams = self._streams()
        for name, state in states.items():
            if name not in streams:
                raise ValueError(f"generator {name!r}: expected one of {sorted(streams)}")
            bit_generator = streams[name].bit_generator
            kind = type(bit_generator).__name__
            if not isinstance(state, dict) or state.get("bit_generator") != kind:
                raise ValueError(f"generator {name!r}: expected a {kind} state dict, got {state!r:.80}")
            try:  # on a new bit generator of the class: the setter checks every field
                type(bit_generator)(0).state = state
            except Exception as exc:  # noqa: BLE001 - whatever the setter refuses
                raise ValueError(f"generator {name!r}: not a valid {kind} state ({type(exc).__name__}: {exc}): "
                                 f"{state!r:.80}") from None

    def set_generator_states(self, states: dict[str, dict]) -> None:
        """Restore streams from :meth:`generator_states` (any subset of the names).

        Raises:
            ValueError: an unknown stream name or a state of another bit generator
                (checked before any stream changes).
        """
        self.check_generator_states(states)
        streams = self._streams()
        for name, state in states.items():
            streams[name].bit_generator.state = state

    def __repr__(self) -> str:
        return f"StochasticRounding({self.mode.name}, seed={self.seed})"


def as_stochastic_rounding(value, seed: int = 0) -> StochasticRounding:
    """A :class:`StochasticRounding` from an instance (returned as is), a mode, a mode
    name, a bool or ``None`` (OFF).

    Raises:
        ValueError: an unknown mode.
    """
    if isinstance(value, StochasticRounding):
        return value
    return StochasticRounding(StochasticRoundingBehaviour.parse(value), seed=seed)
