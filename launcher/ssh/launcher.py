"""The ssh backend's launch: :class:`SshLauncher`, mpirun over the launch agent
(``--launch-agent``, default ssh), the launcher of every job not launched through Slurm.

mpirun starts its daemons on other hosts with :data:`ATTEMPT_AGENT`, a wrapper around
the real launch agent (``--launch-agent``, in mpirun's environment as
:data:`~popdist_lite_launcher.launch.base.LAUNCH_AGENT_ENV`) that exports the attempt's
mark (:data:`~popdist_lite_launcher.node.cleanup.MARK_ENV`) before the command it runs on
a host, so the MPI daemon started there (Open MPI's prted, MPICH's hydra_pmi_proxy) and
everything it starts carry the mark, and the cleanup after the attempt finds them
(:mod:`popdist_lite_launcher.node.cleanup`).
"""

from __future__ import annotations

from pathlib import Path

from ..launch.base import MpirunLauncher

#: The launch agent poprun-lite gives mpirun for remote hosts (a bash script beside this
#: module): ``attempt-agent [options] [--] HOST COMMAND``, like ssh.
ATTEMPT_AGENT = str(Path(__file__).with_name("attempt-agent"))


class SshLauncher(MpirunLauncher):
    """The :class:`~popdist_lite_launcher.core.api.Launcher` of ``--launcher ssh``: the
    shared mpirun launch, its daemons on other hosts started by :data:`ATTEMPT_AGENT`."""

    def remote_launch(self) -> tuple[list[str], str | None]:
        """No first arguments; the launch agent :data:`ATTEMPT_AGENT`, which runs
        ``--launch-agent`` and marks the attempt's processes."""
        return [], ATTEMPT_AGENT
