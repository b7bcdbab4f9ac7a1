"""popdist-lite: PopDist-style replication on MPI.

One MPI rank drives one replica. Import and go::

    import popdist_lite
    popdist_lite.init()
    emb = popdist_lite.create_host_embedding("chars", shape=[256, 256])

Topology (PopDist names are aliases of the snake_case ones), collectives on numpy
arrays, sharded host embeddings, data-parallel helpers and the per-replica counters
(:func:`stats`, :func:`reset_stats`), ID limits and minibatching (:class:`IdLimits`,
:class:`IdLimitError`, :func:`split_mask`, :func:`bucket_of`, :func:`minibatch_ranges`) and
their statistics (:class:`IdLimitRecorder`, :func:`last_id_stats`) are re-exported here.
"""

from .collectives import (all_gather, all_gather_v, all_reduce, all_to_all, all_to_all_v, broadcast,
                          reduce_scatter_sum)
from .counters import reset_stats, stats
from .data_parallel import CrossReplicaOptimizer, all_reduce_gradients, broadcast_parameters
from .embedding import (COMBINERS, HostEmbedding, HostEmbeddingOptimizerSpec, IdLimitError, IdLimits, bucket_of,
                        create_host_embedding, minibatch_ranges, split_mask)
from .id_stats import IdLimitRecorder, last_id_stats
from .optimizers import MomentumSGD
from .topology import (execute_on_instances, getInstanceIndex, getLocalInstanceIndex, getNumInstances,
                       getNumIpusPerReplica, getNumLocalReplicas, getNumTotalReplicas, getReplicaIndexOffset,
                       init, instance_index, is_initialized, is_popdist_env_set, isPopdistEnvSet,
                       local_instance_index, num_instances, num_ipus_per_replica, num_local_replicas,
                       num_replicas, replica_comm, replica_id, replica_index_offset, role, world_comm)

__version__ = "0.1.0"

__all__ = [
    "init", "is_initialized", "is_popdist_env_set", "replica_id", "num_replicas", "num_instances",
    "instance_index", "replica_index_offset", "num_local_replicas", "num_ipus_per_replica",
    "local_instance_index", "role", "replica_comm", "world_comm", "execute_on_instances",
    "isPopdistEnvSet", "getNumTotalReplicas", "getNumInstances", "getInstanceIndex", "getReplicaIndexOffset",
    "getNumLocalReplicas", "getNumIpusPerReplica", "getLocalInstanceIndex",
    "all_gather", "all_gather_v", "reduce_scatter_sum", "all_to_all", "all_to_all_v", "all_reduce", "broadcast",
    "HostEmbedding", "HostEmbeddingOptimizerSpec", "create_host_embedding",
    "MomentumSGD", "CrossReplicaOptimizer", "broadcast_parameters", "all_reduce_gradients",
    "stats", "reset_stats",
    "IdLimits", "IdLimitError", "IdLimitRecorder", "last_id_stats", "COMBINERS", "bucket_of", "split_mask",
    "minibatch_ranges",
]
