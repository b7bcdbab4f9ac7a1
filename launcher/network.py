"""The job's network: the launcher's address on it, and checking that every host is
reachable with the launch agent before mpirun starts (host names are checked earlier,
by :mod:`popdist_lite_launcher.hosts`).

``--network-interface`` takes an interface name (``eth1``) or a CIDR (``10.1.0.0/16``),
as horovodrun's option of that name and Open MPI's ``*_if_include`` parameters do.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import ipaddress
import shlex
import socket
import struct
import subprocess

from .mpirun import LauncherError

_SIOCGIFADDR = 0x8915  # Linux: the IPv4 address of an interface

#: Seconds a host gets to answer the reachability check.
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
    the first host (a UDP ``connect``, which sends nothing).

    Raises:
        LauncherError: no local address in that network / no such interface / no route.
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
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((hosts[0], 9))
            return probe.getsockname()[0]
    except OSError as exc:
        raise LauncherError(f"no route to host {hosts[0]!r}: {exc}") from exc


def check_command(launch_agent: str, host: str) -> list[str]:
    """The command that checks ``host``: ``AGENT -- HOST true`` (``--``: nothing after it
    is an option, whatever the host's name; ssh also gets ``-o BatchMode=yes`` and a
    connect timeout so that a password prompt or a dead host fails at once)."""
    agent = shlex.split(launch_agent)
    if agent and agent[0].rsplit("/", 1)[-1] == "ssh":
        agent += ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
    return [*agent, "--", host, "true"]


def check_hosts(launch_agent: str, hosts: list[str],
                timeout: float = HOST_CHECK_TIMEOUT_SECONDS) -> None:
    """Run ``true`` on every host with the launch agent, all at once.

    Raises:
        LauncherError: naming the first host (in the given order) that failed, the
            agent's exit status and the last lines of its output.
    """
    def probe(host: str) -> str | None:
        cmd = check_command(launch_agent, host)
        try:
            proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"no answer within {timeout:g} s from `{shlex.join(cmd)}`"
        except OSError as exc:
            return f"cannot run `{shlex.join(cmd)}`: {exc}"
        if proc.returncode != 0:
            said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-5:]
            return (f"`{shlex.join(cmd)}` exited with {proc.returncode}"
                    + (": " + " / ".join(said) if said else ""))
        return None

    unique = list(dict.fromkeys(hosts))
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(unique))) as pool:
        for host, problem in zip(unique, pool.map(probe, unique)):
            if problem:
                raise LauncherError(f"host {host} is not reachable with the launch agent "
                                    f"{launch_agent!r}: {problem}")
