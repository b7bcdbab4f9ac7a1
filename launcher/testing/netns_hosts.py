"""Test hosts on one machine: network namespaces on a bridge, each with its own hostname
and a private /tmp, reached through a launch agent that stands in for ssh.

Used by the multi-host tests (tests/multihost/) and the benchmarks that run across
hosts (scripts/_launch.py), and by anyone who wants to try poprun-lite's multi-host
paths on one machine: they need root.

Needs root, iproute2 (``ip``) and util-linux's ``unshare``. :func:`unavailable` says why
not when they are missing. Host ``NAME`` is a network namespace with a veth pair
(``eth0`` inside, on the bridge :data:`BRIDGE` outside), address
``10.250.0.(10+i)/24``, an ``ADDR NAME`` line in /etc/hosts (not for the Slurm test
cluster's nodes, :mod:`popdist_lite_launcher.testing.slurm_cluster`), and every command started
by :data:`LAUNCH_AGENT` runs there with its own UTS namespace (``hostname`` = NAME) and
mount namespace with a fresh tmpfs on /tmp. The launcher's side of the network is the
bridge address :data:`LAUNCHER_ADDRESS`; traffic never leaves these addresses.

:class:`TestHosts` builds the hosts (removing leftovers of an earlier, killed run
first, so setup is idempotent), can take a host down (:meth:`TestHosts.kill_host`) and
bring it back (:meth:`TestHosts.restore_host`), lists what runs on one
(:meth:`TestHosts.processes`), and removes everything on exit. A file lock keeps two
test runs from sharing them.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

PREFIX = "pdlh"
BRIDGE = "pdlbr0"
SUBNET = "10.250.0"
CIDR = f"{SUBNET}.0/24"
LAUNCHER_ADDRESS = f"{SUBNET}.1"
LAUNCH_AGENT = str(Path(__file__).with_name("netns-agent"))
HOSTS_FILE = "/etc/hosts"
MARK = "# popdist-lite test host"
LOCK_FILE = "/run/popdist-lite-testhosts.lock"


def unavailable() -> str | None:
    """Why test hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "multi-host tests need root (network namespaces)"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"multi-host tests need `{tool}` (iproute2, util-linux)"
    probe = f"{PREFIX}probe{os.getpid()}"  # its own: the multi-host and Slurm groups probe at once
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if made.returncode != 0:
        return f"cannot create network namespaces: {made.stderr.strip()}"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def _namespaces(prefix: str = PREFIX) -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def kill_namespace_processes(name: str) -> None:
    """SIGKILL every process in the network namespace ``name`` (``ip netns pids``)."""
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), 9)
        except (OSError, ValueError):
            pass


def remove_all(prefix: str = PREFIX, bridge: str = BRIDGE, mark: str = MARK) -> None:
    """Remove every test host, the bridge and the /etc/hosts lines (idempotent); the
    arguments name another set of hosts (:class:`TestHosts`'s)."""
    for name in _namespaces(prefix):
        kill_namespace_processes(name)
        _ip("netns", "del", name, check=False)
    _ip("link", "del", bridge, check=False)
    for name in _leftover_veths(prefix):
        _ip("link", "del", name, check=False)
    try:
        lines = Path(HOSTS_FILE).read_text().splitlines(keepends=True)
    except OSError:
        return
    kept = [line for line in lines if mark not in line]
    if kept != lines:
        # rewrite in place: /etc/hosts may be a bind mount that cannot be replaced
        with open(HOSTS_FILE, "w") as f:
            f.writelines(kept)


def _leftover_veths(prefix: str = PREFIX) -> list[str]:
    out = _ip("-o", "link", "show", check=False).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()]
    return [n for n in names if n.startswith(f"{prefix}v")]


class Locked:
    """A set-up (``setup()``, ``teardown()``: the subclass's) used as a context manager
    that holds the file lock :attr:`lock_file` from its start to its teardown, so two
    test runs wait for each other instead of colliding; a failed setup is torn down."""

    lock_file: str
    _lock = None

    def __enter__(self):
        self._lock = open(self.lock_file, "w")
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        try:
            self.setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _release(self) -> None:
        """Let the next run in (the end of the teardown)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None


class TestHosts(Locked):
    """``n`` test hosts named ``pdlh1..pdlhN`` (use as a context manager). Another set
    of hosts that can exist beside these (the Slurm test cluster's) names its own
    ``prefix`` (host names, and veths ``PREFIXv1..``), ``bridge``, ``subnet`` (the first
    three octets; the bridge is ``.1``, host ``i`` ``.(10+i)``), /etc/hosts ``mark`` and
    ``lock_file``; with ``hosts_file=False`` the hosts get no /etc/hosts lines (their
    names resolve nowhere; :attr:`addresses` reaches them)."""

    def __init__(self, n: int, *, prefix: str = PREFIX, bridge: str = BRIDGE,
                 subnet: str = SUBNET, mark: str = MARK, lock_file: str = LOCK_FILE,
                 hosts_file: bool = True):
        self.prefix, self.bridge, self.subnet, self.mark = prefix, bridge, subnet, mark
        self.lock_file, self.hosts_file = lock_file, hosts_file
        self.bridge_address = f"{subnet}.1"
        self.names = [f"{prefix}{i + 1}" for i in range(n)]
        self.addresses = {name: f"{subnet}.{11 + i}" for i, name in enumerate(self.names)}

    def setup(self) -> None:
        self._remove_all()
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for name in self.names:
            veth = self._veth(name)
            _ip("netns", "add", name)
            _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            _ip("link", "set", f"{veth}p", "netns", name)
            _ip("-n", name, "link", "set", f"{veth}p", "name", "eth0")
            _ip("-n", name, "addr", "add", f"{self.addresses[name]}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")
        if self.hosts_file:
            with open(HOSTS_FILE, "a") as f:
                for name in self.names:
                    f.write(f"{self.addresses[name]} {name} {self.mark}\n")

    def _veth(self, host: str) -> str:
        return f"{self.prefix}v{host[len(self.prefix):]}"

    def _remove_all(self) -> None:
        remove_all(self.prefix, self.bridge, self.mark)

    def teardown(self) -> None:
        try:
            self._remove_all()
        finally:
            self._release()

    def run(self, host: str, command: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run a shell command on ``host`` through the launch agent."""
        return subprocess.run([LAUNCH_AGENT, host, command], capture_output=True, text=True,
                              timeout=timeout)

    def kill_host(self, host: str, kill_processes: bool = True) -> None:
        """Take ``host`` down: its link first (nothing more gets out), then (by default)
        every process on it."""
        _ip("link", "set", self._veth(host), "down")
        if kill_processes:
            kill_namespace_processes(host)

    def restore_host(self, host: str) -> None:
        """Bring ``host`` back after :meth:`kill_host`: its link up again (its address,
        name and routes were kept)."""
        _ip("link", "set", self._veth(host), "up")

    def processes(self, host: str) -> list[int]:
        """PIDs of the processes running on ``host`` (``ip netns pids``)."""
        return [int(pid) for pid in _ip("netns", "pids", host, check=False).stdout.split()]

    def hostfile(self, path: Path, slots: int, style: str = "openmpi") -> Path:
        """Write a hostfile naming every host with ``slots`` slots (``openmpi``:
        ``host slots=N``, ``mpich``: ``host:N``)."""
        line = "{} slots={}\n" if style == "openmpi" else "{}:{}\n"
        path.write_text("".join(line.format(name, slots) for name in self.names))
        return path
