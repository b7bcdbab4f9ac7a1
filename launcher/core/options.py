"""poprun-lite's options, typed: :class:`Options`, built once from the parsed command line
(:func:`popdist_lite_launcher.cli.parse_args`) and read as attributes everywhere else,
with the values it holds that a backend works out: a Slurm job's :class:`Allocation`
(:mod:`popdist_lite_launcher.slurm.allocation`) and the :class:`PreemptionSettings`
(:mod:`popdist_lite_launcher.slurm.preempt`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from .text import signal_name

#: Seconds before the job's end (``EndTime``) by which the replicas must have reached their
#: boundary after the requeue signal: Slurm's SIGTERM of the time limit comes then.
END_MARGIN_SECONDS = 2.0


@dataclass(frozen=True)
class Allocation:
    """A Slurm job's allocation: its id, its nodes in Slurm's order and the tasks
    (slots) on each, ``tasks[i]`` on ``nodes[i]``."""

    job_id: str
    nodelist: str
    nodes: tuple[str, ...]
    tasks: tuple[int, ...]

    @property
    def total_tasks(self) -> int:
        return sum(self.tasks)

    @property
    def slots(self) -> dict[str, int]:
        return dict(zip(self.nodes, self.tasks))

    def describe(self) -> str:
        """``slurm job 12: 2 node(s) pdls[1-2], 4 task(s): pdls1 2, pdls2 2``."""
        per_node = ", ".join(f"{node} {count}" for node, count in zip(self.nodes, self.tasks))
        return (f"slurm job {self.job_id}: {len(self.nodes)} node(s) {self.nodelist}, "
                f"{self.total_tasks} task(s): {per_node}")


@dataclass(frozen=True)
class PreemptionSettings:
    """The preemption options after
    :func:`popdist_lite_launcher.slurm.preempt.settings`: ``enabled`` (``--preemption``
    resolved), the requeue signal's number, whether to requeue, SIGTERM's grace in
    seconds and where it came from, the Slurm job id (None outside an allocation) and
    the requeue signal's grace (``--preemption-grace``; None: until the job's end)."""

    enabled: bool
    requeue_signal: int
    requeue: bool
    grace: float | None      # SIGTERM's; None: Slurm's KillWait, not read yet (slurm.preempt.with_grace)
    grace_source: str
    job_id: str | None
    requeue_grace: float | None = None

    def requeue_grace_text(self) -> str:
        """How long the replicas have after the requeue signal, in words."""
        if self.requeue_grace is not None:
            return f"grace {self.requeue_grace:g} s (--preemption-grace)"
        if self.job_id is not None:
            return f"grace until the job's end (EndTime) less {END_MARGIN_SECONDS:g} s"
        return "no grace limit (not in a Slurm job)"

    def describe(self) -> str:
        """One line for ``--print-topology``."""
        if not self.enabled:
            return "preemption off: SIGTERM stops the job at once"
        requeue = "requeue" if self.requeue and self.job_id else "no requeue"
        return (f"preemption on: {signal_name(self.requeue_signal)} -> checkpoint and {requeue} "
                f"({self.requeue_grace_text()}), SIGTERM -> checkpoint (grace {self.grace:g} s: "
                f"{self.grace_source})")


@dataclass(frozen=True)
class Options:
    """Every option of ``poprun-lite`` after the cross-checks of ``parse_args`` (field
    names are argparse's ``dest`` names; seconds are floats, 0 meaning "no limit" or
    "off" where the option says so)."""

    program: str
    args: list[str]
    # topology
    num_replicas: int
    num_instances: int                      # always equal to num_replicas
    feeders_per_replica: int
    ipus_per_replica: int
    host: list[tuple[str, int | None]] | None   # -H as given: (name, slots or None)
    hostfile: str | None
    hosts: list[str] | None                 # -H or --hostfile names, in order; None: this machine
    slots: dict[str, int]                   # the hosts listed with slots
    slurm_placement: tuple[tuple[str, int], ...] | None  # (node, instances) on the allocation's nodes
    # hosts and network
    launch_agent: str                       # under --launcher slurm: slurm.launcher.SRUN_AGENT
    launcher: str                           # "ssh" or "slurm" (slurm.configure settles "auto")
    allocation: Allocation | None           # the Slurm allocation whose nodes or steps are used
    network_interface: str | None
    host_check: bool
    # mpirun
    mpirun: str | None
    mpi_global_args: list[str]
    mpi_local_args: list[str]
    instance_mpi_local_args: list[tuple[int, list[str]]]
    # output and control
    only_output_from_instance: int | None
    print_topology: bool
    tag_output: bool
    verbose: bool
    timeout: float                          # 0: no limit
    timeline: str | None
    # stalls and restarts
    stall_warning: float
    stall_timeout: float                    # resolved from $POPDIST_LITE_STALL_TIMEOUT; 0: never
    max_restarts: int
    # preemption and time limits
    preempt: PreemptionSettings             # --preemption, --requeue-signal, --no-requeue, --grace-period
    # elastic jobs
    elastic: bool                           # --min-replicas or --host-discovery-script given
    min_replicas: int | None                # set (default --num-replicas) when elastic
    host_discovery_script: str | None
    discovery_interval: float
    elastic_timeout: float

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace, **resolved) -> "Options":
        """The options of ``namespace`` (argparse's), with the ``resolved`` fields (those
        ``parse_args`` derives or fills in) taking precedence.

        Raises:
            TypeError: a field is in neither (a parser option without a field here).
        """
        given = vars(namespace)
        return cls(**{f.name: resolved[f.name] if f.name in resolved else given[f.name]
                      for f in fields(cls) if f.name in resolved or f.name in given})


#: What a replica count is called elsewhere (horovodrun's and mpirun's ``-np``), accepted as
#: an alias of ``--num-replicas``.
NUM_REPLICAS_ALIASES = ("-np",)

_HOSTS = "-H/--hostfile or a Slurm allocation"
_OUTPUT = ("every rank's output comes to poprun-lite's own (--tag-output names the rank, "
           "--only-output-from-instance keeps one); save it with `poprun-lite ... 2>&1 | tee run.log`")
_IPU = "there are no IPUs here: a replica is one MPI rank on a CPU host; drop it"
_FUSION = "Horovod's fusion and cache tuning has no counterpart (a collective is one MPI call); drop it"

#: Options of torchrun, horovodrun and PopRun that mean nothing to poprun-lite: ``(flags,
#: takes a value, hint)``. Each is refused with its hint, ``{value}`` being the value given
#: (``--nproc-per-node 2: ... use --num-replicas 2``): docs/migration.md has the tables.
#: A value of ``"?"`` marks options that take one optionally (PopRun's ``--numa-aware=yes``).
#: No option of one letter: argparse would take ``--mpi-local-args "-x VAR"``'s value for
#: it (torchrun's ``-m``, horovodrun's ``-p``, ``-i``, ``-x`` are refused by their long names).
REFUSED_OPTIONS: tuple[tuple[tuple[str, ...], bool | str, str], ...] = (
    # torchrun (both spellings: torchrun takes --nproc-per-node and --nproc_per_node)
    (("--nproc-per-node", "--nproc_per_node"), True,
     "poprun-lite starts one process per replica: use --num-replicas {value} (with -H or a "
     "Slurm allocation for several hosts)"),
    (("--nnodes",), True,
     f"poprun-lite starts every host's processes itself: list the hosts with {_HOSTS} and give "
     "the total with --num-replicas (MIN:MAX: add --min-replicas)"),
    (("--node-rank", "--node_rank"), True,
     f"poprun-lite runs once, for every host, not once per host: list the hosts with {_HOSTS}"),
    (("--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-id",
      "--rdzv_id", "--rdzv-conf", "--rdzv_conf"), True,
     f"there is no rendezvous: poprun-lite starts every rank through mpirun; list the hosts with {_HOSTS}"),
    (("--master-addr", "--master_addr", "--master-port", "--master_port"), True,
     "poprun-lite exports MASTER_ADDR and MASTER_PORT to every rank (rank 0's host, a free port "
     "there); to choose them, set MASTER_ADDR/MASTER_PORT in poprun-lite's environment"),
    (("--standalone",), False, "one host is the default: drop --standalone"),
    (("--max_restarts",), True, "use --max-restarts {value}"),
    (("--monitor-interval", "--monitor_interval"), True,
     "each rank's agent reports to poprun-lite as soon as anything happens; drop it"),
    (("--start-method", "--start_method"), True, "mpirun starts every rank as a process of its own; drop it"),
    (("--role",), True, "every rank runs the same program; drop it"),
    (("--module",), False, "poprun-lite runs the command given: poprun-lite ... python -m MODULE"),
    (("--no-python", "--no_python", "--run-path", "--run_path"), False,
     "poprun-lite runs the command given: poprun-lite ... python train.py, or an executable"),
    (("--log-dir", "--log_dir", "--redirects", "--tee", "--local-ranks-filter",
      "--local_ranks_filter", "--output-filename"), True, _OUTPUT),
    (("--local-addr", "--local_addr"), True, "use --network-interface IFACE|CIDR (the job's network)"),
    # horovodrun
    (("--num-proc",), True, "use --num-replicas {value} (or -np {value})"),
    (("--hosts",), True, "use -H {value}"),
    (("--min-np",), True, "use --min-replicas {value} (an elastic job)"),
    (("--max-np",), True, "use --num-replicas {value} (an elastic job's most replicas)"),
    (("--slots-per-host", "--slots"), True, "give the slots with the hosts: -H host0:{value},host1:{value}"),
    (("--ssh-port",), True, "use --launch-agent 'ssh -p {value}'"),
    (("--ssh-identity-file",), True, "use --launch-agent 'ssh -i {value}'"),
    (("--start-timeout",), True,
     "poprun-lite checks every host before the launch and names one that does not answer; "
     "--timeout bounds the whole job"),
    (("--timeline-filename",), True, "use --timeline {value}"),
    (("--reset-limit",), True, "use --max-restarts {value}"),
    (("--mpi-args",), True, "use --mpi-global-args '{value}'"),
    (("--gloo", "--mpi", "--jsrun"), False, "poprun-lite always runs the job with mpirun; drop it"),
    (("--fusion-threshold-mb", "--cycle-time-ms", "--cache-capacity"), True, _FUSION),
    (("--hierarchical-allreduce", "--hierarchical-allgather", "--autotune", "--disable-cache"), False, _FUSION),
    # PopRun
    (("--vipu-server-host", "--vipu-server-port", "--vipu-server-timeout", "--vipu-partition",
      "--vipu-cluster", "--vipu-allocation"), True, _IPU),
    (("--reset-partition", "--update-partition", "--remove-partition", "--offline-mode"), "?", _IPU),
    (("--executable-cache-path",), True, _IPU),
    (("--num-ilds",), True, f"there are no IPU-Link domains: list the hosts with {_HOSTS}"),
    (("--numa-aware",), "?",
     "ranks run unbound (mpirun --bind-to none) and use 1 thread each (OMP_NUM_THREADS=1); drop it"),
    (("--process-placement",), True,
     "ranks run unbound (mpirun --bind-to none) and use 1 thread each (OMP_NUM_THREADS=1); drop it"),
)
