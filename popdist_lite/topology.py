"""Who am I? Replica topology with PopDist's names.

Every MPI rank whose role is ``replica`` drives exactly one replica. The topology
comes from, in order of preference:

1. the ``POPDIST_*`` variables that ``poprun-lite`` (or Graphcore's ``poprun``)
   sets per instance (``POPDIST_NUM_TOTAL_REPLICAS``, ``POPDIST_REPLICA_INDEX_OFFSET``,
   ...; see REFERENCE.md, "PopRun");
2. ``MPI.COMM_WORLD`` under plain ``mpirun -n N`` or any MPI launcher
   (replica = rank, replicas = size);
3. a single process: one replica.

Ranks may also have another role (``POPDIST_LITE_ROLE``, e.g. ``feeder``); they are
split off into their own communicator by :func:`init`, so replica collectives run on
:func:`replica_comm`, which holds the replicas only, ordered by replica index.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable

__all__ = [
    "init",
    "is_initialized",
    "is_popdist_env_set",
    "replica_id",
    "num_replicas",
    "num_instances",
    "instance_index",
    "replica_index_offset",
    "num_local_replicas",
    "num_ipus_per_replica",
    "local_instance_index",
    "role",
    "replica_comm",
    "world_comm",
    "execute_on_instances",
]

_ROLE_COLOURS = {"replica": 0, "feeder": 1}


@dataclass(frozen=True)
class _Topology:
    replica_id: int
    num_replicas: int
    num_local_replicas: int
    num_ipus_per_replica: int
    local_instance_index: int
    role: str
    from_popdist_env: bool
    world: Any  # MPI.Comm
    replicas: Any  # MPI.Comm holding the replica ranks only (None on other roles)


_topology: _Topology | None = None


def _env_int(name: str, default: int | None = None) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}: expected an integer, got {value!r}") from None


def is_popdist_env_set() -> bool:
    """True when the process was started by ``poprun-lite``/``poprun`` (``POPDIST_*`` set)."""
    return "POPDIST_NUM_TOTAL_REPLICAS" in os.environ


def init() -> None:
    """Initialise MPI and the replica communicator. Idempotent; collective on first call.

    Works under ``poprun-lite`` (topology from ``POPDIST_*``), under plain ``mpirun``
    (topology from ``COMM_WORLD``) and as a single process (one replica). Also installs
    the failure hook: an uncaught exception on any rank prints the rank's traceback,
    records it for the launcher's report and aborts the whole job instead of leaving the
    other ranks waiting in a collective (as ``python -m mpi4py`` does). When
    ``POPDIST_LITE_TIMELINE`` is set, starts the timeline (:mod:`popdist_lite.timeline`).

    Raises:
        ValueError: the ``POPDIST_*`` variables disagree with the MPI job (for example
            more replicas announced than there are replica ranks), on every rank.
    """
    global _topology
    if _topology is not None:
        return
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    role = os.environ.get("POPDIST_LITE_ROLE", "replica")
    if role not in _ROLE_COLOURS:
        raise ValueError(f"POPDIST_LITE_ROLE: expected one of {sorted(_ROLE_COLOURS)}, got {role!r}")
    from_env = is_popdist_env_set()
    if from_env:
        total = _env_int("POPDIST_NUM_TOTAL_REPLICAS")
        offset = _env_int("POPDIST_REPLICA_INDEX_OFFSET", 0)
        local = _env_int("POPDIST_NUM_LOCAL_REPLICAS", 1)
        ipus = _env_int("POPDIST_NUM_IPUS_PER_REPLICA", 1)
        local_instance = _env_int("POPDIST_LOCAL_INSTANCE_INDEX", 0)
    else:
        total, offset, local, ipus, local_instance = world.size, world.rank, 1, 1, 0

    # Split replicas from other roles; key orders replicas by replica index.
    key = offset if role == "replica" else world.rank
    sub = world.Split(_ROLE_COLOURS[role], key)
    replicas = sub if role == "replica" else None
    if role != "replica" and not from_env:
        raise ValueError(f"role {role!r} needs the POPDIST_* variables that poprun-lite sets")
    problem = None
    if role == "replica":
        if local != 1:
            problem = f"POPDIST_NUM_LOCAL_REPLICAS: expected 1 (one replica per instance), got {local}"
        elif replicas.size != total:
            problem = (f"POPDIST_NUM_TOTAL_REPLICAS: expected {replicas.size} (the number of replica "
                       f"ranks in this MPI job), got {total}")
        elif replicas.rank != offset:
            problem = f"POPDIST_REPLICA_INDEX_OFFSET: expected {replicas.rank}, got {offset}"
    problems = [p for p in world.allgather(problem) if p]
    if problems:
        sub.Free()
        raise ValueError(f"rank {world.rank}: inconsistent topology: {problems[0]}")

    from . import _excepthook

    _excepthook.install(replica_index=offset, role=role)
    _topology = _Topology(
        replica_id=offset,
        num_replicas=total,
        num_local_replicas=local,
        num_ipus_per_replica=ipus,
        local_instance_index=local_instance,
        role=role,
        from_popdist_env=from_env,
        world=world,
        replicas=replicas,
    )
    timeline_path = os.environ.get("POPDIST_LITE_TIMELINE")
    if timeline_path and role == "replica":
        from . import timeline

        timeline.enable(timeline_path, offset, replicas)


def is_initialized() -> bool:
    """True once :func:`init` has run in this process."""
    return _topology is not None


def _topo() -> _Topology:
    if _topology is None:
        init()
    assert _topology is not None
    return _topology


def replica_id() -> int:
    """Index of the replica this process drives, ``0 <= replica_id() < num_replicas()``."""
    return _topo().replica_id


def num_replicas() -> int:
    """Total number of replicas in the job (PopDist: ``getNumTotalReplicas``)."""
    return _topo().num_replicas


def num_local_replicas() -> int:
    """Replicas driven by this instance; always 1 in popdist-lite."""
    return _topo().num_local_replicas


def num_instances() -> int:
    """Number of instances (host processes driving replicas): total / local replicas."""
    t = _topo()
    return t.num_replicas // t.num_local_replicas


def replica_index_offset() -> int:
    """Index of this instance's first replica (PopDist: ``getReplicaIndexOffset``)."""
    return _topo().replica_id


