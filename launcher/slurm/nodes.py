"""A lost node under Slurm: which nodes of the allocation a job can still use, and the
membership policies of a job on an allocation's nodes (``--launcher slurm``, no
``-H``/``--hostfile``).

A node of the allocation is **usable** (:meth:`Nodes.usable`) while it is still one of
the job's nodes (``squeue -h -j JOB -o %N``: a job submitted with ``--no-kill`` keeps
running when a node fails, and Slurm takes the node out of the job) and Slurm's state
for it (``sinfo -h -N -n NODES -o '%N %T'``) is ``allocated``, ``mixed``, ``idle``,
``completing`` or ``planned``, without the ``*`` of a node that does not respond. A
node Slurm has not marked yet but whose processes are gone (its slurmd does not start
a step there) is found by a probe through Slurm (:func:`popdist_lite_launcher.launch.remote.probe_hosts`
with the ``srun`` launch agent) after a failed attempt (:meth:`Nodes.gone`).

Policies (:func:`make_policy`):

- :class:`SlurmFixedPolicy` (``--max-restarts``): after a failed attempt, the nodes of
  its membership that are no longer usable are lost; the next attempt runs on the
  allocation's usable nodes, filled in order up to their task slots, with
  ``--num-replicas`` replicas or as many as those slots hold (a change of membership,
  not counted against ``--max-restarts``; the program resumes from its checkpoint at
  the new replica count). Without ``--max-restarts`` the job fails, and the report
  is preceded by a line naming each lost node and why.
- :class:`SlurmCluster` (``--min-replicas``): an elastic job's hosts, discovered as the
  allocation's usable nodes with their task slots (so the elastic job leaves a lost node
  out, and a node Slurm marks down during an attempt is a host no longer discovered).

Everything ``squeue`` and ``sinfo`` print is checked before use: the job's node list by
Slurm's host-list grammar and its expansion (``scontrol show hostnames``) name by name
with :func:`popdist_lite_launcher.core.hosts.check_host`
(:func:`popdist_lite_launcher.slurm.scontrol.expand_nodelist`); a ``sinfo`` line counts only when
it names one of the allocation's nodes and its state fits the grammar ``word[flags]``.
Output that does not pass leaves a node without a state (not usable; why names the
failed ``squeue`` too, if it failed), or the job's node list unknown (then the
allocation's nodes are kept, their states deciding); when ``sinfo`` itself fails,
the states are unknown and only the probe decides. Each query's output is read as it
comes and stopped past :data:`~popdist_lite_launcher.slurm.scontrol.MAX_OUTPUT_BYTES`
(:func:`popdist_lite_launcher.slurm.scontrol.query`): a query stopped so has failed.
"""

from __future__ import annotations

import re
import subprocess

from .allocation import SLURM
from .scontrol import MAX_OUTPUT_BYTES, check_nodelist, expand_nodelist, query, route_to_node
from ..core.api import LauncherError, Membership
from ..core.options import Options
from ..core.plan import capacity, fill
from ..core.text import counted, shown
from ..launch.address import launcher_address
from ..launch.remote import probe_hosts
from ..membership.elastic import Cluster, size_attempt
from ..membership.policies import ElasticPolicy, FixedPolicy

#: Slurm node states (``sinfo %T``, flags removed) in which a node runs steps.
USABLE_STATES = frozenset({"allocated", "mixed", "idle", "completing", "planned"})
_STATE = re.compile(r"([a-z_]{1,40})([*~#!%$@^+-]{0,8})")


def parse_states(output: str, nodes: list[str]) -> dict[str, str]:
    """The state of each of ``nodes`` in ``sinfo -h -N -o '%N %T'`` output (``pdls1
    mixed``, one node a line; a node in several partitions may appear more than once,
    with one state). Lines naming other nodes are ignored; a line that is not ``NAME
    STATE`` with a checked name and a state of the grammar ``word[flags]`` is skipped.

    Returns:
        ``{node: state}`` for the nodes of ``nodes`` found (``down*``, ``mixed``, ...).
    """
    wanted, states = set(nodes), {}
    for line in output[:MAX_OUTPUT_BYTES].splitlines():
        fields = line.split()
        if len(fields) != 2 or fields[0] not in wanted or not _STATE.fullmatch(fields[1]):
            continue
        states[fields[0]] = fields[1]
    return states


