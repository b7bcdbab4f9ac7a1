"""popdist-lite: PopDist-style replication on MPI.

One MPI rank drives one replica. Import and go::

    import popdist_lite
    popdist_lite.init()
    emb = popdist_lite.create_host_embedding("chars", shape=[256, 256])

Topology (PopDist names are aliases of the snake_case ones), collectives on numpy
arrays, sharded host embeddings with their optimizer specs, ID limits, minibatching
and combiners, collections of tables at TorchRec's names (``EmbeddingBagCollection``,
``EmbeddingCollection``, their configs, jagged batches, placements and planner;
docs/recommender.md), data-parallel helpers, dense optimizers, stochastic rounding, loss
scaling, the per-replica counters (:func:`stats`, :func:`reset_stats`), the host feed
(``infeed``: batches computed by feed processes or a thread, with prefetch) and
checkpoints (``save_checkpoint``, ``load_checkpoint``, ``latest_checkpoint``) and elastic
jobs' ``should_checkpoint`` are re-exported here (see docs/precision.md,
docs/performance.md, docs/infeed.md, docs/minibatching.md, docs/checkpoint.md,
docs/elastic.md). ``popdist_lite.timeline`` (step markers and the user's spans:
``with pl.timeline.span("data"):``, docs/timeline.md) is an attribute without an import.

Importing the package starts nothing: no MPI, no exit handler, no thread. MPI is
imported by :func:`init` (which every collective calls first) or when a name that
needs it is first used: the re-exports below are loaded on first access (PEP 562), so
``import popdist_lite.records`` (the launcher does) loads only that module.
"""

from __future__ import annotations

import importlib

# Loaded eagerly (no MPI at import): the topology, and the feed, whose function
# ``infeed`` shares its name with the ``infeed`` subpackage (binding it here keeps
# ``popdist_lite.infeed`` the function, whatever is imported later).
from .infeed import Infeed, feed_shard, infeed
from .topology import (execute_on_instances, feeder_index, feeders_per_replica, getInstanceIndex,
                       getLocalInstanceIndex, getNumInstances, getNumIpusPerReplica, getNumLocalReplicas,
                       getNumTotalReplicas, getReplicaIndexOffset, init, instance_index, is_initialized,
                       is_popdist_env_set, isPopdistEnvSet, local_instance_index, num_instances,
                       num_ipus_per_replica, num_local_replicas, num_replicas, replica_comm, replica_id,
                       replica_index_offset, role, world_comm)

__version__ = "0.1.0"

#: Names loaded on first access: module -> names (``(name, attribute)`` to rename).
_LAZY = {
    ".collectives": ("all_gather", "all_gather_v", "all_reduce", "all_to_all", "all_to_all_v", "broadcast",
                     "reduce_scatter_sum", "set_collective_checks"),
    ".counters": ("reset_stats", "stats"),
    ".elastic": ("should_checkpoint",),
    ".data_parallel": ("CrossReplicaOptimizer", "all_reduce_gradients", "broadcast_parameters"),
    ".embedding": ("COMBINERS", "DiskStorage", "EmbeddingOptimizerSpec", "HostEmbedding", "HostEmbeddingAdagradOptimizerSpec",
                   "HostEmbeddingAdamOptimizerSpec", "HostEmbeddingMomentumOptimizerSpec",
                   "HostEmbeddingOptimizerSpec", "HostEmbeddingSGDGAOptimizerSpec", "IdLimitError",
                   "IdLimitRecorder", "IdLimits", "TableState", "bucket_of", "create_host_embedding",
                   "last_id_stats", "minibatch_ranges", "split_mask",
                   "EmbeddingBagConfig", "EmbeddingConfig", "PoolingType", "JaggedArray", "KeyedJaggedArray",
                   "KeyedArray", "TableCollection", "EmbeddingBagCollection", "EmbeddingCollection", "ShardedTable",
                   "ShardingType", "ParameterSharding", "EmbeddingShardingPlanner", "ParameterConstraints",
                   "ShardingPlan", "Topology"),
    ".loss_scaling": ("DynamicLossScale", "DynamicLossScaler", "FixedLossScale", "LossScaler", "StaticLossScaler"),
    ".dense_optimizers": ("SGD", "Adam", "DenseOptimizer", "MomentumSGD"),
    ".stochastic_rounding": ("StochasticRounding", "StochasticRoundingBehaviour", "round_to_nearest",
                             "stochastic_round"),
    ".checkpoint": ("CheckpointError", "latest_checkpoint", "load_checkpoint", "save_checkpoint",
                    ("wait_checkpoint", "wait")),
}
_WHERE = {(item if isinstance(item, str) else item[0]): (module, item if isinstance(item, str) else item[1])
          for module, items in _LAZY.items() for item in items}

__all__ = [
    "init", "is_initialized", "is_popdist_env_set", "replica_id", "num_replicas", "num_instances",
    "instance_index", "replica_index_offset", "num_local_replicas", "num_ipus_per_replica",
    "local_instance_index", "role", "replica_comm", "world_comm", "execute_on_instances",
    "isPopdistEnvSet", "getNumTotalReplicas", "getNumInstances", "getInstanceIndex", "getReplicaIndexOffset",
    "getNumLocalReplicas", "getNumIpusPerReplica", "getLocalInstanceIndex",
    "feeders_per_replica", "feeder_index", "infeed", "Infeed", "feed_shard",
    *_WHERE, "timeline",
]


#: Submodules reachable as attributes without importing them first (``pl.timeline.span``).
_SUBMODULES = ("timeline",)


def __getattr__(name: str):
    """A re-exported name or a submodule of :data:`_SUBMODULES`, imported on first
    access (PEP 562)."""
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where[0], __name__), where[1])
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
