"""Optimizer specs for host embeddings: SGD (TensorFlow-IPU's ``HostEmbeddingOptimizerSpec``),
SGD with gradient accumulation (TensorFlow-IPU's ``HostEmbeddingSGDGAOptimizerSpec``),
momentum, Adagrad (element-wise and row-wise) and Adam.

The contract between a table and its spec (strategy-agnostic: any partition that
produces ``(rows, sums)`` pairs can use every spec)::

    state = spec.init_state(shard_shape)                      # once, on the owning replica
    layouts = spec.state_layouts()                            # each slot's layout (TableState)
    result = spec.apply(shard, rows, sums, state, ctx)        # every apply_gradients call
    if result is not None:
        written_rows, values = result                         # the table stores (and rounds) them

- ``shard``: this replica's partition of the table (any float dtype, read only here).
- ``rows``: ``int64[u]``, unique local row indices of ``shard`` touched in this step by
  any replica (duplicates were coalesced by the partition's ``gradient_sums``).
- ``sums``: ``(u, shard.shape[1])`` float32/float64, the summed gradients of those rows
  (already unscaled by the loss scale).
- ``state``: the dict from ``init_state``; updated in place. State lives only in the
  partition that owns the rows (``shard``-shaped or per-row arrays), never replicated.
- ``ctx``: :class:`UpdateContext`, the full row width and a cross-replica row sum
  (needed by row-wise Adagrad when a row's columns are spread over replicas, ENCODING).

Every spec updates only the rows touched in a step ("lazy"/sparse semantics, as
TensorFlow's sparse ``apply`` and TorchRec's fused optimizers): an untouched row's
weights and state do not change. Each touched row is updated once per step with the
sum of all its gradients (TorchRec's ``EXACT_*`` optimizers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..validation import check_integer, check_number

__all__ = ["EmbeddingOptimizerSpec", "HostEmbeddingOptimizerSpec", "HostEmbeddingSGDGAOptimizerSpec",
           "HostEmbeddingMomentumOptimizerSpec", "HostEmbeddingAdagradOptimizerSpec",
           "HostEmbeddingAdamOptimizerSpec", "UpdateContext"]


@dataclass(frozen=True)
class UpdateContext:
    """What a spec may need beyond its rows: ``width``, the table's full encoding size
    ``e``, and ``row_sum(x)``, ``x: (u, c) -> (u,)`` summed over all ``e`` columns of each
    row (across replicas for ENCODING; a local sum when rows are whole, TOKEN)."""

    width: int
    row_sum: Callable[[np.ndarray], np.ndarray] = field(default=lambda x: x.sum(axis=1))


def _compute_dtype(shard: np.ndarray) -> np.dtype:
    """float32 for float16/float32 tables, float64 for float64 tables."""
    return np.result_type(shard.dtype, np.float32)


class EmbeddingOptimizerSpec:
    """Base of the host-embedding optimizer specs (see the module doc for the contract).

    Subclasses are frozen dataclasses with a ``learning_rate``; a learning rate of 0
    means the table is not trainable (TensorFlow-IPU's convention).
    """

    learning_rate: float

    @property
    def trainable(self) -> bool:
        return self.learning_rate > 0

    def init_state(self, shard_shape: tuple[int, int]) -> dict[str, np.ndarray]:
        """The optimizer state for one partition (empty for plain SGD)."""
        return {}

    def state_layouts(self) -> dict[str, str]:
        """The layout of each slot of :meth:`init_state`'s state (see
        :class:`popdist_lite.TableState`): ``"table"`` (shard-shaped), ``"row"`` (one
        value per local row) or ``"replicated"`` (the same on every replica)."""
        return {}

    def apply(self, shard: np.ndarray, rows: np.ndarray, sums: np.ndarray, state: dict[str, np.ndarray],
              ctx: UpdateContext | None = None) -> tuple[np.ndarray, np.ndarray] | None:
        """New values for the rows to write: ``(rows, values)`` with ``values`` in float32
        (float64 for float64 tables), or ``None`` when nothing is written this call."""
        raise NotImplementedError

    def signature(self) -> tuple:
        """Compared across replicas when a table is created."""
        return (type(self).__name__, *(getattr(self, f) for f in self.__dataclass_fields__))


@dataclass(frozen=True)
class HostEmbeddingOptimizerSpec(EmbeddingOptimizerSpec):
    """SGD with a constant learning rate, applied by the replica that owns each row.

    ``row_i <- row_i - learning_rate * (sum of every replica's gradients for row i)``;
    duplicate indices accumulate. A learning rate of 0 makes the table not trainable
    (TensorFlow-IPU's convention). No state. Source: the TF-IPU host-embedding guide, section 15
    (``tensorflow.python.ipu.embedding_ops.HostEmbeddingOptimizerSpec``).

    Raises:
        ValueError: a negative, infinite or NaN learning rate.
    """

    learning_rate: float

    def __post_init__(self):
        check_number("HostEmbeddingOptimizerSpec", "learning_rate", self.learning_rate)

    def apply(self, shard, rows, sums, state, ctx=None):
        return rows, shard[rows].astype(_compute_dtype(shard)) - self.learning_rate * sums


@dataclass(frozen=True)
class HostEmbeddingSGDGAOptimizerSpec(EmbeddingOptimizerSpec):
    """SGD with gradient accumulation (TensorFlow-IPU's ``HostEmbeddingSGDGAOptimizerSpec``).

    Every ``apply_gradients`` call adds the step's coalesced gradient sums into a
    float32 accumulator held by the owning partition; every ``accumulation_factor``-th
    call applies ``row <- row - learning_rate * accumulated`` to every row touched since
    the last application and clears the accumulator. The accumulated gradients are
    summed, not averaged (scale ``learning_rate`` to average). Lookups in between see
    the weights of the last application.

    State: ``accumulator`` (shard-shaped float32), ``touched`` (bool per local row),
    ``calls`` (int64[1]).

    Raises:
        ValueError: a bad learning rate, or an ``accumulation_factor`` that is not an
            integer >= 1.
    """

    learning_rate: float
    accumulation_factor: int

    def __post_init__(self):
        check_number("HostEmbeddingSGDGAOptimizerSpec", "learning_rate", self.learning_rate)
        check_integer("HostEmbeddingSGDGAOptimizerSpec", "accumulation_factor", self.accumulation_factor)

    def init_state(self, shard_shape):
        return {"accumulator": np.zeros(shard_shape, np.float32), "touched": np.zeros(shard_shape[0], bool),
                "calls": np.zeros(1, np.int64)}

    def state_layouts(self):
        return {"accumulator": "table", "touched": "row", "calls": "replicated"}

    def apply(self, shard, rows, sums, state, ctx=None):
        state["accumulator"][rows] += sums
        state["touched"][rows] = True
        state["calls"] += 1
        if state["calls"][0] % self.accumulation_factor:
            return None
        due = np.flatnonzero(state["touched"])
        values = shard[due].astype(_compute_dtype(shard)) - self.learning_rate * state["accumulator"][due]
        state["accumulator"][due] = 0
        state["touched"][:] = False
        return due, values


@dataclass(frozen=True)
class HostEmbeddingMomentumOptimizerSpec(EmbeddingOptimizerSpec):
    """Momentum SGD per touched row, as TensorFlow's ``MomentumOptimizer`` sparse update:
    ``v <- momentum * v + g``; ``row <- row - learning_rate * v``, where ``g`` is the
    row's summed gradient. Rows not touched in a step keep their velocity.

    State: ``velocity`` (shard-shaped float32).

    Raises:
        ValueError: a bad learning rate, or a momentum outside ``[0, 1)``.
    """

    learning_rate: float
    momentum: float = 0.9

    def __post_init__(self):
        check_number("HostEmbeddingMomentumOptimizerSpec", "learning_rate", self.learning_rate)
        check_number("HostEmbeddingMomentumOptimizerSpec", "momentum", self.momentum, 0.0, 1.0, high_open=True)

    def init_state(self, shard_shape):
        return {"velocity": np.zeros(shard_shape, np.float32)}

    def state_layouts(self):
        return {"velocity": "table"}

    def apply(self, shard, rows, sums, state, ctx=None):
        v = self.momentum * state["velocity"][rows] + sums
        state["velocity"][rows] = v
        return rows, shard[rows].astype(_compute_dtype(shard)) - self.learning_rate * v


@dataclass(frozen=True)
class HostEmbeddingAdagradOptimizerSpec(EmbeddingOptimizerSpec):
    """Adagrad per touched row.

    Element-wise (``rowwise=False``, TensorFlow/Keras ``Adagrad``):
    ``a <- a + g**2``; ``row <- row - learning_rate * g / (sqrt(a) + epsilon)``.

    Row-wise (``rowwise=True``, TorchRec/FBGEMM ``EXACT_ROWWISE_ADAGRAD``): one
    accumulator per row, ``a <- a + mean(g**2)`` over the row's ``e`` columns (summed
    across replicas for ENCODING, where a row's columns are spread out), then the same
    update with the row's scalar ``a``. ``e`` times less state.

    State: ``accumulator``, shard-shaped (element-wise) or one per local row (row-wise),
    float32, starting at ``initial_accumulator_value``.

    Raises:
        ValueError: a bad learning rate, a negative initial accumulator or a
            non-positive epsilon.
    """

    learning_rate: float
    initial_accumulator_value: float = 0.1
    epsilon: float = 1e-7
    rowwise: bool = False

    def __post_init__(self):
        check_number("HostEmbeddingAdagradOptimizerSpec", "learning_rate", self.learning_rate)
        check_number("HostEmbeddingAdagradOptimizerSpec", "initial_accumulator_value", self.initial_accumulator_value)
        check_number("HostEmbeddingAdagradOptimizerSpec", "epsilon", self.epsilon, low_open=True)

    def init_state(self, shard_shape):
        shape = shard_shape[:1] if self.rowwise else shard_shape
        return {"accumulator": np.full(shape, self.initial_accumulator_value, np.float32)}

    def state_layouts(self):
        return {"accumulator": "row" if self.rowwise else "table"}

    def apply(self, shard, rows, sums, state, ctx=None):
        acc = state["accumulator"]
        if self.rowwise:
            ctx = ctx or UpdateContext(width=shard.shape[1])
            a = acc[rows] + ctx.row_sum(sums * sums) / ctx.width
            acc[rows] = a
            denom = np.sqrt(a)[:, None] + self.epsilon
        else:
            a = acc[rows] + sums * sums
            acc[rows] = a
            denom = np.sqrt(a) + self.epsilon
        return rows, shard[rows].astype(_compute_dtype(shard)) - self.learning_rate * sums / denom


@dataclass(frozen=True)
class HostEmbeddingAdamOptimizerSpec(EmbeddingOptimizerSpec):
    """Adam (Kingma & Ba, 2015) on touched rows only ("lazy" Adam).

    For each touched row with summed gradient ``g`` and its own step count ``t`` (the
    number of steps that touched it, including this one)::

        m <- beta1 * m + (1 - beta1) * g
        v <- beta2 * v + (1 - beta2) * g**2
        row <- row - learning_rate * (m / (1 - beta1**t)) / (sqrt(v / (1 - beta2**t)) + epsilon)

    Bias correction uses the row's own step count, so a row first seen late gets the
    same first update as a row seen from step 1 (FBGEMM's fused ``ADAM`` and TF's
    ``LazyAdam`` use the global step instead, which shrinks the bias correction of rows
    that appear late). Untouched rows keep ``m``, ``v`` and ``t``.

    State: ``m``, ``v`` (shard-shaped float32), ``steps`` (int64 per local row).

    Raises:
        ValueError: a bad learning rate, betas outside ``[0, 1)`` or a non-positive epsilon.
    """

    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8

    def __post_init__(self):
        owner = "HostEmbeddingAdamOptimizerSpec"
        check_number(owner, "learning_rate", self.learning_rate)
        check_number(owner, "beta1", self.beta1, 0.0, 1.0, high_open=True)
        check_number(owner, "beta2", self.beta2, 0.0, 1.0, high_open=True)
        check_number(owner, "epsilon", self.epsilon, low_open=True)

    def init_state(self, shard_shape):
        return {"m": np.zeros(shard_shape, np.float32), "v": np.zeros(shard_shape, np.float32),
                "steps": np.zeros(shard_shape[0], np.int64)}

    def state_layouts(self):
        return {"m": "table", "v": "table", "steps": "row"}

    def apply(self, shard, rows, sums, state, ctx=None):
        t = state["steps"][rows] + 1
        state["steps"][rows] = t
        m = self.beta1 * state["m"][rows] + (1 - self.beta1) * sums
        v = self.beta2 * state["v"][rows] + (1 - self.beta2) * sums * sums
        state["m"][rows], state["v"][rows] = m, v
        m_hat = m / (1 - self.beta1 ** t)[:, None]
        v_hat = v / (1 - self.beta2 ** t)[:, None]
        return rows, shard[rows].astype(_compute_dtype(shard)) - self.learning_rate * m_hat / (np.sqrt(v_hat) + self.epsilon)
