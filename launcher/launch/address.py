"""The launcher's address on the job's network: the one address poprun-lite itself needs
(every other contact with a host goes through the launch agent, and the hosts reach the
launcher at that address, never by name).

``--network-interface`` takes an interface name (``eth1``) or a CIDR (``10.1.0.0/16``),
as horovodrun's option of that name and Open MPI's ``*_if_include`` parameters do;
without it the address is the source of the launcher's route to the first host
(:func:`launcher_address`). Where a host's name does not resolve here (cloud and
container clusters often name nodes only in ``slurm.conf``), a scheduler may know its
address: a backend passes that lookup as ``node_address`` (:data:`NodeAddress`; Slurm's
``NodeAddr``, :func:`popdist_lite_launcher.slurm.scontrol.node_addresses`).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from typing import Callable

from ..core.api import LauncherError

_SIOCGIFADDR = 0x8915  # Linux: the IPv4 address of an interface

#: ``node_address(host)``: the IPv4 address of a host whose name does not resolve here,
#: from a scheduler, or LauncherError saying why it has none.
NodeAddress = Callable[[str], str]


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


def launcher_address(network: str | None, hosts: list[str], node_address: NodeAddress | None = None) -> str:
    """The launcher's address the ranks on ``hosts`` reach it at: its address in
    ``network`` (a CIDR or an interface name), else the source address of its route to
    the first host (a UDP ``connect``, which sends nothing), at the host's address
    (:func:`route_target`, ``node_address`` for a name that does not resolve here).

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
    target = route_target(hosts[0], node_address)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))
            return probe.getsockname()[0]
    except OSError as exc:
        at = "" if target == hosts[0] else f" at {target}"
        raise LauncherError(f"no route to host {hosts[0]!r}{at}: {exc}") from exc


def resolve(host: str) -> str:
    """The IPv4 address of ``host`` (an address itself, or a name resolved here:
    ``/etc/hosts``, DNS).

    Raises:
        OSError: the name does not resolve (``socket.gaierror``).
    """
    return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]


def route_target(host: str, node_address: NodeAddress | None = None) -> str:
    """The IPv4 address to route to to reach ``host``: ``host`` itself when it is one,
    else its name resolved here (:func:`resolve`), else ``node_address(host)`` when
    given: the scheduler's address for it (inside a Slurm allocation the node's
    ``NodeAddr``, :func:`popdist_lite_launcher.slurm.scontrol.node_addresses`).

    Raises:
        LauncherError: the name does not resolve, and there is no ``node_address`` or it
            has none (both named).
    """
    try:
        return resolve(host)
    except OSError as exc:  # socket.gaierror: the name does not resolve here
        unresolved = f"no route to host {host!r}: {exc}"
    if node_address is None:
        raise LauncherError(unresolved)
    try:
        return node_address(host)
    except LauncherError as exc:
        raise LauncherError(f"{unresolved}; {exc}") from None
