"""poprun-lite's options, typed: :class:`Options`, built once from the parsed command line
(:func:`popdist_lite_launcher.cli.parse_args`) and read as attributes everywhere else."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # slurm imports the launch, which reads Options
    from ..slurm.allocation import Allocation
    from ..slurm.preempt import Settings


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
    launch_agent: str                       # under --launcher slurm: slurm.SRUN_AGENT
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
    preempt: Settings                       # --preemption, --requeue-signal, --no-requeue, --grace-period
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
