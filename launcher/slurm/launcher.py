"""The Slurm backend's launch (``--launcher slurm``): :class:`SlurmLauncher`, whose mpirun
starts every process on another node through Slurm (:func:`mpirun_args`: Open MPI's
PRRTE with its ``slurm`` plm, which starts its daemons with ``srun``; MPICH's hydra with
``-launcher slurm``), and poprun-lite's own commands there (the host check, the key
files, the cleanup after an attempt) through :data:`SRUN_AGENT`, a launch agent called
like ssh that runs the command as a one-task ``srun --overlap`` step on that node. So
``scancel`` ends every process of the job on every node and Slurm's accounting lists
the steps."""

from __future__ import annotations

from pathlib import Path

from ..core.api import LauncherError
from ..launch.base import MpirunLauncher
from ..launch.command import OPENMPI
from ..node import hold_signals

#: The launch agent for nodes of the allocation: ``srun-agent [options] [--] HOST COMMAND``.
SRUN_AGENT = str(Path(__file__).with_name("srun-agent"))
#: MPICH's srun (``-launcher-exec``) when the signals are held: srun with ``hydra_pmi_proxy``
#: started through :mod:`popdist_lite_launcher.node.hold_signals`.
SRUN_HELD = str(Path(__file__).with_name("srun-held"))


def mpirun_args(implementation: str, hold: bool = False) -> list[str]:
    """mpirun's arguments for a launch through Slurm: Open MPI's ``--prtemca plm slurm``
    (its daemons started with ``srun``), MPICH's ``-launcher slurm``. With
    ``hold`` the daemons on the other nodes start with SIGTERM blocked
    (:mod:`popdist_lite_launcher.node.hold_signals`): Open MPI's ``prte_launch_agent``, MPICH's
    ``-launcher-exec`` :data:`SRUN_HELD`.

    Raises:
        LauncherError: ``hold`` under Open MPI with a space in python's path or
            this package's (``prte_launch_agent`` is split on spaces).
    """
    if implementation == OPENMPI:
        if not hold:
            return ["--prtemca", "plm", "slurm"]
        agent = hold_signals.daemon_command("prted")
        if agent is None:
            raise LauncherError("--preemption: the path of python or of poprun-lite has a space, "
                                "which Open MPI's prte_launch_agent cannot hold; use --preemption off")
        return ["--prtemca", "plm", "slurm", "--prtemca", "prte_launch_agent", agent,
                "--prtemca", "plm_slurm_args", "--job-name=prted"]  # the step's name, not python's
    if not hold:
        return ["-launcher", "slurm"]
    return ["-launcher", "slurm", "-launcher-exec", SRUN_HELD]


class SlurmLauncher(MpirunLauncher):
    """The :class:`~popdist_lite_launcher.core.api.Launcher` of ``--launcher slurm``: the
    shared mpirun launch (same probe, collector, cleanup, with :data:`SRUN_AGENT` as
    their launch agent) whose mpirun starts the ranks on other nodes through Slurm
    (:func:`mpirun_args`, no launch agent)."""

    def remote_launch(self) -> tuple[list[str], str | None]:
        return mpirun_args(self.implementation, self.holds_sigterm), None

    def local_launch(self) -> list[str]:
        """MPICH's hydra starts its proxy with srun on this node too (it finds the
        allocation itself), so with SIGTERM held it gets :func:`mpirun_args` here as well;
        and ``-localhost 127.0.0.1``, the address that proxy calls hydra back at (else
        this node's name, which need not resolve: docs/slurm.md, "Node names and
        addresses")."""
        if self.implementation == OPENMPI:
            return []
        return [*(mpirun_args(self.implementation, True) if self.holds_sigterm else []), "-localhost", "127.0.0.1"]

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        """``env`` with ``SLURM_OVERLAP=1``: the steps mpirun starts with ``srun`` (its
        daemons) share the nodes with the job's other steps, as the agent's do, so that a
        step of an earlier attempt Slurm has not ended yet (one on a lost node) does not
        hold the next attempt's step back ("Requested nodes are busy")."""
        return {**env, "SLURM_OVERLAP": "1"}