def usable_state(state: str | None) -> bool:
    """Whether a node in Slurm state ``state`` (``sinfo %T``) runs steps: one of
    :data:`USABLE_STATES` and not flagged ``*`` (not responding); None (no state) is not."""
    match = _STATE.fullmatch(state or "")
    return bool(match) and match[1] in USABLE_STATES and "*" not in match[2]


class Nodes:
    """The nodes of Slurm job ``job_id`` (an :class:`~popdist_lite_launcher.slurm.allocation.Allocation`'s
    id and nodes) as Slurm and a probe see them now. ``run(argv)`` runs a query and
    returns its :class:`subprocess.CompletedProcess` (default: the real command, its
    output bounded: :func:`_run`); ``expand(nodelist)`` expands a Slurm host list
    (default :func:`popdist_lite_launcher.slurm.scontrol.expand_nodelist`)."""

    def __init__(self, job_id: str, nodes: list[str], launch_agent: str, network_interface=None,
                 run=None, expand=None, probe=None):
        self.job_id, self.nodes = job_id, list(nodes)
        self.launch_agent, self.network_interface = launch_agent, network_interface
        self._run = run or _run
        self._expand = expand or expand_nodelist
        self._probe = probe or self._probe_hosts

    def in_job(self) -> tuple[list[str], str | None]:
        """The allocation's nodes that are still the job's (``squeue -h -j JOB -o %N``),
        in the allocation's order, and a problem with the query (then all of them)."""
        try:
            proc = self._run(["squeue", "-h", "-j", self.job_id, "-o", "%N"])
        except (OSError, subprocess.SubprocessError, LauncherError) as exc:
            return list(self.nodes), f"squeue: {exc}"
        text = proc.stdout[:MAX_OUTPUT_BYTES].strip()
        if proc.returncode != 0 or not text:
            said = (proc.stderr or "").strip()[-200:]
            return list(self.nodes), f"squeue -j {self.job_id} printed no node list: {said!r}"
        try:
            check_nodelist(text)
        except LauncherError:
            return list(self.nodes), f"squeue -j {self.job_id} printed no node list: {shown(text)}"
        try:
            listed = set(self._expand(text))
        except LauncherError as exc:
            return list(self.nodes), str(exc)
        return [node for node in self.nodes if node in listed], None

    def states(self, nodes: list[str]) -> dict[str, str] | None:
        """Slurm's state of each of ``nodes`` (``sinfo``; a node missing from its answer
        has none), or None when the query failed (Slurm's view is unknown)."""
        if not nodes:
            return {}
        try:
            proc = self._run(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %T"])
        except (OSError, subprocess.SubprocessError, LauncherError):
            return None
        return parse_states(proc.stdout, nodes) if proc.returncode == 0 else None

    def usable(self) -> tuple[list[str], dict[str, str]]:
        """The allocation's usable nodes now (module docstring), in order, and why each
        other node is not. When ``sinfo`` fails, the job's nodes count as usable (the
        probe after a failed attempt still finds a node that is gone)."""
        in_job, problem = self.in_job()
        why = {node: f"node {node} is no longer a node of Slurm job {self.job_id}"
               for node in self.nodes if node not in in_job}
        states = self.states(in_job)
        for node in in_job if states is not None else ():
            if not usable_state(states.get(node)):
                state = states.get(node)
                why[node] = (f"node {node} of Slurm job {self.job_id} is {state}" if state else
                             f"node {node} of Slurm job {self.job_id}: sinfo gave no state"
                             + (f" ({problem})" if problem else ""))
        return [node for node in self.nodes if node not in why], why

    def gone(self, used: list[str], unreachable: dict[str, str] | None = None) -> dict[str, str]:
        """Which of the nodes ``used`` by a failed attempt are lost, and why: not usable
        in Slurm's eyes (:meth:`usable`), not reached by the launch agent just now
        (``unreachable``, ``{node: why}``: no probe again), or failing a probe through
        Slurm."""
        unreachable = unreachable or {}
        _, why = self.usable()
        lost = {node: why[node] for node in used if node in why}
        lost.update({node: unreachable[node] for node in used if node not in lost and node in unreachable})
        rest = [node for node in used if node not in lost]
        lost.update({node: problem for node, problem in self._probe(rest).items() if problem})
        return lost

    def _probe_hosts(self, nodes: list[str]) -> dict[str, str | None]:
        if not nodes:
            return {}
        try:
            address = launcher_address(self.network_interface, nodes, route_to_node)
            return probe_hosts(self.launch_agent, nodes, address)
        except (OSError, LauncherError) as exc:
            return {node: f"node {node}: {exc}" for node in nodes}


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    """``argv`` run with :func:`popdist_lite_launcher.slurm.scontrol.query`: at most
    :data:`~popdist_lite_launcher.slurm.scontrol.MAX_OUTPUT_BYTES` bytes of output read.

    Raises:
        LauncherError: as that function.
    """
    return query(argv, max_bytes=MAX_OUTPUT_BYTES)


def nodes_of(opts: Options) -> Nodes:
    """The :class:`Nodes` of the allocation ``opts`` runs on."""
    return Nodes(opts.allocation.job_id, list(opts.allocation.nodes), opts.launch_agent,
                 opts.network_interface)


class SlurmFixedPolicy(FixedPolicy):
    """A fixed job on an allocation's nodes that leaves a lost node out (module
    docstring); ``nodes``: its :class:`Nodes`."""

    def __init__(self, opts: Options, nodes: Nodes):
        super().__init__(opts)
        self.nodes = nodes
        self.slots = dict(zip(opts.allocation.nodes, opts.allocation.tasks))
        self.left = list(opts.allocation.nodes)

    def lost(self, membership: Membership, say, unreachable: dict[str, str]) -> list[str]:
        """After a failed attempt on ``membership``: its nodes that are lost (each named,
        with why, through ``say``; ``unreachable``: :attr:`Outcome.unreachable
        <popdist_lite_launcher.core.api.Outcome>`); the next membership is set on the
        nodes left. [] without ``--max-restarts`` (the job fails) or when no node is left."""
        gone = self.nodes.gone(membership.names(), unreachable)
        for node, why in gone.items():
            say(f"Slurm node {node} lost: {why}")
        if not gone:
            return []
        if self.opts.max_restarts == 0:
            say(f"not restarting without {counted('node', gone)} (no --max-restarts "
                f"or --min-replicas)")
            return []
        self.left = [node for node in self.left if node not in gone]
        feeders = self.opts.feeders_per_replica
        placed = fill(((node, capacity(self.slots[node], feeders)) for node in self.left), self.opts.num_replicas)
        if not placed:
            say(f"no node of Slurm job {self.nodes.job_id} is left to restart on")
            return []
        self.membership = Membership(tuple(placed))
        return list(gone)


class SlurmCluster(Cluster):
    """An elastic job's hosts on an allocation: the usable nodes (module docstring)
    with their task slots, in the allocation's order."""

    def __init__(self, opts: Options, nodes: Nodes):
        super().__init__(opts, route_to_node)
        self.nodes = nodes
        self.slots = dict(zip(opts.allocation.nodes, opts.allocation.tasks))

    def discover(self) -> list[tuple[str, int | None]]:
        usable, _ = self.nodes.usable()
        return [(node, self.slots[node]) for node in usable]

    def size(self, usable: list[tuple[str, int | None]]) -> Membership:
        """:func:`~popdist_lite_launcher.membership.elastic.size_attempt` for this job, the nodes
        named even when the batch script's node is the only one: mpirun given no hosts
        inside an allocation would start its daemons on every node of it, a lost one too."""
        return size_attempt(usable, self.opts.num_replicas, self.opts.feeders_per_replica)


def make_policy(opts: Options) -> FixedPolicy | ElasticPolicy | None:
    """The membership policy of a job on an allocation's nodes under ``--launcher
    slurm`` (no ``-H``, ``--hostfile`` or discovery script): :class:`SlurmFixedPolicy`,
    or an elastic policy over :class:`SlurmCluster`; None for any other job."""
    if opts.launcher != SLURM or opts.allocation is None or opts.hosts is None \
            or list(opts.hosts) != list(opts.allocation.nodes) or opts.host_discovery_script:
        return None
    nodes = nodes_of(opts)
    if opts.elastic:
        return ElasticPolicy(opts, SlurmCluster(opts, nodes))
    return SlurmFixedPolicy(opts, nodes)
