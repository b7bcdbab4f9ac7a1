"""Static and dynamic loss scaling with overflow agreement across replicas.

Source: Graphcore's half- and mixed-precision tutorial, "Underflowing gradients and loss
scaling": multiply the loss by a factor before computing gradients so small
gradients do not underflow in float16, and divide the gradients by the same factor
(in float32, "Method 2") before the update. Dynamic scaling, as TensorFlow's
``DynamicLossScale`` and PyTorch's ``GradScaler``: halve the scale when gradients
overflow (and skip that step), double it after ``growth_interval`` clean steps.

Overflow agreement: each replica checks its own gradients (dense and embedding) for
inf/NaN, and one ``all_reduce`` of a single int32 (``max`` of ``replica + 1`` over
the replicas that overflowed) gives every replica the same verdict, so every replica
skips the same steps; nothing else is communicated for it. A training step::

    scaler = DynamicLossScaler()
    scale = scaler.scale                      # multiply the loss (its gradient) by this
    ...                                       # backward pass -> grads, emb_grads (scaled)
    applied = scaler.step(dense=(optimizer, params, grads),
                          embeddings=[(emb, indices, emb_grads)])

:meth:`LossScaler.step` skips the step on every replica when any replica overflowed
(no weight or optimizer state changes), otherwise passes ``loss_scale=scale`` to
:meth:`CrossReplicaOptimizer.step` and :meth:`HostEmbedding.apply_gradients`, which
divide it out in float32 after the reduction (float16 gradients stay float16 on the
wire); then it updates the scale. The pieces (:meth:`found_overflow`,
:meth:`unscale`, :meth:`update`) are public for custom loops.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from .collectives import all_reduce
from .validation import check_integer, check_number

__all__ = ["LossScaler", "StaticLossScaler", "DynamicLossScaler", "FixedLossScale", "DynamicLossScale"]


def _arrays(items) -> Iterable[np.ndarray]:
    """Every array in ``items`` (arrays, dicts of arrays, lists/tuples of those)."""
    for item in items:
        if item is None:
            continue
        if isinstance(item, dict):
            yield from _arrays(item.values())
        elif isinstance(item, (list, tuple)):
            yield from _arrays(item)
        else:
            yield np.asarray(item)


class LossScaler:
    """Base class: a current :attr:`scale`, overflow agreement, unscaling, the step helper.

    Attributes:
        scale: the current loss scale (float).
        skipped_steps: steps skipped because some replica overflowed.
        last_overflow_replica: the highest replica index that overflowed in the last
            checked step, or ``None``.
    """

    def __init__(self, scale: float, *, comm=None):
        self.scale = float(scale)
        self.skipped_steps = 0
        self.last_overflow_replica: int | None = None
        self._comm = comm

    def scale_loss(self, loss):
        """``loss * scale``."""
        return loss * self.scale

    def found_overflow(self, *grads) -> bool:
        """Whether any replica's gradients contain inf or NaN. Collective: exactly one
        :func:`popdist_lite.all_reduce` of one int32, whatever was passed.

        Args:
            *grads: this replica's gradients: arrays, dicts or lists of arrays (dense
                and embedding gradients together; replicas may pass different shapes).

        Returns:
            the same bool on every replica.
        """
        local = not all(bool(np.isfinite(a).all()) for a in _arrays(grads) if a.dtype.kind in "fc")
        from . import topology
        comm = self._comm if self._comm is not None else topology.replica_comm()
        flag = np.array([comm.rank + 1 if local else 0], np.int32)
        worst = int(all_reduce(flag, op="max", comm=comm)[0])
        self.last_overflow_replica = worst - 1 if worst else None
        return worst > 0

    def unscale(self, grads):
        """``grads / scale`` in float32 (float64 stays float64): an array, or a dict of arrays."""
        if isinstance(grads, dict):
            return {k: self.unscale(v) for k, v in grads.items()}
        g = np.asarray(grads)
        g = g.astype(np.result_type(g.dtype, np.float32), copy=False)
        return g / np.asarray(self.scale, g.dtype)

    def update(self, overflow: bool) -> None:
        """Record a step's verdict (``found_overflow``'s result) and adjust the scale."""
        if overflow:
            self.skipped_steps += 1

    # -- checkpoints (the Stateful protocol of popdist_lite.checkpoint) -----------------
    def state_dict(self) -> dict:
        """``{"scale", "skipped_steps", "last_overflow_replica"}`` (JSON); a dynamic
        scaler adds ``"clean_steps"``."""
        return {"scale": self.scale, "skipped_steps": self.skipped_steps,
                "last_overflow_replica": self.last_overflow_replica}

    def validate_state_dict(self, state_dict: dict, saved) -> None:
        """Accept exactly the fields of :meth:`state_dict`, each of its type and range: a
        finite positive scale (within a dynamic scaler's bounds), counters >= 0.

        Raises:
            ValueError: naming the scaler, the field, what was expected and what came.
        """
        what = f"loss scaler {saved.name!r}"
        fields = self.state_dict()
        if not isinstance(state_dict, dict) or set(state_dict) != set(fields):
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"{what}: expected the fields {sorted(fields)}, got {got}")
        try:
            self._check_scale(check_number(type(self).__name__, "scale", state_dict["scale"], low_open=True))
            for name in fields:
                if name in ("skipped_steps", "clean_steps"):
                    check_integer(type(self).__name__, name, state_dict[name], low=0)
            replica = state_dict["last_overflow_replica"]
            if replica is not None:
                check_integer(type(self).__name__, "last_overflow_replica", replica, low=0)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{what}: {exc}") from None

    def _check_scale(self, scale: float) -> None:
        """Raise ``ValueError`` for a scale this scaler cannot take (a positive finite one
        was checked already)."""

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the fields of :meth:`state_dict` (checked by :meth:`validate_state_dict`)."""
        self.scale = float(state_dict["scale"])
        self.skipped_steps = int(state_dict["skipped_steps"])
        replica = state_dict["last_overflow_replica"]
        self.last_overflow_replica = None if replica is None else int(replica)

    def step(self, dense=None, embeddings=()) -> bool:
        """One loss-scaled update of dense parameters and host embeddings. Collective.

        Args:
            dense: ``None`` or ``(optimizer, params, grads)``: a
                :class:`popdist_lite.CrossReplicaOptimizer`, its parameters and this
                replica's scaled gradients.
            embeddings: ``(embedding, indices, grads)`` triples: host embeddings with
                this replica's indices and scaled gradients.

        Returns:
            True when the update was applied; False when some replica's gradients
            overflowed and every replica skipped it (weights and optimizer state
            unchanged, the scale lowered by a dynamic scaler).
        """
        embeddings = list(embeddings)
        overflow = self.found_overflow(dense[2] if dense is not None else None, [g for _, _, g in embeddings])
        if not overflow:
            scale = self.scale
            if dense is not None:
                optimizer, params, grads = dense
                optimizer.step(params, grads, loss_scale=scale)
            for embedding, indices, grads in embeddings:
                embedding.apply_gradients(indices, grads, loss_scale=scale)
        self.update(overflow)
        return not overflow


class StaticLossScaler(LossScaler):
    """A constant loss scale (the half- and mixed-precision tutorial's ``LOSS_SCALING_FACTOR``,
    default ``2**8``).
    Overflowing steps are still skipped on every replica; the scale does not change.

    Raises:
        ValueError: a scale that is not a finite positive number.
    """

    def __init__(self, scale: float = 2.0 ** 8, *, comm=None):
        super().__init__(check_number("StaticLossScaler", "scale", scale, low_open=True), comm=comm)

    def __repr__(self) -> str:
        return f"StaticLossScaler(scale={self.scale:g})"


class DynamicLossScaler(LossScaler):
    """A loss scale that adapts: multiplied by ``backoff_factor`` (0.5) on a step where
    any replica overflowed (never below ``min_scale``), multiplied by ``growth_factor``
    (2) after ``growth_interval`` consecutive clean steps (never above ``max_scale``).
    Defaults follow TensorFlow's ``DynamicLossScale`` (initial ``2**15``, 2000 steps).

    Raises:
        ValueError: non-finite or non-positive arguments, ``growth_factor <= 1``,
            ``backoff_factor`` outside ``(0, 1)``, ``growth_interval < 1``, or
            ``min_scale > max_scale``.
    """

    def __init__(self, initial_scale: float = 2.0 ** 15, growth_interval: int = 2000, *,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5, min_scale: float = 1.0,
                 max_scale: float = 2.0 ** 24, comm=None):
        owner = "DynamicLossScaler"
        super().__init__(check_number(owner, "initial_scale", initial_scale, low_open=True), comm=comm)
        self.growth_interval = check_integer(owner, "growth_interval", growth_interval)
        self.growth_factor = check_number(owner, "growth_factor", growth_factor, low=1.0, low_open=True)
        self.backoff_factor = check_number(owner, "backoff_factor", backoff_factor, 0.0, 1.0, low_open=True,
                                           high_open=True)
        self.min_scale = check_number(owner, "min_scale", min_scale, low_open=True)
        self.max_scale = check_number(owner, "max_scale", max_scale, low_open=True)
        if self.min_scale > self.max_scale:
            raise ValueError(f"{owner}: arguments min_scale/max_scale: expected min_scale <= max_scale, "
                             f"got {min_scale!r} > {max_scale!r}")
        self.scale = min(max(self.scale, self.min_scale), self.max_scale)
        self.clean_steps = 0

    def update(self, overflow: bool) -> None:
        super().update(overflow)
        if overflow:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale = min(self.scale * self.growth_factor, self.max_scale)
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {**super().state_dict(), "clean_steps": self.clean_steps}

    def _check_scale(self, scale: float) -> None:
        if not self.min_scale <= scale <= self.max_scale:
            raise ValueError(f"argument scale: expected a value in [min_scale, max_scale] = [{self.min_scale:g}, "
                             f"{self.max_scale:g}], got {scale!r}")

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self.clean_steps = int(state_dict["clean_steps"])

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(scale={self.scale:g}, growth_interval={self.growth_interval}, "
                f"clean_steps={self.clean_steps})")


class FixedLossScale(StaticLossScaler):
    """TensorFlow's name: ``FixedLossScale(loss_scale_value)`` = :class:`StaticLossScaler`."""

    def __init__(self, loss_scale_value: float, *, comm=None):
        super().__init__(loss_scale_value, comm=comm)


class DynamicLossScale(DynamicLossScaler):
    """TensorFlow's name and arguments: ``DynamicLossScale(initial_loss_scale=2**15,
    increment_period=2000, multiplier=2.0)`` = :class:`DynamicLossScaler` with
    ``backoff_factor = 1 / multiplier``."""

    def __init__(self, initial_loss_scale: float = 2.0 ** 15, increment_period: int = 2000,
                 multiplier: float = 2.0, *, comm=None):
        super().__init__(initial_loss_scale, increment_period, growth_factor=multiplier,
                         backoff_factor=1.0 / check_number("DynamicLossScale", "multiplier", multiplier, low=1.0,
                                                           low_open=True),
                         comm=comm)
