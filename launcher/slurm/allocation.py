"""The allocation poprun-lite runs in (its job, nodes and task slots) and the part it
takes in the job: which launcher starts the processes, the hosts and the replicas.

Inside an allocation (``SLURM_JOB_ID`` set, e.g. in an ``sbatch`` script or under
``salloc``) and without ``-H``/``--hostfile``, the job's hosts are the allocation's
nodes (``SLURM_JOB_NODELIST``, expanded by ``scontrol show hostnames``) with as many
slots as Slurm gave each node tasks (``SLURM_TASKS_PER_NODE``, ``2(x3),1`` form, else
``SLURM_NTASKS_PER_NODE``), and ``--num-replicas`` defaults to the allocation's task
count (:func:`from_environment`, :func:`place`).

``--launcher`` (:func:`choose_launcher`): ``slurm`` starts every process on another
node through Slurm (:mod:`popdist_lite_launcher.slurm.launcher`); ``ssh`` is mpirun over
ssh (``--launch-agent``), outside Slurm's control; ``auto`` (the default) is ``slurm``
inside an allocation without ``-H``/``--hostfile``, else ``ssh`` (:func:`configure`).

Every value read from Slurm's environment and from Slurm's commands is checked before
it is used (node names with the grammar of :mod:`popdist_lite_launcher.core.hosts`), and
bounded before it costs memory: the environment's texts at
:data:`~popdist_lite_launcher.slurm.scontrol.MAX_TEXT_CHARS`, the commands' output read as
it comes and stopped at a limit (:func:`popdist_lite_launcher.slurm.scontrol.query`; the
node list at :data:`~popdist_lite_launcher.slurm.scontrol.MAX_NODES` names), tasks at
:data:`MAX_TASKS_PER_NODE` a node and :data:`MAX_TASKS` in all. A bad
one raises :class:`~popdist_lite_launcher.core.api.LauncherError` naming the variable or
command.
"""

from __future__ import annotations

import re

from . import scontrol
from .launcher import SRUN_AGENT
from .scontrol import MAX_TEXT_CHARS, job_id
from ..core.api import LauncherError
from ..core.options import Allocation
from ..core.plan import fill
from ..core.text import shown

AUTO, SSH, SLURM = "auto", "ssh", "slurm"
LAUNCHERS = (AUTO, SSH, SLURM)

#: Most tasks on one node: the ceiling of Slurm's own ``MaxTasksPerNode`` (slurm.conf(5)).
MAX_TASKS_PER_NODE = 65533
#: Most tasks of an allocation in all, so the most replicas it gives a job: far more
#: than one mpirun command holds (an MPMD context of some 600 bytes a rank).
MAX_TASKS = 65536
_TASKS = re.compile(r"([0-9]{1,9})(?:\(x([0-9]{1,9})\))?")
def _check_tasks(count: int, total: int, name: str, text: str) -> None:
    """Refuse a node's task ``count`` past :data:`MAX_TASKS_PER_NODE`, or a ``total``
    so far past :data:`MAX_TASKS` (naming ``name`` and its value ``text``)."""
    if count > MAX_TASKS_PER_NODE:
        raise LauncherError(f"${name} {shown(text)}: {count} tasks on a node, more than the "
                            f"{MAX_TASKS_PER_NODE} Slurm allows (MaxTasksPerNode)")
    if total > MAX_TASKS:
        raise LauncherError(f"${name} {shown(text)}: more than {MAX_TASKS} tasks in all, the "
                            f"most replicas poprun-lite takes from an allocation")


