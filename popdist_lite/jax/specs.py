"""Table and feature specifications, named as jax-tpu-embedding's SparseCore
``TableSpec`` and ``FeatureSpec`` (``jax_tpu_embedding.sparsecore.lib.nn.embedding_spec``).

A :class:`TableSpec` is one host table (its size, optimizer, combiner and ID limits);
a :class:`FeatureSpec` is one input feature looked up in a table (several features may
share a table). Differences from SparseCore, all from the tables living on the host:

- ``input_shape`` and ``output_shape`` are per replica (each replica feeds its own
  batch), not global;
- a feature is pooled over its last input axis when ``output_shape ==
  input_shape[:-1] + (embedding_dim,)`` (SparseCore's case: bags of up to
  ``input_shape[-1]`` IDs, ``-1`` marks padding), or not pooled when ``output_shape ==
  input_shape + (embedding_dim,)`` (one row per ID, as ``jnp.take``);
- ``optimizer`` is a popdist-lite host optimizer spec
  (:class:`popdist_lite.HostEmbeddingOptimizerSpec` (SGD), ``...AdagradOptimizerSpec``,
  ``...AdamOptimizerSpec``, ...), applied on the host by the replica owning each row;
- ``initializer`` is ``None`` (popdist-lite's seeded uniform table), a full ``(t, e)``
  array or ``initializer(shape, dtype)``, as :func:`popdist_lite.create_host_embedding`;
- ``max_ids_per_partition`` / ``max_unique_ids_per_partition`` default to no limit:
  the host exchange has no fixed buffers. Beyond a limit a call raises
  :class:`popdist_lite.IdLimitError`, drops IDs (``allow_id_dropping``) or runs in
  minibatches (``enable_minibatching``); docs/minibatching.md;
- ``storage`` is ``None`` (the table in memory) or a :class:`popdist_lite.DiskStorage`:
  each replica's partition and its optimizer state in a file on local disk behind a
  bounded cache of hot rows (docs/offload.md), for tables larger than host memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

import popdist_lite as pl

#: The ID that marks an unused position of a padded bag.
PADDING_ID = -1


@dataclass(frozen=True)
class TableSpec:
    """One host embedding table (see the module docstring for the fields' meaning).

    Raises:
        ValueError: an unknown combiner or a size that is not a positive integer (the
            other fields are checked by :func:`popdist_lite.create_host_embedding` when
            the table is created).
    """

    name: str
    vocabulary_size: int
    embedding_dim: int
    optimizer: Any = None
    combiner: str = "sum"
    initializer: Any = field(default=None, compare=False)
    max_ids_per_partition: int | None = None
    max_unique_ids_per_partition: int | None = None
    allow_id_dropping: bool = False
    enable_minibatching: bool = False
    partition_strategy: str = "TOKEN"
    exchange: str | None = None
    dtype: Any = np.float32
    seed: int = 0
    storage: Any = None

    def __post_init__(self):
        if self.combiner not in pl.COMBINERS:
            raise ValueError(f"TableSpec {self.name!r}: argument combiner: expected one of "
                             f"{', '.join(map(repr, pl.COMBINERS))}, got {self.combiner!r}")
        for name in ("vocabulary_size", "embedding_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"TableSpec {self.name!r}: argument {name}: expected a positive int, got {value!r}")
        object.__setattr__(self, "dtype", np.dtype(self.dtype))

    @property
    def trainable(self) -> bool:
        """Whether lookups are followed by updates (an optimizer with a learning rate > 0)."""
        return self.optimizer is not None and self.optimizer.trainable

    def create(self, comm) -> pl.HostEmbedding:
        """The table on ``comm``. Collective."""
        return pl.create_host_embedding(
            self.name, [self.vocabulary_size, self.embedding_dim], dtype=self.dtype,
            partition_strategy=self.partition_strategy, optimizer_spec=self.optimizer, initializer=self.initializer,
            seed=self.seed, exchange=self.exchange, max_ids_per_partition=self.max_ids_per_partition,
            max_unique_ids_per_partition=self.max_unique_ids_per_partition, allow_id_dropping=self.allow_id_dropping,
            enable_minibatching=self.enable_minibatching, storage=self.storage, comm=comm)


@dataclass(frozen=True)
class FeatureSpec:
    """One input feature looked up in ``table_spec`` (see the module docstring).

    Attributes:
        name: the feature's name (the key of its input and its activation).
        table_spec: the table it reads.
        input_shape: this replica's IDs per step, e.g. ``(B,)``, ``(B, T)`` or, for
            bags, ``(B, L)`` with ``L`` the most IDs in one bag.
        output_shape: ``input_shape + (e,)`` (one row per ID) or ``input_shape[:-1] +
            (e,)`` (bags on the last axis pooled with the table's combiner).

    Raises:
        ValueError: an output shape that is neither.
    """

    name: str
    table_spec: TableSpec
    input_shape: tuple
    output_shape: tuple

    def __post_init__(self):
        shape_in, shape_out = tuple(int(d) for d in self.input_shape), tuple(int(d) for d in self.output_shape)
        object.__setattr__(self, "input_shape", shape_in)
        object.__setattr__(self, "output_shape", shape_out)
        e = self.table_spec.embedding_dim
        if min(shape_in, default=1) < 0 or not (shape_out == shape_in + (e,)
                                                 or len(shape_in) >= 2 and shape_out == shape_in[:-1] + (e,)):
            raise ValueError(f"FeatureSpec {self.name!r}: expected output_shape = input_shape + ({e},) (one row per "
                             f"ID) or input_shape[:-1] + ({e},) (bags pooled), got input_shape {list(shape_in)} and "
                             f"output_shape {list(shape_out)}")

    @property
    def pooled(self) -> bool:
        """Whether bags on the last input axis are pooled into one row."""
        return len(self.output_shape) == len(self.input_shape)
