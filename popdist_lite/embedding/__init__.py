"""Sharded host embeddings (TOKEN and ENCODING partition strategies), ID limits,
minibatching and multivalent features (bags with combiners); collections of tables at
TorchRec's names (configs, jagged batches, placements, the planner)."""

from .collection import EmbeddingBagCollection, EmbeddingCollection, LookupContext, ShardedTable, TableCollection
from .combiners import COMBINERS
from .configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from .host_embedding import HostEmbedding, create_host_embedding
from .id_limits import IdLimitError, IdLimitRecorder, IdLimits, bucket_of, last_id_stats, minibatch_ranges, split_mask
from .jagged import JaggedArray, KeyedArray, KeyedJaggedArray
from .placement import ParameterSharding, ShardingType
from .planner import EmbeddingShardingPlanner, ParameterConstraints, ShardingPlan, Topology
from .state import TableState
from .storage import DiskStorage
from .optimizer_specs import (EmbeddingOptimizerSpec, HostEmbeddingAdagradOptimizerSpec, HostEmbeddingAdamOptimizerSpec,
                        HostEmbeddingMomentumOptimizerSpec, HostEmbeddingOptimizerSpec,
                        HostEmbeddingSGDGAOptimizerSpec, UpdateContext)

__all__ = ["HostEmbedding", "TableState", "DiskStorage", "create_host_embedding", "EmbeddingOptimizerSpec", "HostEmbeddingOptimizerSpec",
           "HostEmbeddingSGDGAOptimizerSpec", "HostEmbeddingMomentumOptimizerSpec", "HostEmbeddingAdagradOptimizerSpec",
           "HostEmbeddingAdamOptimizerSpec", "UpdateContext", "IdLimits", "IdLimitError", "IdLimitRecorder", "last_id_stats",
           "COMBINERS", "bucket_of", "split_mask", "minibatch_ranges",
           "EmbeddingBagConfig", "EmbeddingConfig", "PoolingType", "JaggedArray", "KeyedJaggedArray", "KeyedArray",
           "TableCollection", "EmbeddingBagCollection", "EmbeddingCollection", "ShardedTable", "LookupContext",
           "ShardingType", "ParameterSharding", "EmbeddingShardingPlanner", "ParameterConstraints", "ShardingPlan",
           "Topology"]
