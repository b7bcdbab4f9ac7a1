"""Sharded host embeddings (TOKEN and ENCODING partition strategies)."""

from .host_embedding import HostEmbedding, create_host_embedding
from .optimizer import (EmbeddingOptimizerSpec, HostEmbeddingAdagradOptimizerSpec, HostEmbeddingAdamOptimizerSpec,
                        HostEmbeddingMomentumOptimizerSpec, HostEmbeddingOptimizerSpec,
                        HostEmbeddingSGDGAOptimizerSpec, UpdateContext)

__all__ = ["HostEmbedding", "create_host_embedding", "EmbeddingOptimizerSpec", "HostEmbeddingOptimizerSpec",
           "HostEmbeddingSGDGAOptimizerSpec", "HostEmbeddingMomentumOptimizerSpec", "HostEmbeddingAdagradOptimizerSpec",
           "HostEmbeddingAdamOptimizerSpec", "UpdateContext"]
