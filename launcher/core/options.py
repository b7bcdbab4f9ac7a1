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
