"""The job's network: the launcher's address on it, and checking that every host is
usable before mpirun starts: reachable with the launch agent, and able to reach the
launcher over the job's network with the check's key (the probe,
:mod:`popdist_lite_launcher.node.probe`). Host names are checked earlier, by
:mod:`popdist_lite_launcher.core.hosts`.

``--network-interface`` takes an interface name (``eth1``) or a CIDR (``10.1.0.0/16``),
as horovodrun's option of that name and Open MPI's ``*_if_include`` parameters do.

poprun-lite itself needs a host's address only to find its own on the job's network
(:func:`launcher_address`, without ``--network-interface``): every other contact with a
host goes through the launch agent (ssh, or srun inside a Slurm allocation), and the
hosts reach the launcher at that address, never by name. Inside a Slurm allocation a
node whose name does not resolve (cloud and container clusters often name nodes only
in ``slurm.conf``) is reached at the address Slurm has for it, its ``NodeAddr``
(:func:`popdist_lite_launcher.slurm.scontrol.node_address`).
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import ipaddress
import os
import shlex
import socket
import struct
import subprocess
import sys
import time

from . import children
from ..slurm import scontrol
from .command import LauncherError

_SIOCGIFADDR = 0x8915  # Linux: the IPv4 address of an interface

#: Seconds a host gets to answer the reachability check (the launch agent's whole run).
HOST_CHECK_TIMEOUT_SECONDS = 20.0


def is_cidr(network: str) -> bool:
    """True for ``a.b.c.d/n`` (a network), False for an interface name."""
    try:
        ipaddress.ip_network(network, strict=False)
    except ValueError:
        return False
    return "/" in network


def interface_addresses() -> dict[str, str]:
    """The IPv4 address of every local interface that has one (Linux)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR,
                                     struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def launcher_address(network: str | None, hosts: list[str]) -> str:
    """The launcher's address the ranks on ``hosts`` reach it at: its address in
    ``network`` (a CIDR or an interface name), else the source address of its route to
    the first host (a UDP ``connect``, which sends nothing), at the host's address: its
    name resolved here, else inside a Slurm allocation the node's ``NodeAddr``
    (:func:`route_target`).

    Raises:
        LauncherError: no local address in that network / no such interface / no route
            / no address for the host.
    """
    if network:
        addresses = interface_addresses()
        if is_cidr(network):
            net = ipaddress.ip_network(network, strict=False)
            for address in addresses.values():
                if ipaddress.ip_address(address) in net:
                    return address
            raise LauncherError(f"--network-interface {network}: this machine has no address "
                                f"in it (it has {', '.join(sorted(addresses.values())) or 'none'})")
        if network in addresses:
            return addresses[network]
        raise LauncherError(f"--network-interface {network}: no such interface with an IPv4 "
                            f"address here (have: {', '.join(sorted(addresses)) or 'none'})")
    target = route_target(hosts[0])
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))
            return probe.getsockname()[0]
    except OSError as exc:
        at = "" if target == hosts[0] else f" at {target}"
        raise LauncherError(f"no route to host {hosts[0]!r}{at}: {exc}") from exc


