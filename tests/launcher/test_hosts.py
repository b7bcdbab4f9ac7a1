"""Host names (launcher/core/hosts.py): one grammar for -H and hostfiles, a clear error naming
the bad host, file and line, and a host that is an ssh option runs nothing: refused
before anything starts, and `--` before the host in the reachability check."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from popdist_lite_launcher import cli
from popdist_lite_launcher.core import hosts
from popdist_lite_launcher.core.api import LauncherError
from popdist_lite_launcher.launch import remote
from popdist_lite_launcher.launch.base import LAUNCH_AGENT_ENV
from popdist_lite_launcher.membership import discovery
from popdist_lite_launcher.node import cleanup
from popdist_lite_launcher.ssh.launcher import ATTEMPT_AGENT

LAUNCHER = [sys.executable, "-m", "popdist_lite_launcher"]


@pytest.mark.parametrize("text, expected", [
    ("node0", ("node0", None)),
    ("node0:4", ("node0", 4)),
    ("a-b.example.com", ("a-b.example.com", None)),
    ("10.1.2.3:2", ("10.1.2.3", 2)),
    ("[fe80::1]", ("fe80::1", None)),
    ("[::1]:3", ("::1", 3)),
    ("0node", ("0node", None)),                                   # RFC 1123 allows a leading digit
    ("x" * 63 + "." + "y" * 63, ("x" * 63 + "." + "y" * 63, None)),
    ("  padded  ", ("padded", None)),
])
def test_good_hosts(text, expected):
    assert hosts.parse_host(text) == expected


@pytest.mark.parametrize("text", [
    "-oProxyCommand=touch /tmp/x", "-x", "--", "host-", "-host", "a_b", "a b", "a..b", ".a",
    "a.", "", ":2", "h:0", "h:-1", "h:x", "h:²", "h:2:3", "[nothost]:2", "[::1", "[::1]x",
    "x" * 64, ".".join(["a" * 63] * 4) + "a", "héllo", "h\nx", "h\x00", "h;rm -rf /", "$(touch x)",
])
def test_bad_hosts(text):
    with pytest.raises(ValueError):
        hosts.parse_host(text)


def test_error_names_the_host_and_is_bounded():
    with pytest.raises(ValueError, match=r"'-oProxyCommand=touch x' is not a host name"):
        hosts.parse_host_list("good,-oProxyCommand=touch x")
    with pytest.raises(ValueError) as info:
        hosts.check_host("-" * 10_000)
    assert len(str(info.value)) < 300


def test_hostfile_errors_name_file_and_line(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# nodes\nnode0 slots=2\n\n-oProxyCommand=touch x slots=1\n")
    with pytest.raises(LauncherError, match=rf"hostfile {path}, line 4: '-oProxyCommand=touch' is not"):
        hosts.read_hostfile(str(path))
    path.write_text("node0 slots=two\n")
    with pytest.raises(LauncherError, match=r"line 1: bad slots value 'two'"):
        hosts.read_hostfile(str(path))
    path.write_bytes(b"node0\n\xff\n")
    with pytest.raises(LauncherError, match=r"line 2: not UTF-8 text"):
        hosts.read_hostfile(str(path))
    path.write_text("# nobody\n")
    with pytest.raises(LauncherError, match="names no hosts"):
        hosts.read_hostfile(str(path))
    path.write_text("a slots=2 max_slots=4\nb:3\n[::1] slots=1\n")
    assert hosts.read_hostfile(str(path)) == [("a", 2), ("b", 3), ("::1", 1)]


def test_check_command_ends_options_before_the_host():
    assert remote.check_command("ssh", "node1") == [
        "ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "--", "node1", "true"]
    assert remote.check_command("/opt/agent -q", "n") == ["/opt/agent", "-q", "--", "n", "true"]


@pytest.mark.parametrize("form", ["-H=", "--host=", "hostfile"])
def test_hostile_host_runs_nothing(tmp_path, form):
    """`-oProxyCommand=touch FILE` as a host: ssh would run the proxy command locally
    during the reachability check (--network-interface lo makes the launcher skip the
    route lookup that would fail first). It is refused before anything runs."""
    victim = tmp_path / "pwned"
    hostile = f"-oProxyCommand=touch {victim}"
    if form == "hostfile":
        (tmp_path / "hosts").write_text(f"{hostile}\n")
        where = ["--hostfile", str(tmp_path / "hosts")]
    else:
        where = [form + hostile]
    proc = subprocess.run([*LAUNCHER, "--timeout", "20", "--network-interface", "lo", *where,
                           "true"], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr
    assert "is not a host name" in proc.stderr and "-oProxyCommand=touch" in proc.stderr
    assert not victim.exists()


def test_check_hosts_passes_a_hostile_name_as_a_host_not_an_option(tmp_path):
    """The second line of defence, below the parser: with `--` ssh takes even a name
    starting with '-' for a host (it fails to resolve it) and runs no proxy command."""
    victim = tmp_path / "pwned"
    with pytest.raises(LauncherError, match="is not reachable"):
        remote.check_hosts("ssh", [f"-oProxyCommand=touch {victim}"], timeout=20)
    assert not victim.exists()


def test_parse_args_reads_hosts_with_slots(tmp_path):
    opts = cli.parse_args(["--num-replicas", "4", "-H", "a:2,b:2", "prog"])
    assert opts.hosts == ["a", "b"] and opts.slots == {"a": 2, "b": 2}


@pytest.mark.parametrize("text", [
    "[fe80::1%;id;]", "[fe80::1%$(touch${IFS}PWNED)]", "[fe80::1%a b]", "[fe80::1%-x'y]",
    "[fe80::1%é]", "[fe80::1%" + "a" * 65 + "]",
])
def test_ipv6_scope_ids_hold_no_shell_text(text):
    """``ipaddress`` takes any text after ``%`` as a scope ID; a custom launch agent may
    run the host name through a shell."""
    with pytest.raises(ValueError, match="scope ID"):
        hosts.parse_host(text)


@pytest.mark.parametrize("text", ["[fe80::1%eth0]", "[fe80::1%2]:3", "[fe80::1%br-lan.10_x]"])
def test_ipv6_scope_ids_that_are_interfaces(text):
    name, _ = hosts.parse_host(text)
    assert name.startswith("fe80::1%")


@pytest.mark.parametrize("listed", [
    ["node1", "NODE1"], ["a.example.com", "b", "A.Example.Com"], ["fe80::1", "FE80:0::1"],
    ["10.0.0.1", "10.0.0.1"],
])
def test_duplicate_hosts_whatever_their_case(listed):
    assert hosts.find_duplicate(listed) == (listed[0], listed[-1])
    with pytest.raises(SystemExit):
        cli.parse_args(["-H", ",".join(f"[{h}]" if ":" in h else h for h in listed), "prog"])


def test_distinct_hosts_are_not_duplicates():
    assert hosts.find_duplicate(["node1", "node10", "fe80::1", "fe80::1%eth0", "10.0.0.1"]) is None


def test_parse_args_names_the_duplicate(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--num-replicas", "2", "-H", "node1,Node1", "prog"])
    assert "host named more than once: node1 and Node1" in capsys.readouterr().err


def test_discovery_finds_a_duplicate_whatever_its_case():
    with pytest.raises(discovery.DiscoveryError, match="line 2: host NODE1 listed again"):
        discovery.parse(b"node1:2\nNODE1:2\n", "s")


def test_attempt_agent_splits_the_launch_agent_as_shlex_does(tmp_path):
    """The real launch agent behind launcher/ssh/attempt-agent gets the words
    ``remote.check_command`` gives it (shlex), not the string cut at its spaces."""
    show = tmp_path / "show"
    show.write_text("#!/bin/sh\nfor word in \"$@\"; do printf '[%s]\\n' \"$word\"; done\n")
    show.chmod(0o755)
    agent = f"{show} -o 'ProxyCommand=none x' \"-q\""
    proc = subprocess.run([ATTEMPT_AGENT, "--", "node1", "true"], capture_output=True,
                          text=True, timeout=30,
                          env={**os.environ, LAUNCH_AGENT_ENV: agent, cleanup.MARK_ENV: "ab" * 16})
    assert proc.returncode == 0, proc.stderr
    words = [line[1:-1] for line in proc.stdout.splitlines()]
    assert words[:5] == ["-o", "ProxyCommand=none x", "-q", "--", "node1"]
    assert remote.check_command(agent, "node1")[1:4] == ["-o", "ProxyCommand=none x", "-q"]
    bad = subprocess.run([ATTEMPT_AGENT, "node1", "true"], capture_output=True, text=True,
                         timeout=30, env={**os.environ, LAUNCH_AGENT_ENV: "'unclosed",
                                          cleanup.MARK_ENV: "ab" * 16})
    assert bad.returncode == 255 and "not a command" in bad.stderr