def parse_tasks_per_node(text: str, nodes: int, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Slurm's tasks per node, ``2(x3),1`` (2 on each of 3 nodes, then 1), or for
    ``name`` ``SLURM_NTASKS_PER_NODE`` one count for every node (``2``), as one count per
    node.

    Raises:
        LauncherError: naming ``name``: not that form, a count below 1 or above
            :data:`MAX_TASKS_PER_NODE`, more than :data:`MAX_TASKS` in all, or counts for
            a number of nodes other than ``nodes``.
    """
    if len(text) > MAX_TEXT_CHARS:
        raise LauncherError(f"${name} is longer than {MAX_TEXT_CHARS} characters")
    if name == "SLURM_NTASKS_PER_NODE":  # one count, the same on every node
        match = _TASKS.fullmatch(text.strip())
        if not match or match[2] is not None or int(match[1]) < 1:
            raise LauncherError(f"${name}: expected a count of at least 1, got {shown(text)}")
        _check_tasks(int(match[1]), int(match[1]) * nodes, name, text)
        return [int(match[1])] * nodes
    counts: list[int] = []
    total = 0
    for entry in text.split(","):
        match = _TASKS.fullmatch(entry.strip())
        if not match:
            raise LauncherError(f"${name}: expected COUNT or COUNT(xREPEAT), comma-separated "
                                f"(2(x3),1), got {shown(text)}")
        count, repeat = int(match[1]), int(match[2] or 1)
        if count < 1 or repeat < 1:
            raise LauncherError(f"${name}: counts and repeats must be at least 1, got {shown(text)}")
        if len(counts) + repeat > nodes:
            raise LauncherError(f"${name} {shown(text)} names more nodes than the "
                                f"allocation's {nodes}")
        total += count * repeat
        _check_tasks(count, total, name, text)
        counts += [count] * repeat
    if len(counts) != nodes:
        raise LauncherError(f"${name} {shown(text)} gives tasks for {len(counts)} node(s), "
                            f"the allocation has {nodes}")
    return counts


def from_environment(environ, expand=None) -> Allocation | None:
    """The allocation this process runs in, from ``environ`` (None outside one): its
    nodes (``SLURM_JOB_NODELIST``, else ``SLURM_NODELIST``, through ``expand``, default
    :func:`~popdist_lite_launcher.slurm.scontrol.expand_nodelist`) and the
    tasks on each (``SLURM_TASKS_PER_NODE``, else ``SLURM_NTASKS_PER_NODE``); the node
    count is checked against ``SLURM_JOB_NUM_NODES`` when that is set.

    Raises:
        LauncherError: naming the variable that is missing or bad.
    """
    job = job_id(environ)
    if job is None:
        return None
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise LauncherError(f"inside Slurm job {job} but $SLURM_JOB_NODELIST is not set")
    nodes = (expand or scontrol.expand_nodelist)(nodelist)
    count = environ.get("SLURM_JOB_NUM_NODES")
    if count is not None and count != str(len(nodes)):
        raise LauncherError(f"$SLURM_JOB_NUM_NODES {shown(count)} does not match the "
                            f"{len(nodes)} node(s) of $SLURM_JOB_NODELIST {shown(nodelist)}")
    for name in ("SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        text = environ.get(name)
        if text:
            tasks = parse_tasks_per_node(text, len(nodes), name)
            break
    else:
        raise LauncherError(f"inside Slurm job {job} but neither $SLURM_TASKS_PER_NODE nor "
                            f"$SLURM_NTASKS_PER_NODE is set")
    return Allocation(job, nodelist, tuple(nodes), tuple(tasks))


def choose_launcher(choice: str, inside: bool, hosts_given: bool) -> str:
    """``ssh`` or ``slurm`` for ``--launcher choice``: ``auto`` is ``slurm`` when
    ``inside`` an allocation and no hosts were given (``-H``, ``--hostfile``).

    Raises:
        LauncherError: ``slurm`` outside an allocation, or an unknown choice.
    """
    if choice not in LAUNCHERS:
        raise LauncherError(f"--launcher {choice!r}: expected one of {', '.join(LAUNCHERS)}")
    if choice == AUTO:
        return SLURM if inside and not hosts_given else SSH
    if choice == SLURM and not inside:
        raise LauncherError("--launcher slurm needs a Slurm allocation (run poprun-lite in an "
                            "sbatch script or under salloc: $SLURM_JOB_ID is not set)")
    return choice


def place(nodes: list[str], slots: dict[str, int], replicas: int) -> list[tuple[str, int]]:
    """``(node, replicas)`` filling the nodes in order up to their slots (Slurm's block
    distribution, :func:`~popdist_lite_launcher.core.plan.fill`), nodes left empty omitted.

    Raises:
        LauncherError: more replicas than slots.
    """
    total = sum(slots[node] for node in nodes)
    if replicas > total:
        raise LauncherError(f"--num-replicas {replicas} is more than the {total} task(s) of the "
                            f"Slurm allocation")
    return fill(((node, slots[node]) for node in nodes), replicas)


def configure(opts, environ) -> None:
    """Settle the launcher and the allocation's part in the job, on poprun-lite's
    argparse namespace ``opts`` (before it becomes
    :class:`~popdist_lite_launcher.core.options.Options`) (``launcher``, ``host``, ``hostfile``,
    ``host_discovery_script``, ``num_replicas``, ``num_instances``, ``launch_agent``):

    - ``opts.launcher`` becomes ``ssh`` or ``slurm`` (:func:`choose_launcher`);
    - ``opts.allocation``: the :class:`Allocation` when inside one and its nodes are used
      (no ``-H``, ``--hostfile`` or discovery script) or the launcher is ``slurm``, else
      None;
    - ``opts.allocation_hosts``: ``[(node, tasks), ...]`` when the job runs on the
      allocation's nodes, else None; ``opts.num_replicas`` then defaults to the
      allocation's task count (``--num-instances`` when only that was given);
    - under ``slurm``, ``opts.launch_agent`` becomes :data:`SRUN_AGENT`.

    Raises:
        LauncherError: ``--launcher slurm`` outside an allocation, or a bad value in
            Slurm's environment (:func:`from_environment`).
    """
    hosts_given = bool(opts.host or opts.hostfile or opts.host_discovery_script)
    inside = job_id(environ) is not None
    opts.launcher = choose_launcher(opts.launcher, inside, hosts_given)
    opts.allocation = from_environment(environ) if inside and (not hosts_given or opts.launcher == SLURM) \
        else None
    opts.allocation_hosts = None
    opts.slurm_placement = None
    if opts.allocation is not None and not hosts_given:
        opts.allocation_hosts = list(zip(opts.allocation.nodes, opts.allocation.tasks))
        if opts.num_replicas is None:
            opts.num_replicas = opts.num_instances or opts.allocation.total_tasks
    if opts.launcher == SLURM:
        opts.launch_agent = SRUN_AGENT
