"""The rank plan: how many replicas each host holds (:func:`capacity`, :func:`fill`,
:func:`placement`), one :class:`RankSpec` per MPI rank of an attempt
(:func:`plan_ranks`), its table (:func:`format_topology`), and which ranks are which
replica's (:func:`processes_of`). The plan does not depend on how the ranks are
started (:mod:`popdist_lite_launcher.launch.base` turns it into an mpirun command)."""

from __future__ import annotations

import os
import shlex
import socket
import sys
from dataclasses import dataclass, field

from popdist_lite import records

from .api import Membership
from .options import Options

#: Which attempt a rank belongs to (0 for the first, 1 after the first restart, ...).
RESTART_COUNT_ENV = "POPDIST_LITE_RESTART_COUNT"

#: Thread-count variables set to 1 per rank unless the user already set them (like torchrun).
THREAD_VARS = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)


#: torchrun's variables (its contract with a worker, which much PyTorch code reads:
#: ``init_process_group("gloo")``'s ``env://``), set on every replica unless the user's
#: environment has them: ``RANK`` (the replica), ``WORLD_SIZE`` (the replicas),
#: ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (on its host), ``MASTER_ADDR`` and
#: ``MASTER_PORT`` (rank 0's, :func:`popdist_lite_launcher.launch.base.rendezvous`).
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

#: The launcher's terminal size, given to every rank when its stdout is a terminal (Open
#: MPI gives a rank's stdout a pty of size 0x0, on which tqdm draws nothing).
TERMINAL_VARS = ("COLUMNS", "LINES")


