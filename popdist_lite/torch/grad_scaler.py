"""Loss scaling for the binding: ``torch.amp.GradScaler``'s interface over popdist-lite's
loss scalers, agreed across replicas, covering host embeddings updated in backward.

Source: the FP16 mixed-precision tutorial's loss scaling (scale the loss, divide the
gradients by the same factor in float32 before the update, skip a step whose gradients
overflowed) and PyTorch's ``GradScaler`` (``scale``, ``unscale_``, ``step``, ``update``).

A step::

    scaler = GradScaler(init_scale=2.0 ** 12)
    emb = HostEmbedding(..., dtype=torch.float16, master_weights=torch.float32, grad_scaler=scaler)
    scaler.scale(loss).backward()   # the embedding's backward checks its gradient and updates
    scaler.step(optimizer)          # the dense step, skipped if anything overflowed
    scaler.update()                 # the scale learns of the step's verdict

Verdicts: a host embedding's backward checks its own gradient for inf/NaN with one
all-reduce of one int32 (:meth:`popdist_lite.LossScaler.found_overflow`), so every replica
skips that update together; :meth:`step` (or :meth:`unscale_`) checks the dense gradients
the same way, unless an embedding already overflowed in this step (then every replica
knows it and skips without asking). :meth:`update` records one verdict per step.

Limit: an embedding updates inside backward, before the dense gradients are complete, so
when only a dense gradient overflows the embedding update of that step has already been
applied (fbgemm's fused optimizers have the same property); the dense step is skipped.
"""

from __future__ import annotations

import numpy as np
import torch

import popdist_lite as pl

__all__ = ["GradScaler"]


class GradScaler:
    """Dynamic (default) or static loss scaling across replicas.

    Args:
        init_scale, growth_factor, backoff_factor, growth_interval: as
            ``torch.amp.GradScaler``: a :class:`popdist_lite.DynamicLossScaler` with
            these settings.
        loss_scaler: use this :class:`popdist_lite.LossScaler` instead (e.g.
            ``popdist_lite.StaticLossScaler(2**8)``); the other arguments are ignored.

    Attributes:
        loss_scaler: the :class:`popdist_lite.LossScaler` (its ``scale``,
            ``skipped_steps``, ``last_overflow_replica``).

    Raises:
        ValueError: bad scaler settings (see :class:`popdist_lite.DynamicLossScaler`).
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, *, loss_scaler: pl.LossScaler | None = None):
        self.loss_scaler = loss_scaler if loss_scaler is not None else pl.DynamicLossScaler(
            init_scale, growth_interval, growth_factor=growth_factor, backoff_factor=backoff_factor)
        self._found_inf = False
        self._unscaled: set[int] = set()

    def get_scale(self) -> float:
        """The current scale."""
        return self.loss_scaler.scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale``."""
        return loss * self.loss_scaler.scale

    def _found_overflow(self, *arrays: np.ndarray) -> bool:
        """Whether any replica's ``arrays`` hold inf/NaN, remembered for this step.
        Collective (one all-reduce of one int32)."""
        overflow = self.loss_scaler.found_overflow(*arrays)
        self._found_inf = self._found_inf or overflow
        return overflow

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place (for clipping before
        :meth:`step`), after agreeing whether any replica's gradients overflowed.
        Collective, unless an embedding already overflowed in this step."""
        if id(optimizer) in self._unscaled:
            raise RuntimeError("GradScaler.unscale_: already called for this optimizer since the last update()")
        self._unscaled.add(id(optimizer))
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not self._found_inf:
            self._found_overflow(*(_as_numpy(g) for g in grads))
        if not self._found_inf:
            inverse = 1.0 / self.loss_scaler.scale
            for g in grads:
                g.mul_(inverse)

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs) -> bool:
        """Unscale (unless :meth:`unscale_` did) and run ``optimizer.step(*args, **kwargs)``,
        or skip it on every replica when any gradient of this step overflowed.

        Returns:
            whether the step was applied (the same on every replica).
        """
        if id(optimizer) not in self._unscaled:
            self.unscale_(optimizer)
        if self._found_inf:
            return False
        optimizer.step(*args, **kwargs)
        return True

    def update(self) -> None:
        """End the step: the scaler records its verdict (lowering the scale after an
        overflow, raising it after ``growth_interval`` clean steps). Local."""
        self.loss_scaler.update(self._found_inf)
        self._found_inf = False
        self._unscaled.clear()

    # -- checkpoints (the Stateful protocol of popdist_lite.checkpoint) -----------------
    def checkpoint_info(self) -> dict:
        """The loss scaler's entry: a ``GradScaler`` is saved as its ``loss_scaler``
        (``"type": "DynamicLossScaler"``), so the numpy API's scalers load into it and
        back."""
        return {"type": type(self.loss_scaler).__name__}

    def state_dict(self) -> dict:
        """The loss scaler's state (:meth:`popdist_lite.LossScaler.state_dict`: scale,
        skipped steps, clean steps): JSON."""
        return self.loss_scaler.state_dict()

    def validate_state_dict(self, state_dict: dict, saved) -> None:
        """As :meth:`popdist_lite.LossScaler.validate_state_dict` (a finite positive
        scale, counters >= 0, nothing else).

        Raises:
            ValueError: naming the field, expected and got.
        """
        self.loss_scaler.validate_state_dict(state_dict, saved)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the loss scaler's state; the step in progress starts afresh."""
        self.loss_scaler.load_state_dict(state_dict)
        self._found_inf = False
        self._unscaled.clear()

    def __repr__(self) -> str:
        return f"GradScaler({self.loss_scaler!r})"


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype not in (torch.float16, torch.float32, torch.float64):
        t = t.float()
    return t.numpy()
