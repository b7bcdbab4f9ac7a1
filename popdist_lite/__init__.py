"""popdist-lite: PopDist-style replication on MPI.

One MPI rank drives one replica. Import and go::

    import popdist_lite
    popdist_lite.init()
    emb = popdist_lite.create_host_embedding("chars", shape=[256, 256])

Topology (PopDist names are aliases of the snake_case ones), collectives on numpy
arrays, sharded host embeddings with their optimizer specs, ID limits, minibatching
and combiners, data-parallel helpers, dense optimizers, stochastic rounding, loss
scaling, the per-replica counters (:func:`stats`, :func:`reset_stats`) and the host
feed (``infeed``: batches computed by feed processes or a thread, with prefetch) and
checkpoints (``save_checkpoint``, ``load_checkpoint``, ``latest_checkpoint``) are
re-exported here (see docs/precision.md, docs/performance.md, docs/infeed.md,
docs/minibatching.md, docs/checkpoint.md).
"""

from .collectives import (all_gather, all_gather_v, all_reduce, all_to_all, all_to_all_v, broadcast, reduce_scatter_sum,
                          set_collective_checks)
from .counters import reset_stats, stats
from .data_parallel import CrossReplicaOptimizer, all_reduce_gradients, broadcast_parameters
from .embedding import (COMBINERS, EmbeddingOptimizerSpec, HostEmbedding, HostEmbeddingAdagradOptimizerSpec,
                        HostEmbeddingAdamOptimizerSpec, HostEmbeddingMomentumOptimizerSpec, HostEmbeddingOptimizerSpec,
                        HostEmbeddingSGDGAOptimizerSpec, IdLimitError, IdLimitRecorder, IdLimits, TableState,
                        bucket_of, create_host_embedding, last_id_stats, minibatch_ranges, split_mask)
from .infeed import Infeed, feed_shard, infeed
from .loss_scaling import DynamicLossScale, DynamicLossScaler, FixedLossScale, LossScaler, StaticLossScaler
from .dense_optimizers import SGD, Adam, DenseOptimizer, MomentumSGD
from .stochastic_rounding import (StochasticRounding, StochasticRoundingBehaviour, round_to_nearest,
                                  stochastic_round)
from .topology import (execute_on_instances, getInstanceIndex, getLocalInstanceIndex, getNumInstances,
                       getNumIpusPerReplica, getNumLocalReplicas, getNumTotalReplicas, getReplicaIndexOffset,
                       init, instance_index, is_initialized, is_popdist_env_set, isPopdistEnvSet,
                       local_instance_index, num_instances, num_ipus_per_replica, num_local_replicas,
                       num_replicas, replica_comm, replica_id, replica_index_offset, role, world_comm,
                       feeders_per_replica, feeder_index)

from . import checkpoint  # noqa: E402  (last: it builds on every module above)
from .checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from .checkpoint import wait as wait_checkpoint

__version__ = "0.1.0"

__all__ = [
    "init", "is_initialized", "is_popdist_env_set", "replica_id", "num_replicas", "num_instances",
    "instance_index", "replica_index_offset", "num_local_replicas", "num_ipus_per_replica",
    "local_instance_index", "role", "replica_comm", "world_comm", "execute_on_instances",
    "isPopdistEnvSet", "getNumTotalReplicas", "getNumInstances", "getInstanceIndex", "getReplicaIndexOffset",
    "getNumLocalReplicas", "getNumIpusPerReplica", "getLocalInstanceIndex",
    "all_gather", "all_gather_v", "reduce_scatter_sum", "all_to_all", "all_to_all_v", "all_reduce", "broadcast",
    "set_collective_checks",
    "HostEmbedding", "HostEmbeddingOptimizerSpec", "create_host_embedding", "TableState",
    "EmbeddingOptimizerSpec", "HostEmbeddingSGDGAOptimizerSpec", "HostEmbeddingMomentumOptimizerSpec",
    "HostEmbeddingAdagradOptimizerSpec", "HostEmbeddingAdamOptimizerSpec",
    "MomentumSGD", "CrossReplicaOptimizer", "broadcast_parameters", "all_reduce_gradients",
    "StochasticRounding", "StochasticRoundingBehaviour", "stochastic_round", "round_to_nearest",
    "SGD", "Adam", "DenseOptimizer",
    "LossScaler", "StaticLossScaler", "DynamicLossScaler", "FixedLossScale", "DynamicLossScale",
    "stats", "reset_stats",
    "feeders_per_replica", "feeder_index", "infeed", "Infeed", "feed_shard",
    "IdLimits", "IdLimitError", "IdLimitRecorder", "last_id_stats", "COMBINERS", "bucket_of", "split_mask",
    "minibatch_ranges",
    "save_checkpoint", "load_checkpoint", "latest_checkpoint", "wait_checkpoint", "CheckpointError",
]