def route_target(host: str) -> str:
    """The IPv4 address to route to to reach ``host``: ``host`` itself when it is one,
    else its name resolved here (``/etc/hosts``, DNS), else inside a Slurm allocation
    (``SLURM_JOB_ID`` set) the node's ``NodeAddr``
    (:func:`popdist_lite_launcher.slurm.scontrol.node_address`, itself resolved when a name).

    Raises:
        LauncherError: the name does not resolve, and there is no allocation or Slurm
            has no address for it (both named).
    """
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
    except OSError as exc:  # socket.gaierror: the name does not resolve here
        unresolved = f"no route to host {host!r}: {exc}"
    if scontrol.job_id(os.environ) is None:
        raise LauncherError(unresolved)
    try:
        address = scontrol.node_address(host)
    except LauncherError as exc:
        raise LauncherError(f"{unresolved}; nor has Slurm an address for it: {exc}") from None
    try:
        return socket.getaddrinfo(address, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
    except OSError as exc:
        raise LauncherError(f"{unresolved}; its NodeAddr in Slurm, {address}: {exc}") from None


def check_command(launch_agent: str, host: str, command=("true",)) -> list[str]:
    """The command that runs ``command`` on ``host``: ``AGENT -- HOST COMMAND`` (``--``:
    nothing after it is an option, whatever the host's name; ssh also gets ``-o
    BatchMode=yes`` and a connect timeout so that a password prompt or a dead host fails
    at once)."""
    agent = shlex.split(launch_agent)
    if agent and agent[0].rsplit("/", 1)[-1] == "ssh":
        agent += ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
    return [*agent, "--", host, *command]


def run_on_hosts(launch_agent: str, hosts: list[str], command, *, timeout: float,
                 input_text: str | None = None) -> dict[str, "subprocess.CompletedProcess | str"]:
    """Run ``command(host, index)`` (an argument list) on every host of ``hosts`` with the
    launch agent, all at once, ``input_text`` on its standard input: for each host its
    completed process, or why it did not complete (no answer within ``timeout`` s, cannot
    be run)."""
    def run(index_host):
        index, host = index_host
        cmd = check_command(launch_agent, host, command(host, index))
        try:  # in its own session, killed with its group by children.kill_all too
            return children.run(cmd, input_text=input_text, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"no answer within {timeout:g} s from `{shlex.join(cmd)}`"
        except OSError as exc:
            return f"cannot run `{shlex.join(cmd)}`: {exc}"

    unique = list(dict.fromkeys(hosts))
    if not unique:
        return {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(unique))) as pool:
        return dict(zip(unique, pool.map(run, enumerate(unique))))


def _agent_problem(launch_agent: str, host: str, outcome) -> str | None:
    """The sentence naming ``host`` when the launch agent did not run the command there
    (``outcome``: from :func:`run_on_hosts`), else None."""
    if isinstance(outcome, str):
        problem = outcome
    elif outcome.returncode != 0:
        said = (outcome.stderr.strip() or outcome.stdout.strip()).splitlines()[-5:]
        problem = (f"`{shlex.join(outcome.args)}` exited with {outcome.returncode}"
                   + (": " + " / ".join(said) if said else ""))
    else:
        return None
    return not_reachable(launch_agent, host, problem)


def not_reachable(launch_agent: str, host: str, problem: str) -> str:
    """The sentence naming ``host`` that the launch agent did not reach, and ``problem``."""
    return f"host {host} is not reachable with the launch agent {launch_agent!r}: {problem}"


def probe_hosts(launch_agent: str, hosts: list[str], address: str,
                timeout: float = HOST_CHECK_TIMEOUT_SECONDS) -> dict[str, str | None]:
    """Check that every host of ``hosts`` is usable, all at once: a probe started there
    with the launch agent (:mod:`popdist_lite_launcher.node.probe`) reaches a check server the
    launcher runs on ``address`` (its address on the job's network) and authenticates
    with a new key, passed on the probe's standard input.

    Returns:
        for each host None (usable) or a sentence naming it and what failed: the launch
        agent (``host H is not reachable with the launch agent ...``, its exit code and
        output), or the network (``host H cannot connect to poprun-lite at ADDRESS over
        the job network: timed out after 5 s``, in the probe's words).

    Raises:
        OSError: the check server cannot listen on ``address``.
    """
    from ..node import probe  # the host's side: its exit code and words
    from ..supervise.collector import Collector

    with Collector(address, ranks=len(hosts)) as server:
        outcomes = run_on_hosts(
            launch_agent, hosts, lambda host, index: [sys.executable, "-m", "popdist_lite_launcher.node.probe",
                                                      server.address, str(index)],
            timeout=timeout, input_text=server.key.hex() + "\n")
        deadline = time.monotonic() + 2.0  # a hello is recorded just after its welcome left
        index = {host: i for i, host in enumerate(outcomes)}
        want = {index[h] for h, o in outcomes.items() if not isinstance(o, str) and o.returncode == 0}
        while time.monotonic() < deadline and not want <= _welcomed(server):
            time.sleep(0.02)
        welcomed = _welcomed(server)
    problems: dict[str, str | None] = {}
    for host, outcome in outcomes.items():
        said = "" if isinstance(outcome, str) else outcome.stderr.strip()
        if not isinstance(outcome, str) and outcome.returncode == probe.FAILED and probe.PREFIX in said:
            line = said[said.rindex(probe.PREFIX):].splitlines()[0]
            problems[host] = f"host {host} {line.split(': ', 1)[-1]}"
        elif _agent_problem(launch_agent, host, outcome) is not None:
            problems[host] = _agent_problem(launch_agent, host, outcome)
        elif index[host] not in welcomed:
            problems[host] = (f"host {host}: the probe exited 0 but never authenticated to "
                              f"poprun-lite at {server.address}")
        else:
            problems[host] = None
    return problems


def _welcomed(server) -> set[int]:
    """The indices of the probes the check server has welcomed."""
    return {r["replica"] for r in server.records("hello") if r["role"] == "probe"}


def check_hosts(launch_agent: str, hosts: list[str], timeout: float = HOST_CHECK_TIMEOUT_SECONDS,
                *, address: str | None = None) -> None:
    """Check every host at once: with ``address`` the probe of :func:`probe_hosts`,
    without it ``AGENT -- HOST true`` (the launch agent alone).

    Raises:
        LauncherError: naming the first host (in the given order) that failed and how
            (the agent's exit status and the last lines of its output, or what the probe
            could not reach).
    """
    if address is None:
        outcomes = run_on_hosts(launch_agent, hosts, lambda host, index: ["true"], timeout=timeout)
        problems = {host: _agent_problem(launch_agent, host, o) for host, o in outcomes.items()}
    else:
        problems = probe_hosts(launch_agent, hosts, address, timeout)
    for host in dict.fromkeys(hosts):
        if problems.get(host):
            raise LauncherError(problems[host])