def terminal_env(environ=None, stream=None) -> dict[str, str]:
    """``COLUMNS`` and ``LINES`` of ``stream``'s terminal (default ``sys.stdout``) when it
    is one of known size, each unless ``environ`` (default ``os.environ``) has it."""
    environ = os.environ if environ is None else environ
    stream = sys.stdout if stream is None else stream
    try:
        if not stream.isatty():
            return {}
        size = os.get_terminal_size(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return {}
    if size.columns <= 0 or size.lines <= 0:
        return {}
    found = {"COLUMNS": str(size.columns), "LINES": str(size.lines)}
    return {name: value for name, value in found.items() if name not in environ}


@dataclass
class RankSpec:
    """One MPI rank of the job, i.e. one MPMD context ``-np 1``.

    ``role`` is ``"replica"`` for the process driving a replica or ``"feeder"``
    for a host feed process; ``replica`` is the replica it drives or feeds; ``host`` is where it runs (None: let mpirun decide); ``env`` holds the
    variables set for this rank only; ``mpi_args`` are extra per-context mpirun
    arguments (``--mpi-local-args`` and ``--instance-mpi-local-args``).
    """

    role: str
    replica: int
    host: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    mpi_args: list[str] = field(default_factory=list)


def default_rank_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The thread-count variables set to ``"1"`` for every rank, except those the
    user already set in ``environ`` (default ``os.environ``)."""
    environ = os.environ if environ is None else environ
    return {name: "1" for name in THREAD_VARS if name not in environ}


def capacity(slots: int | None, feeders: int) -> int:
    """Replicas a host of ``slots`` slots holds (a replica and its ``feeders`` feeders
    share a host); one for a host listed without slots."""
    return 1 if slots is None else slots // (1 + feeders)


def fill(hosts, replicas: int) -> list[tuple[str | None, int]]:
    """``(host, replicas on it)``: the ``hosts`` (``(host, room)`` pairs, in order), each
    filled up to its room until ``replicas`` are placed (Slurm's block distribution);
    hosts left empty are omitted."""
    placed, left = [], replicas
    for host, room in hosts:
        take = min(room, left)
        if take > 0:
            placed.append((host, take))
            left -= take
    return placed


def placement(opts: Options) -> tuple[tuple[str | None, int], ...]:
    """``(host, instances)`` of a job that is not elastic: on a Slurm allocation's nodes,
    filled in order up to their task slots (``opts.slurm_placement``); else
    ``--num-instances`` divided evenly among the hosts, in their order, or all on this
    machine (host None)."""
    if opts.slurm_placement:
        return opts.slurm_placement
    n = opts.num_instances
    if not opts.hosts:
        return ((None, n),)
    return tuple((host, n // len(opts.hosts)) for host in opts.hosts)


def plan_ranks(opts: Options, attempt: int = 0,
               membership: Membership | None = None) -> list[RankSpec]:
    """One :class:`RankSpec` per MPI rank, in rank order, with its PopDist environment.
    (The collector's address and the job's key, the same for every rank, are not in the
    specs: :func:`~popdist_lite_launcher.launch.base.job_environment` puts them in mpirun's environment, forwarded by name.)

    Instance ``i`` drives replica ``i``; instances are placed on the hosts of
    ``membership`` (an elastic job's attempt: its replica count is the attempt's),
    else divided evenly (consecutive blocks) among ``--host`` (:func:`placement`), and
    ``POPDIST_LOCAL_INSTANCE_INDEX`` counts instances per host; a replica also gets
    torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (each
    unless the user's environment has it; ``MASTER_ADDR`` and ``MASTER_PORT`` are the
    attempt's: :func:`popdist_lite_launcher.launch.base.rendezvous`). With
    ``--feeders-per-replica F`` the replicas keep ranks
    ``0..R-1`` and feeder ``k`` of replica ``r`` is rank ``R + r*F + k``, on its
    replica's host, with its replica's environment and MPI arguments plus the role
    variables (``POPDIST_LITE_ROLE=feeder``, ``POPDIST_LITE_FEEDER_OF=r``,
    ``POPDIST_LITE_FEEDER_INDEX=k``; not torchrun's :data:`TORCHRUN_VARS`, which a replica
    gets: a feeder is no rank of the replicas' process group). Every rank gets
    ``POPDIST_LITE_RESTART_COUNT=attempt``, the launcher's terminal size
    (:func:`terminal_env`), and ``POPRUN_LITE_STALL_INSPECTOR=1`` when ``--stall-warning`` or ``--stall-timeout``
    is on (its agent then records its progress).
    """
    hosts = membership.hosts if membership is not None else placement(opts)
    n = sum(count for _, count in hosts)
    local_args = [a for text in opts.mpi_local_args for a in shlex.split(text)]
    instance_args: dict[int, list[str]] = {}
    for index, args in opts.instance_mpi_local_args:
        instance_args.setdefault(index, []).extend(args)
    common = default_rank_env()
    common.update(terminal_env())
    common.update({
        "POPDIST_NUM_TOTAL_REPLICAS": str(n),
        "POPDIST_NUM_IPUS_PER_REPLICA": str(opts.ipus_per_replica),
        "POPDIST_NUM_LOCAL_REPLICAS": "1",
        "POPDIST_UNIFORM_REPLICAS_PER_INSTANCE": "1",
        # Open MPI gives every rank a pty, so ranks can't tell a terminal from a pipe.
        "POPDIST_LITE_STDOUT_ISATTY": "1" if sys.stdout.isatty() else "0",
        "POPDIST_LITE_FEEDERS_PER_REPLICA": str(opts.feeders_per_replica),
        RESTART_COUNT_ENV: str(attempt),
    })
    if opts.stall_warning or opts.stall_timeout:
        common[records.INSPECTOR_ENV] = "1"
    if opts.only_output_from_instance is not None:
        common["POPDIST_LITE_ONLY_OUTPUT_FROM_INSTANCE"] = str(opts.only_output_from_instance)
    if opts.timeline:
        common["POPDIST_LITE_TIMELINE"] = os.path.abspath(opts.timeline)
    ranks = []
    for host, count in hosts:
        for local in range(count):
            i = len(ranks)
            env = dict(common)
            torchrun = {"RANK": i, "WORLD_SIZE": n, "LOCAL_RANK": local, "LOCAL_WORLD_SIZE": count}
            env.update({name: str(value) for name, value in torchrun.items() if name not in os.environ})
            env.update({
                "POPDIST_REPLICA_INDEX_OFFSET": str(i),
                "POPDIST_LOCAL_INSTANCE_INDEX": str(local),
                "POPDIST_LITE_ROLE": "replica",
            })
            ranks.append(RankSpec(role="replica", replica=i, host=host, env=env,
                                  mpi_args=local_args + instance_args.get(i, [])))
    feeders = []
    for replica in ranks:
        for k in range(opts.feeders_per_replica):
            env = {name: value for name, value in replica.env.items() if name not in TORCHRUN_VARS}
            env.update({
                "POPDIST_LITE_ROLE": "feeder",
                "POPDIST_LITE_FEEDER_OF": str(replica.replica),
                "POPDIST_LITE_FEEDER_INDEX": str(k),
            })
            feeders.append(RankSpec(role="feeder", replica=replica.replica, host=replica.host,
                                    env=env, mpi_args=list(replica.mpi_args)))
    return ranks + feeders


def format_topology(ranks: list[RankSpec]) -> str:
    """A table of replica, instance, rank, host and role, one row per rank (a rank on
    this machine under its host name, as the failure report names it); a feeder's
    row reads ``feeder K of replica N`` (the replica it feeds)."""
    rows = [("replica", "instance", "rank", "host", "role")]
    for rank, spec in enumerate(ranks):
        role = spec.role
        if role == "feeder":
            role = f"feeder {spec.env.get('POPDIST_LITE_FEEDER_INDEX', '?')} of replica {spec.replica}"
        rows.append((str(spec.replica), str(spec.replica), str(rank),
                     spec.host or socket.gethostname(), role))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                     for row in rows)


def processes_of(ranks: list[RankSpec]) -> dict[int, list[tuple[str, int]]]:
    """For each replica, ``(who, rank)`` of its processes: its own rank first, then its
    feeders' (``"feeder 0 of replica 1"``)."""
    processes: dict[int, list[tuple[str, int]]] = {}
    for rank, spec in enumerate(ranks):
        who = f"replica {spec.replica}"
        if spec.role == "feeder":
            who = f"feeder {spec.env.get('POPDIST_LITE_FEEDER_INDEX', '?')} of replica {spec.replica}"
        processes.setdefault(spec.replica, []).append((who, rank))
    return processes
