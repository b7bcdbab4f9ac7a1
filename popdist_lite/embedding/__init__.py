"""Sharded host embeddings (TOKEN and ENCODING partition strategies)."""

from .host_embedding import HostEmbedding, create_host_embedding
from .optimizer import HostEmbeddingOptimizerSpec

__all__ = ["HostEmbedding", "HostEmbeddingOptimizerSpec", "create_host_embedding"]