def instance_index() -> int:
    """Index of this instance: replica index offset / local replicas."""
    t = _topo()
    return t.replica_id // t.num_local_replicas


def num_ipus_per_replica() -> int:
    """``POPDIST_NUM_IPUS_PER_REPLICA``, 1 when unset. Exported for compatibility only."""
    return _topo().num_ipus_per_replica


def local_instance_index() -> int:
    """Index of this instance among those on the same host (0 when unset)."""
    return _topo().local_instance_index


def role() -> str:
    """This rank's role: ``"replica"`` (takes part in collectives) or ``"feeder"``."""
    return _topo().role


def replica_comm():
    """The ``mpi4py`` communicator of the replicas, ordered by replica index.

    Raises:
        RuntimeError: called on a rank that is not a replica (a feeder).
    """
    t = _topo()
    if t.replicas is None:
        raise RuntimeError(f"rank {t.world.rank} has role {t.role!r}: it is not a replica and has no replica communicator")
    return t.replicas


def world_comm():
    """``MPI.COMM_WORLD``: every rank of the job, replicas and feeders."""
    return _topo().world


def execute_on_instances(instances: Iterable[int], func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``func(*args, **kwargs)`` on the listed instances only; ``None`` elsewhere.

    PopDist's helper for work such as logging or checkpointing on instance 0. Not a
    collective: ``func`` must not call collectives.
    """
    return func(*args, **kwargs) if instance_index() in set(instances) else None


# PopDist-compatible aliases.
isPopdistEnvSet = is_popdist_env_set
getNumTotalReplicas = num_replicas
getNumInstances = num_instances
getInstanceIndex = instance_index
getReplicaIndexOffset = replica_index_offset
getNumLocalReplicas = num_local_replicas
getNumIpusPerReplica = num_ipus_per_replica
getLocalInstanceIndex = local_instance_index
