"""The mpirun launch every backend shares: :class:`MpirunLauncher`, the
:class:`~popdist_lite_launcher.core.api.Launcher` whose subclasses
(:class:`~popdist_lite_launcher.ssh.launcher.SshLauncher`,
:class:`~popdist_lite_launcher.slurm.launcher.SlurmLauncher`) only say how mpirun
reaches the other hosts (:meth:`MpirunLauncher.remote_launch`).

Each attempt gets its own collector (address, key), attempt mark and stall inspector;
the key reaches every rank's agent in a file of its own on its host
(:func:`~popdist_lite_launcher.launch.remote.deposit_keys`); remote hosts are checked
first (the probe, :func:`~popdist_lite_launcher.launch.remote.check_hosts`) unless the
membership policy checked them already; mpirun runs the MPMD command of the rank plan
(:func:`popdist_lite_launcher.core.plan.plan_ranks`, :mod:`popdist_lite_launcher.launch.command`)
under supervision (:func:`popdist_lite_launcher.launch.mpirun.run_mpirun`); when the job
has ended, whatever is left of the attempt is killed on every host
(:mod:`popdist_lite_launcher.node.cleanup`).
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import sys

from popdist_lite import records

from . import mpirun
from .command import EXPORTED_VARS, build_command
from .address import NodeAddress, launcher_address, route_target
from .remote import HOST_CHECK_TIMEOUT_SECONDS, check_hosts, clean_hosts, deposit_keys, failure, run_on_hosts
from ..core import channel
from ..core.api import Attempt, AttemptError, AttemptResult, LauncherError, Outcome
from ..core.hosts import is_local_host
from ..core.options import Options
from ..core.plan import (TERMINAL_VARS, THREAD_VARS, TORCHRUN_VARS, RankSpec, format_topology,
                         plan_ranks, processes_of)
from ..node import cleanup, hold_signals, keys
from ..supervise.collector import ENROLMENT_SECONDS, Collector
from ..supervise.inspector import StallInspector

#: The launch agent of the job (``--launch-agent``; under Slurm the ``srun`` one), in
#: mpirun's environment when ranks run on other hosts: the ssh backend's attempt agent
#: runs it (:data:`popdist_lite_launcher.ssh.launcher.ATTEMPT_AGENT`).
LAUNCH_AGENT_ENV = "POPRUN_LITE_LAUNCH_AGENT"


class MpirunLauncher:
    """Runs attempts with ``mpirun`` (the executable, of ``implementation`` "openmpi" or
    "mpich") under the options ``opts``; ``preemption`` (a
    :class:`~popdist_lite_launcher.slurm.preempt.Preemption`, or None) answers the scheduler's
    signals during each attempt; ``node_address`` finds a host whose name does not
    resolve here (:func:`~popdist_lite_launcher.launch.address.launcher_address`). A
    backend subclasses it and says how mpirun starts the ranks on other hosts
    (:meth:`remote_launch`), and may change mpirun's first arguments on one host
    (:meth:`local_launch`) and its environment (:meth:`environment`)."""

    def __init__(self, opts: Options, mpirun: str, implementation: str, preemption=None,
                 node_address: NodeAddress | None = None):
        self.opts, self.mpirun, self.implementation = opts, mpirun, implementation
        self.preemption, self.node_address = preemption, node_address

    def run(self, attempt: Attempt) -> Outcome:
        """Run ``attempt`` (see the module docstring): its job's result, with the
        collector's counts of what it refused, and the ``resize_stop`` records it got.

        Raises:
            AttemptError: the hosts fail their check, or the collector or mpirun cannot
                be started.
        """
        opts = self.opts
        ranks = plan_ranks(opts, attempt.index, attempt.membership)
        remote = list(dict.fromkeys(spec.host for spec in ranks if not is_local_host(spec.host)))
        try:
            address = launcher_address(opts.network_interface, remote, self.node_address) if remote else "127.0.0.1"
            if remote and opts.host_check and not attempt.hosts_checked:
                check_hosts(opts.launch_agent, remote, address=address)
            master = rendezvous(ranks[0].host, address, opts.launch_agent, self.node_address)
        except (OSError, LauncherError) as exc:
            raise AttemptError(str(exc)) from None
        for spec in ranks:
            if spec.role == "replica":
                spec.env.update(master)
        mark, key = cleanup.new_mark(), channel.new_key()
        local_keys = None
        try:  # the key files first: the collector's enrolment time starts with it
            local_keys = deposit_keys(ranks, remote, key, mark, opts.launch_agent)
            try:
                collector = Collector(address, ranks=len(ranks), enrolment=ENROLMENT_SECONDS, key=key)
            except (OSError, LauncherError) as exc:
                raise AttemptError(str(exc)) from None
            with collector:
                result = self._launch(attempt, ranks, remote, address, collector, mark)
        finally:
            if local_keys is not None:
                shutil.rmtree(local_keys, ignore_errors=True)
            unreachable = self._clean_up(ranks, remote, mark)
        result.refused, result.dropped = collector.ignored()
        stops = collector.records("resize_stop")
        result.resize_stops = len(stops)
        return Outcome(result, stops, unreachable)

    def _launch(self, attempt: Attempt, ranks: list[RankSpec], remote: list[str], address: str,
                collector: Collector, mark: str) -> AttemptResult:
        """Build the attempt's mpirun command and run it (:func:`~popdist_lite_launcher.launch.mpirun.run_mpirun`) with its
        stall inspector and watcher; with ``--print-topology`` print the rank table first
        (after the Slurm allocation's line when the job runs on one)."""

        opts = self.opts
        inspector = None
        if opts.stall_warning or opts.stall_timeout:
            inspector = StallInspector(
                len([spec for spec in ranks if spec.role == "replica"]), processes_of(ranks),
                lambda rank, request: collector.send(rank, records.make("stack_request", request=request)),
                warning=opts.stall_warning, timeout=opts.stall_timeout)
            collector.subscribe("progress", inspector.on_progress)
            collector.subscribe("stack", inspector.on_stack)
        export = [name for name in (*EXPORTED_VARS, *THREAD_VARS, *TORCHRUN_VARS, *TERMINAL_VARS)
                  if name in os.environ]
        first_args, mpirun_agent = self.remote_launch() if remote else (self.local_launch(), None)
        cmd = build_command(
            self.mpirun, self.implementation, ranks, [opts.program, *opts.args],
            global_args=[*first_args, *(a for text in opts.mpi_global_args for a in shlex.split(text))],
            tag_output=opts.tag_output,
            oversubscribe=not remote or len(ranks) > (os.cpu_count() or 1),
            allow_run_as_root=hasattr(os, "geteuid") and os.geteuid() == 0,
            export=[*export, records.COLLECTOR_ENV, cleanup.MARK_ENV,
                    *([hold_signals.ENV] if self.holds_sigterm else [])],
            launch_agent=mpirun_agent,
            network=opts.network_interface if remote else None,
            launcher_address=address if remote else None)
        if opts.print_topology and (attempt.index == 0 or opts.elastic):
            if opts.allocation is not None:
                print(f"{opts.allocation.describe()}; launcher {opts.launcher}", flush=True)
            print(format_topology(ranks), flush=True)
            if self.preemption is not None and self.preemption.settings.enabled:
                print(self.preemption.settings.describe(), flush=True)
        env = self.environment(job_environment(collector, mark, opts.launch_agent if remote else None))
        if self.holds_sigterm:
            env.update({hold_signals.ENV: hold_signals.env_value(self.preemption.signals),
                        hold_signals.PYTHON_ENV: sys.executable})
            collector.subscribe("signalled", self.preemption.on_signalled)
        if opts.verbose:
            shown = [f"{name}={env[name]}" for name in (LAUNCH_AGENT_ENV, cleanup.MARK_ENV)
                     if remote and name in env]
            print(shlex.join([*shown, *cmd]), file=sys.stderr, flush=True)
        sys.stdout.flush()
        watcher = attempt.watch(collector.send).start() if attempt.watch is not None else None
        if self.preemption is not None:
            self.preemption.begin(collector.send, attempt.membership.replicas)
        try:
            return mpirun.run_mpirun(cmd, collector, timeout=attempt.timeout, inspector=inspector, env=env,
                               preemption=self.preemption)
        except OSError as exc:
            raise AttemptError(f"cannot run {self.mpirun}: {exc}") from None
        finally:
            if self.preemption is not None:
                self.preemption.end()
            if watcher is not None:
                watcher.stop()

    @property
    def holds_sigterm(self) -> bool:
        """Whether the job's processes hold SIGTERM (preemption on:
        :mod:`popdist_lite_launcher.node.hold_signals`)."""
        return self.preemption is not None and self.preemption.settings.enabled

    def remote_launch(self) -> tuple[list[str], str | None]:
        """How mpirun starts the ranks on other hosts: its first global arguments and its
        launch agent (None: mpirun's own way). The backend's to say."""
        raise NotImplementedError

    def local_launch(self) -> list[str]:
        """mpirun's first global arguments when every rank runs on this host (none here)."""
        return []

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        """mpirun's environment ``env`` (:func:`job_environment`), as this launcher needs
        it (unchanged here)."""
        return env

    def _clean_up(self, ranks: list[RankSpec], remote: list[str], mark: str) -> dict[str, str]:
        """Kill what is left of the attempt ``mark``: on this machine if it ran ranks here,
        on every remote host through the launch agent; print every host where that
        failed. Returns the remote hosts the launch agent did not reach, each with a
        sentence naming it (:attr:`Outcome.unreachable <popdist_lite_launcher.core.api.Outcome>`)."""
        problems, unreachable = {}, {}
        if any(is_local_host(spec.host) for spec in ranks):
            _, left = cleanup.kill_marked(mark)
            if left:
                problems["this host"] = f"{len(left)} process(es) still running (pids {left[:10]})"
        if remote:
            found, unreachable = clean_hosts(self.opts.launch_agent, remote, mark)
            problems.update(found)
        for host, problem in problems.items():
            print(f"poprun-lite: cleanup after the attempt failed on {host}: {problem}",
                  file=sys.stderr, flush=True)
        return unreachable


def job_environment(collector: Collector, mark: str, launch_agent: str | None = None) -> dict[str, str]:
    """mpirun's environment: the launcher's, plus the collector's address, which mpirun
    forwards to every rank by name (never on a command line), the attempt's mark
    (:mod:`popdist_lite_launcher.node.cleanup`) and, for remote hosts, the launch agent
    (:data:`LAUNCH_AGENT_ENV`). Not the job's key
    (:func:`~popdist_lite_launcher.launch.remote.deposit_keys`)."""
    env = {**os.environ, records.COLLECTOR_ENV: collector.address, cleanup.MARK_ENV: mark}
    env.pop(keys.KEY_FILE_ENV, None)
    if launch_agent is not None:
        env[LAUNCH_AGENT_ENV] = launch_agent
    return env


def reserve_port() -> int:
    """A TCP port of this host that stays free for the job's rank 0 (``MASTER_PORT``),
    without the race of "bind to port 0, close, hope": the port is bound (port 0: the
    kernel's choice), connected to and closed from the accepting side first, so that it
    stays in TIME_WAIT for a minute (Linux: 60 s). Meanwhile the kernel gives it to no
    ``bind`` to port 0 and to no outgoing connection, and a ``bind`` to it fails, except
    with ``SO_REUSEADDR``, which a server such as torch's TCPStore sets (the method of
    Yelp's ``ephemeral-port-reserve``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("0.0.0.0", 0))
        server.listen(1)
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            accepted, _ = server.accept()
            accepted.close()  # the server's side closes first: its end is the one in TIME_WAIT
            client.recv(1)    # its FIN
    return port


def rendezvous(host: str | None, address: str, launch_agent: str,
               node_address: NodeAddress | None = None) -> dict[str, str]:
    """torchrun's ``MASTER_ADDR`` and ``MASTER_PORT`` for the replicas, where rank 0 runs
    on ``host`` (None: this machine), each unless the user's environment has it (mpirun
    forwards that value by name). ``MASTER_ADDR`` is ``address`` (the launcher's on the
    job's network, ``127.0.0.1`` for a job on this machine alone) when rank 0 runs here,
    else rank 0's host's address as the launcher routes to it
    (:func:`~popdist_lite_launcher.launch.address.route_target`); ``MASTER_PORT`` a
    port :func:`reserve_port` holds on rank 0's host (on another host: run there through
    the launch agent, ``python -m popdist_lite_launcher.launch.base reserve-port``).

    Raises:
        LauncherError: rank 0's host has no address, or the port cannot be reserved there.
    """
    wanted = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if not wanted:
        return {}
    if is_local_host(host):
        found = {"MASTER_ADDR": address, "MASTER_PORT": str(reserve_port())}
    else:
        found = {"MASTER_ADDR": route_target(host, node_address), "MASTER_PORT": _remote_port(launch_agent, host)}
    return {name: found[name] for name in wanted}


def _remote_port(launch_agent: str, host: str) -> str:
    """:func:`reserve_port` run on ``host`` through the launch agent."""
    outcome = run_on_hosts(launch_agent, [host], lambda _host, _index: [sys.executable, "-m", __spec__.name,
                                                                        "reserve-port"],
                           timeout=HOST_CHECK_TIMEOUT_SECONDS)[host]
    problem = failure(outcome)
    port = outcome.stdout.strip() if problem is None else ""
    if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):  # another host's word
        raise LauncherError(f"cannot reserve MASTER_PORT on rank 0's host {host}: {problem or repr(port)}")
    return port


if __name__ == "__main__" and sys.argv[1:] == ["reserve-port"]:
    print(reserve_port(), flush=True)
