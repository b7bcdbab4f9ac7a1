"""Who am I? Replica topology with PopDist's names.

Every MPI rank whose role is ``replica`` drives exactly one replica. The topology
comes from, in order of preference:

1. the ``POPDIST_*`` variables that ``poprun-lite`` (or Graphcore's ``poprun``)
   sets per instance (``POPDIST_NUM_TOTAL_REPLICAS``, ``POPDIST_REPLICA_INDEX_OFFSET``,
   ...; Graphcore's PopRun and PopDist documentation);
2. ``MPI.COMM_WORLD`` under plain ``mpirun -n N`` or any MPI launcher
   (replica = rank, replicas = size);
3. a single process: one replica.

Ranks may also have another role (``POPDIST_LITE_ROLE``, e.g. ``feeder``); they are
split off into their own communicator by :func:`init`, so replica collectives run on
:func:`replica_comm`, which holds the replicas only, ordered by replica index.

Host feed processes (``poprun-lite --feeders-per-replica F``, see docs/infeed.md) are
ranks with these variables, which a user may also set by hand under plain ``mpirun``:

``POPDIST_LITE_ROLE=feeder``
    this rank feeds a replica instead of driving one;
``POPDIST_LITE_FEEDER_OF=<replica>``
    the replica it feeds (default: ``POPDIST_REPLICA_INDEX_OFFSET``);
``POPDIST_LITE_FEEDER_INDEX=<k>``
    its index among that replica's feeders, ``0 <= k < F`` (default: counted in
    ``COMM_WORLD`` rank order among the feeders of the same replica);
``POPDIST_LITE_FEEDERS_PER_REPLICA=F``
    optional on any rank; when set it must equal the number of feeders per replica
    found in the job.

:func:`init` checks that every replica has the same number ``F`` of feeders with
indices ``0..F-1`` and builds, per replica, a feed communicator holding the replica
(rank 0) and its feeders (rank ``1 + k``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable

__all__ = [
    "Topology",
    "current",
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
    "feeders_per_replica",
    "feeder_index",
    "execute_on_instances",
]

_ROLE_COLOURS = {"replica": 0, "feeder": 1}


@dataclass(frozen=True)
class Topology:
    """This rank's place in the job (see :func:`current`).

    Attributes:
        replica_id: the replica this rank drives (on a feeder: the replica it feeds).
        num_replicas, num_local_replicas, num_ipus_per_replica, local_instance_index:
            as the functions of the same names.
        role: ``"replica"`` or ``"feeder"``.
        from_popdist_env: whether the ``POPDIST_*`` variables gave the topology.
        world: ``MPI.COMM_WORLD``.
        replicas: the communicator of the replica ranks (None on other roles).
        feeders_per_replica: ``F``, host feed processes per replica.
        feeder_index: this rank's index among its replica's feeders (None on a replica).
        feed: the communicator of this rank's replica (rank 0) and its feeders (rank
            ``1 + k``); None when ``F == 0``.
    """

    replica_id: int
    num_replicas: int
    num_local_replicas: int
    num_ipus_per_replica: int
    local_instance_index: int
    role: str
    from_popdist_env: bool
    world: Any  # MPI.Comm
    replicas: Any  # MPI.Comm holding the replica ranks only (None on other roles)
    feeders_per_replica: int = 0
    feeder_index: int | None = None
    feed: Any = None


@dataclass(frozen=True)
class _Environment:
    """What this rank's environment variables say (before looking at the MPI job)."""

    role: str
    from_popdist_env: bool
    total: int | None  # POPDIST_NUM_TOTAL_REPLICAS (None under plain mpirun)
    offset: int | None  # POPDIST_REPLICA_INDEX_OFFSET (None under plain mpirun)
    local: int
    ipus: int
    local_instance: int
    served: int | None  # feeders: the replica fed
    wanted_index: int | None  # feeders: POPDIST_LITE_FEEDER_INDEX
    wanted_feeders: int | None  # POPDIST_LITE_FEEDERS_PER_REPLICA


