"""Sharded host embeddings (TOKEN and ENCODING partition strategies), ID limits,
minibatching and multivalent features (bags with combiners)."""

from .combiners import COMBINERS
from .host_embedding import HostEmbedding, create_host_embedding
from .limits import IdLimitError, IdLimits
from .minibatching import bucket_of, minibatch_ranges, split_mask
from .optimizer import (EmbeddingOptimizerSpec, HostEmbeddingAdagradOptimizerSpec, HostEmbeddingAdamOptimizerSpec,
                        HostEmbeddingMomentumOptimizerSpec, HostEmbeddingOptimizerSpec,
                        HostEmbeddingSGDGAOptimizerSpec, UpdateContext)

__all__ = ["HostEmbedding", "create_host_embedding", "EmbeddingOptimizerSpec", "HostEmbeddingOptimizerSpec",
           "HostEmbeddingSGDGAOptimizerSpec", "HostEmbeddingMomentumOptimizerSpec", "HostEmbeddingAdagradOptimizerSpec",
           "HostEmbeddingAdamOptimizerSpec", "UpdateContext", "IdLimits", "IdLimitError",
           "COMBINERS", "bucket_of", "split_mask", "minibatch_ranges"]
