"""A node whose name does not resolve, inside a Slurm allocation: poprun-lite finds its
own address on the job's network by the node's ``NodeAddr`` (a stand-in ``scontrol
-o show node``), checked before use; outside an allocation, or when the name
resolves, Slurm is not asked. The real cluster (tests/slurm: its nodes have no
/etc/hosts lines) runs every Slurm test this way."""

from __future__ import annotations

import os
import socket

import pytest

from popdist_lite_launcher.core.api import LauncherError
from popdist_lite_launcher.launch.address import launcher_address
from popdist_lite_launcher.slurm import scontrol

UNRESOLVED = ("nr1", "nr2")
#: ``scontrol -o show node nr1`` of a node reached at 127.0.0.1; the free text after
#: NodeAddr (OS, Reason) names another address that must not be taken.
SHOWN = ("NodeName=nr1 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=0.10 "
         "AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr={addr} "
         "NodeHostName=nr1 Version=22.05.8 OS=Linux 6.1 NodeAddr=10.9.9.9 RealMemory=1 "
         "State=IDLE Partitions=test Reason=moved NodeAddr=10.9.9.8 [root@2026-01-01T00:00:00]")


@pytest.fixture
def unresolved(monkeypatch, tmp_path):
    """Names in UNRESOLVED do not resolve here; ``scontrol`` is a stand-in printing
    ``tmp_path/shown`` (and exiting with ``tmp_path/code``), its calls in
    ``tmp_path/calls``. Returns ``tmp_path``."""
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        if host in UNRESOLVED:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    (tmp_path / "shown").write_text(SHOWN.format(addr="127.0.0.1") + "\n")
    (tmp_path / "code").write_text("0")
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path}/calls\ncat {tmp_path}/shown\n'
                        f'exit $(cat {tmp_path}/code)\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_JOB_ID", "17")
    return tmp_path


def address_of(network, hosts) -> str:
    """The launcher's address as poprun-lite finds it here: with Slurm's ``NodeAddr``
    inside an allocation (``SLURM_JOB_ID`` set), without it outside one."""
    return launcher_address(network, hosts, scontrol.node_addresses(os.environ))


def calls(directory) -> list[str]:
    path = directory / "calls"
    return path.read_text().splitlines() if path.exists() else []


def test_a_node_that_does_not_resolve_is_reached_at_its_node_addr(unresolved):
    assert address_of(None, ["nr1", "nr2"]) == "127.0.0.1"
    assert calls(unresolved) == ["-o show node nr1"]


def test_node_addr_may_be_a_name_that_resolves(unresolved):
    (unresolved / "shown").write_text(SHOWN.format(addr="localhost") + "\n")
    assert address_of(None, ["nr1"]) == "127.0.0.1"


def test_outside_an_allocation_slurm_is_not_asked(unresolved, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID")
    with pytest.raises(LauncherError, match=r"^no route to host 'nr1': \[Errno -3\] Temporary failure"):
        address_of(None, ["nr1"])
    assert calls(unresolved) == []


def test_a_name_that_resolves_is_not_looked_up_in_slurm(unresolved):
    assert address_of(None, ["localhost"]) == "127.0.0.1"
    assert calls(unresolved) == []


@pytest.mark.parametrize("shown, code, match", [
    (SHOWN.format(addr="-oProxyCommand=touch${IFS}x"), 0, r"NodeAddr '-oProxyCommand=.*' is not a host name"),
    (SHOWN.format(addr="10.0.0.1;reboot"), 0, "is not a host name"),
    (SHOWN.format(addr=""), 0, r"NodeAddr '' is not a host name"),
    (SHOWN.replace("NodeName=nr1 ", "NodeName=nr10 ").format(addr="127.0.0.1"), 0, "printed no NodeAddr for nr1"),
    ("NodeName=nr1 Arch=x86_64 State=IDLE", 0, "printed no NodeAddr for nr1"),
    ("Node nr1 not found", 1, "exited with 1: Node nr1 not found"),
])
def test_a_bad_answer_from_slurm_is_refused(unresolved, shown, code, match):
    (unresolved / "shown").write_text(shown + "\n")
    (unresolved / "code").write_text(str(code))
    with pytest.raises(LauncherError, match=match) as exc:
        address_of(None, ["nr1"])
    text = str(exc.value)
    assert text.startswith("no route to host 'nr1': [Errno -3] Temporary failure in name resolution; "
                           "nor has Slurm an address for it: `scontrol"), text
    assert "\n" not in text


def test_scontrol_output_is_bounded(unresolved):
    (unresolved / "shown").write_text("NodeName=nr1 " + "x" * (2 * scontrol.MAX_NODE_OUTPUT_BYTES) + "\n")
    with pytest.raises(LauncherError, match=rf"printed more than {scontrol.MAX_NODE_OUTPUT_BYTES} bytes"):
        scontrol.node_address("nr1")


def test_a_hostile_node_name_never_reaches_scontrol(unresolved):
    with pytest.raises(LauncherError, match="not a host name"):
        scontrol.node_address("-oProxyCommand=x")
    assert calls(unresolved) == []


def test_network_interface_needs_no_address_of_a_node(unresolved):
    """--network-interface names the launcher's side itself: no node is looked up."""
    assert address_of("lo", ["nr1"]) == "127.0.0.1"
    assert address_of("127.0.0.0/8", ["nr1"]) == "127.0.0.1"
    assert calls(unresolved) == []