_topology: Topology | None = None


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
    """Initialise MPI and discover this rank's topology. Idempotent; collective on the
    first call.

    Works under ``poprun-lite`` (topology from ``POPDIST_*``), under plain ``mpirun``
    (topology from ``COMM_WORLD``) and as a single process (one replica). Splits the
    replicas from the other roles (:func:`replica_comm`) and builds the feed
    communicators, then starts the runtime services (:func:`popdist_lite.services.start`:
    the failure hook that aborts the job on an uncaught exception, progress recording
    for poprun-lite's stall inspector, the stall watchdog and the timeline when their
    variables are set).

    Raises:
        ValueError: the ``POPDIST_*`` variables disagree with the MPI job (for example
            more replicas announced than there are replica ranks), on every rank;
            ``POPDIST_LITE_STALL_TIMEOUT`` is not a number.
    """
    global _topology
    if _topology is not None:
        return
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    env = _read_environment()
    sub, total, offset, ranks = _assign_roles(world, env)
    layout = _feed_layout(ranks)
    if isinstance(layout, str):
        sub.Free()
        raise ValueError(f"rank {world.rank}: inconsistent topology: {layout}")
    num_feeders, feeder_indices = layout
    if env.role == "feeder":
        offset, total = env.served, sum(1 for r in ranks if r[0] == "replica")
    feeder_index = feeder_indices.get(world.rank)
    feed = None
    if num_feeders:  # one communicator per replica: the replica is rank 0, feeder k rank 1 + k
        feed = world.Split(offset, 0 if feeder_index is None else 1 + feeder_index)
    topo = Topology(
        replica_id=offset,
        num_replicas=total,
        num_local_replicas=env.local,
        num_ipus_per_replica=env.ipus,
        local_instance_index=env.local_instance,
        role=env.role,
        from_popdist_env=env.from_popdist_env,
        world=world,
        replicas=sub if env.role == "replica" else None,
        feeders_per_replica=num_feeders,
        feeder_index=feeder_index,
        feed=feed,
    )
    from . import services

    services.start(topo)
    _topology = topo


def _read_environment() -> _Environment:
    """This rank's role and numbers from its environment variables (local).

    Raises:
        ValueError: an unknown role or a variable that is not an integer.
    """
    role = os.environ.get("POPDIST_LITE_ROLE", "replica") or "replica"
    if role not in _ROLE_COLOURS:
        raise ValueError(f"POPDIST_LITE_ROLE: expected one of {sorted(_ROLE_COLOURS)}, got {role!r}")
    from_env = is_popdist_env_set()
    if from_env:
        total = _env_int("POPDIST_NUM_TOTAL_REPLICAS")
        offset = _env_int("POPDIST_REPLICA_INDEX_OFFSET", 0)
        local = _env_int("POPDIST_NUM_LOCAL_REPLICAS", 1)
        ipus = _env_int("POPDIST_NUM_IPUS_PER_REPLICA", 1)
        local_instance = _env_int("POPDIST_LOCAL_INSTANCE_INDEX", 0)
    else:  # plain mpirun: replicas are numbered in COMM_WORLD order, after the split
        total, offset, local, ipus, local_instance = None, None, 1, 1, 0
    feeder = role == "feeder"
    return _Environment(role, from_env, total, offset, local, ipus, local_instance,
                        served=_env_int("POPDIST_LITE_FEEDER_OF", offset) if feeder else None,
                        wanted_index=_env_int("POPDIST_LITE_FEEDER_INDEX") if feeder else None,
                        wanted_feeders=_env_int("POPDIST_LITE_FEEDERS_PER_REPLICA"))


def _assign_roles(world, env: _Environment):
    """Split the replicas from the other roles (collective) and check the ``POPDIST_*``
    numbers against the job.

    Returns:
        ``(sub, total, offset, ranks)``: this role's communicator (replicas ordered by
        replica index), the replica count and this replica's index (replicas), and every
        rank's ``(role, replica, feeder index, F, problem)``.

    Raises:
        ValueError: on every rank, naming the first rank whose numbers are inconsistent.
    """
    role, total, offset = env.role, env.total, env.offset
    key = offset if role == "replica" and env.from_popdist_env else world.rank
    sub = world.Split(_ROLE_COLOURS[role], key)
    if not env.from_popdist_env and role == "replica":
        total, offset = sub.size, sub.rank
    problem = None
    if role == "replica":
        if env.local != 1:
            problem = f"POPDIST_NUM_LOCAL_REPLICAS: expected 1 (one replica per instance), got {env.local}"
        elif sub.size != total:
            problem = (f"POPDIST_NUM_TOTAL_REPLICAS: expected {sub.size} (the number of replica "
                       f"ranks in this MPI job), got {total}")
        elif sub.rank != offset:
            problem = f"POPDIST_REPLICA_INDEX_OFFSET: expected {sub.rank}, got {offset}"
    elif env.served is None:
        problem = f"role {role!r} needs POPDIST_LITE_FEEDER_OF (the replica it feeds)"
    ranks = world.allgather((role, offset if role == "replica" else env.served, env.wanted_index,
                             env.wanted_feeders, problem))
    problems = [r[4] for r in ranks if r[4]]
    if problems:
        sub.Free()
        raise ValueError(f"rank {world.rank}: inconsistent topology: {problems[0]}")
    return sub, total, offset, ranks


