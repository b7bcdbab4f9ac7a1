"""A host embedding table's specification: the checked arguments of
:func:`~popdist_lite.create_host_embedding`, what replicas compare when a table is
created, and the table's identity in the exchanges' signatures."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from ..stochastic_rounding import StochasticRounding, as_stochastic_rounding
from .id_limits.settings import IdLimits
from .optimizer_specs import EmbeddingOptimizerSpec

PARTITION_STRATEGIES = ("TOKEN", "ENCODING")
#: Exchanges per strategy; the first is the default (see docs/performance.md for why).
EXCHANGES = {"TOKEN": ("sparse", "dense"), "ENCODING": ("dense",)}
TABLE_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
MASTER_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


@dataclass(frozen=True)
class TableSpec:
    """What a table is, checked (see :func:`~popdist_lite.create_host_embedding` for
    the meaning of each field).

    Attributes:
        name, shape (``(t, e)``), dtype (the lookup dtype), partition_strategy,
        exchange, optimizer_spec, seed, master_weights (``None`` or the master dtype
        asked for), stochastic_rounding (a :class:`StochasticRounding`), id_limits (an
        :class:`IdLimits`, inactive when no limit is set).
    """

    name: str
    shape: tuple[int, int]
    dtype: np.dtype
    partition_strategy: str
    exchange: str
    optimizer_spec: EmbeddingOptimizerSpec | None
    seed: int
    master_weights: np.dtype | None
    stochastic_rounding: StochasticRounding
    id_limits: IdLimits

    @classmethod
    def from_arguments(cls, name: str, shape, dtype=np.float32, partition_strategy: str = "TOKEN",
                       optimizer_spec: EmbeddingOptimizerSpec | None = None, seed: int = 0, *,
                       master_weights=None, stochastic_rounding=None, exchange: str | None = None,
                       max_ids_per_partition: int | None = None, max_unique_ids_per_partition: int | None = None,
                       allow_id_dropping: bool = False, enable_minibatching: bool = False,
                       track_id_stats: bool = False) -> "TableSpec":
        """Check :func:`~popdist_lite.create_host_embedding`'s arguments (locally).

        Raises:
            ValueError: an unknown strategy or exchange, ``"sparse"`` with ENCODING, a bad
                shape or limit, ID limits on an ENCODING table.
            TypeError: an unsupported dtype, master dtype or optimizer spec.
        """
        if partition_strategy not in PARTITION_STRATEGIES:
            raise ValueError(f"argument partition_strategy: expected 'TOKEN' or 'ENCODING', got {partition_strategy!r}")
        allowed = EXCHANGES[partition_strategy]
        if exchange is None:
            exchange = allowed[0]
        elif exchange not in allowed:
            raise ValueError(f"argument exchange: expected one of {', '.join(map(repr, allowed))} for "
                             f"{partition_strategy} tables, got {exchange!r}")
        shape = tuple(int(s) for s in shape)
        if len(shape) != 2 or min(shape) < 1:
            raise ValueError(f"argument shape: expected [t, e] with t, e >= 1, got {list(shape)}")
        dtype = np.dtype(dtype)
        if dtype not in TABLE_DTYPES:
            raise TypeError(f"argument dtype: expected float16, float32 or float64, got {dtype}")
        if optimizer_spec is not None and not isinstance(optimizer_spec, EmbeddingOptimizerSpec):
            raise TypeError(f"argument optimizer_spec: expected a HostEmbedding*OptimizerSpec or None, "
                            f"got {type(optimizer_spec).__name__}")
        if master_weights is not None:
            master_weights = np.dtype(master_weights)
            if master_weights not in MASTER_DTYPES or master_weights.itemsize < dtype.itemsize:
                raise TypeError(f"argument master_weights: expected None, float32 or float64 (at least as wide "
                                f"as dtype {dtype}), got {master_weights}")
        id_limits = IdLimits(max_ids_per_partition, max_unique_ids_per_partition, bool(allow_id_dropping),
                             bool(enable_minibatching), bool(track_id_stats))
        if id_limits.active and partition_strategy != "TOKEN":
            raise ValueError("ID limits and track_id_stats apply to TOKEN tables only (an ENCODING table "
                             "sends every ID to every replica)")
        rounding = as_stochastic_rounding(stochastic_rounding, seed=seed)
        return cls(name, shape, dtype, partition_strategy, exchange, optimizer_spec, seed, master_weights, rounding,
                   id_limits)

    @property
    def master_dtype(self) -> np.dtype:
        """The storage dtype: ``master_weights``, else ``dtype``."""
        return self.master_weights if self.master_weights is not None else self.dtype

    @property
    def trainable(self) -> bool:
        return self.optimizer_spec is not None and self.optimizer_spec.trainable

    @property
    def code(self) -> int:
        """The table's identity in the exchanges' signatures (a CRC of its name)."""
        return zlib.crc32(self.name.encode()) & 0x7FFFFFFF

    def signature(self) -> tuple:
        """What every replica must pass alike, compared when the table is created."""
        return (self.name, self.shape, str(self.dtype), self.partition_strategy,
                self.optimizer_spec.signature() if self.optimizer_spec else None, self.seed,
                str(self.master_weights) if self.master_weights is not None else None,
                self.stochastic_rounding.mode.name, self.exchange, self.id_limits.signature())

    def require_same_table(self, codes: np.ndarray, op: str) -> None:
        """Raise ``RuntimeError`` (on every replica: ``codes`` are agreed) unless every
        replica's table code in ``codes`` is this table's: replicas that look up or update
        different tables at the same point would exchange rows of the wrong table."""
        other = np.flatnonzero(codes != self.code)
        if other.size:
            raise RuntimeError(f"host embedding {self.name!r}: replica {int(other[0])} called "
                               f"embedding_{op} on a different table at the same point; every replica "
                               f"must look up and update the same tables in the same order")
