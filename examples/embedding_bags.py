"""An ``EmbeddingBagCollection`` at TorchRec's names over one
:class:`popdist_lite.torch.HostEmbeddingBag` per table: examples/dlrm.py's sparse part.

It stands in for the library's collection (``popdist_lite.torch.EmbeddingBagCollection``,
one exchange for all tables) with the same construction and call, so examples/dlrm.py
swaps it by changing its import:

- ``EmbeddingBagConfig(name, embedding_dim, num_embeddings, feature_names, pooling)``:
  TorchRec's fields (``pooling`` ``"SUM"`` or ``"MEAN"``, TorchRec's ``PoolingType``
  names);
- ``EmbeddingBagCollection(tables=[...], ...)``; ``embedding_bag_configs()``;
- ``forward(features)``: ``features`` maps each feature name to ``(values, lengths)``
  (int64 tensors: the IDs of all ``B`` bags one after the other, and the ``B`` bag
  lengths), or is a TorchRec ``KeyedJaggedTensor`` (anything with ``to_dict()`` of
  objects with ``values()`` and ``lengths()``); returns a dict of feature name ->
  pooled ``(B, embedding_dim)`` tensor (what TorchRec's ``KeyedTensor.to_dict()`` gives).

Each table is its own ``HostEmbeddingBag`` (sharded over the replicas, updated by its
optimizer in the backward pass), so a step runs one exchange per table and one per
update: 26 for Criteo. A table looks up one feature (a second feature would call its
table twice in a step, which for a stateful optimizer is not one update: docs/torch.md,
"Limits").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch

import popdist_lite.torch as pt

_POOLING = {"SUM": "sum", "MEAN": "mean"}


@dataclass(frozen=True)
class EmbeddingBagConfig:
    """One table, as TorchRec's ``EmbeddingBagConfig``: ``num_embeddings`` rows of
    ``embedding_dim`` float32 values, looked up by the features ``feature_names`` and
    pooled by ``pooling`` (``"SUM"`` or ``"MEAN"``)."""

    name: str
    embedding_dim: int
    num_embeddings: int
    feature_names: list[str] = field(default_factory=list)
    pooling: str = "SUM"


class EmbeddingBagCollection(torch.nn.Module):
    """Tables of :class:`EmbeddingBagConfig`, each a :class:`popdist_lite.torch.HostEmbeddingBag`.

    Args:
        tables: the tables' configurations (distinct names; one feature each; feature
            names distinct).
        optimizer_spec: every table's ``popdist_lite.HostEmbedding*OptimizerSpec``.
        seed: table ``k`` (in ``tables`` order) is initialised with seed ``seed + k``
            (the library's default initializer: uniform in ``[-0.05, 0.05)``, the same
            for any replica count).
        storage: table name -> :class:`popdist_lite.DiskStorage` for the tables kept on
            local disk behind a cache (docs/offload.md); the others are in memory.
        **table_options: the rest of :class:`popdist_lite.torch.HostEmbeddingBag`'s
            arguments for every table (``partition_strategy``, ``storage``, ...).

    Raises:
        ValueError: a configuration breaks the rules above (on every replica alike:
            the configurations are the same everywhere).
    """

    def __init__(self, tables: list[EmbeddingBagConfig], *, optimizer_spec=None, seed: int = 0,
                 storage: Mapping[str, object] | None = None, **table_options):
        super().__init__()
        names = [t.name for t in tables]
        features = [f for t in tables for f in t.feature_names]
        if not tables or len(set(names)) != len(names) or len(set(features)) != len(features):
            raise ValueError(f"EmbeddingBagCollection: expected tables with distinct names and feature names, "
                             f"got tables {names} with features {features}")
        for t in tables:
            if len(t.feature_names) != 1 or t.pooling not in _POOLING:
                raise ValueError(f"EmbeddingBagCollection: table {t.name!r}: expected one feature and pooling "
                                 f"in {sorted(_POOLING)}, got {t.feature_names} and {t.pooling!r}")
        self._configs = list(tables)
        self.embedding_bags = torch.nn.ModuleDict({
            t.name: pt.HostEmbeddingBag(t.num_embeddings, t.embedding_dim, mode=_POOLING[t.pooling], name=t.name,
                                        optimizer_spec=optimizer_spec, seed=seed + k, include_last_offset=True,
                                        storage=(storage or {}).get(t.name), **table_options)
            for k, t in enumerate(tables)})

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return list(self._configs)

    def forward(self, features) -> dict[str, torch.Tensor]:
        """Pooled lookups: feature name -> ``(B, embedding_dim)``. Collective (every
        table's exchange, in ``tables`` order)."""
        jagged = features.to_dict() if hasattr(features, "to_dict") else features
        out = {}
        for config in self._configs:
            name = config.feature_names[0]
            values, lengths = _values_and_lengths(jagged[name])
            offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
            torch.cumsum(lengths, 0, out=offsets[1:])
            out[name] = self.embedding_bags[config.name](values, offsets)
        return out


def _values_and_lengths(feature) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(feature, tuple):
        return feature
    return feature.values(), feature.lengths()  # a TorchRec JaggedTensor


def features_from_ids(names: list[str], ids: torch.Tensor) -> Mapping[str, tuple[torch.Tensor, torch.Tensor]]:
    """One ID per bag: ``ids`` int64 ``(B, F)``, column ``j`` the IDs of feature
    ``names[j]``, as the ``features`` of :meth:`EmbeddingBagCollection.forward`."""
    ones = torch.ones(ids.shape[0], dtype=torch.int64)
    columns = ids.t().contiguous()
    return {name: (columns[j], ones) for j, name in enumerate(names)}