def _feed_layout(ranks: list[tuple]) -> tuple[int, dict[int, int]] | str:
    """Check the feeders of every rank's ``(role, replica, feeder_index, F, _)``.

    Returns ``(F, {world rank: feeder index})`` or a description of the problem.
    Feeder indices left unset are counted in world rank order per replica.
    """
    num_replicas = sum(1 for r in ranks if r[0] == "replica")
    by_replica: dict[int, list[int]] = {}
    for rank, (role, replica, _, _, _) in enumerate(ranks):
        if role == "feeder":
            if not 0 <= replica < num_replicas:
                return f"rank {rank}: POPDIST_LITE_FEEDER_OF={replica} is not a replica (0..{num_replicas - 1})"
            by_replica.setdefault(replica, []).append(rank)
    counts = {len(by_replica.get(r, [])) for r in range(num_replicas)}
    if len(counts) > 1:
        found = {r: len(by_replica.get(r, [])) for r in range(num_replicas)}
        return f"every replica needs the same number of feeders, found {found} (replica: feeders)"
    num_feeders = counts.pop() if counts else 0
    for rank, (_, _, _, wanted, _) in enumerate(ranks):
        if wanted is not None and wanted != num_feeders:
            return (f"rank {rank}: POPDIST_LITE_FEEDERS_PER_REPLICA={wanted}, but the job has "
                    f"{num_feeders} feeder(s) per replica")
    indices = {}
    for replica, members in by_replica.items():
        given = [ranks[m][2] for m in members]
        if all(g is None for g in given):
            given = list(range(len(members)))
        if sorted(g if g is not None else -1 for g in given) != list(range(len(members))):
            return (f"the feeders of replica {replica} have POPDIST_LITE_FEEDER_INDEX {given}; "
                    f"expected each of 0..{len(members) - 1} once")
        indices.update(zip(members, given))
    return num_feeders, indices


def is_initialized() -> bool:
    """True once :func:`init` has run in this process."""
    return _topology is not None


def current() -> Topology:
    """This rank's :class:`Topology` (calls :func:`init` first if needed)."""
    if _topology is None:
        init()
    assert _topology is not None
    return _topology


def replica_id() -> int:
    """Index of the replica this process drives (on a feeder: the replica it feeds),
    ``0 <= replica_id() < num_replicas()``."""
    return current().replica_id


def num_replicas() -> int:
    """Total number of replicas in the job (PopDist: ``getNumTotalReplicas``)."""
    return current().num_replicas


def num_instances() -> int:
    """Number of instances (host processes driving replicas): total / local replicas."""
    t = current()
    return t.num_replicas // t.num_local_replicas


def instance_index() -> int:
    """Index of this instance: replica index offset / local replicas."""
    t = current()
    return t.replica_id // t.num_local_replicas


def replica_index_offset() -> int:
    """Index of this instance's first replica (PopDist: ``getReplicaIndexOffset``);
    the replica index itself, as every instance drives one replica."""
    return instance_index() * num_local_replicas()


def num_local_replicas() -> int:
    """Replicas driven by this instance; always 1 in popdist-lite."""
    return current().num_local_replicas


def local_instance_index() -> int:
    """Index of this instance among those on the same host (``POPDIST_LOCAL_INSTANCE_INDEX``,
    0 when unset)."""
    return current().local_instance_index


def num_ipus_per_replica() -> int:
    """``POPDIST_NUM_IPUS_PER_REPLICA``, 1 when unset. Exported for compatibility only."""
    return current().num_ipus_per_replica


def role() -> str:
    """This rank's role: ``"replica"`` (takes part in collectives) or ``"feeder"`` (a host
    feed process, see :func:`popdist_lite.infeed`)."""
    return current().role


def replica_comm():
    """The ``mpi4py`` communicator of the replicas, ordered by replica index.

    Raises:
        RuntimeError: called on a rank that is not a replica (a feeder).
    """
    t = current()
    if t.replicas is None:
        raise RuntimeError(f"rank {t.world.rank} has role {t.role!r}: it is not a replica and has no replica "
                           f"communicator; a feeder serves its replica from popdist_lite.infeed(...), so "
                           f"call infeed() right after init(), before any collective")
    return t.replicas


def world_comm():
    """``MPI.COMM_WORLD``: every rank of the job, replicas and feeders."""
    return current().world


def feeders_per_replica() -> int:
    """Host feed processes per replica (``poprun-lite --feeders-per-replica``); 0 when none."""
    return current().feeders_per_replica


def feeder_index() -> int | None:
    """On a feeder, its index among its replica's feeders (``0..F-1``); None on a replica."""
    return current().feeder_index


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
