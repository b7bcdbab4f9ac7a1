"""A throw-away Slurm cluster on one machine, for the Slurm tests (tests/slurm/) and for
trying poprun-lite's Slurm paths by hand (docs/slurm.md): it needs root and Debian's
``slurm-wlm`` and ``munge`` packages (``libpmix-dev`` too for ``srun --mpi=pmix``).

:class:`TestCluster` makes ``n`` nodes ``pdls1..pdlsN``, test hosts of
:class:`popdist_lite_launcher.testing.netns_hosts.TestHosts` on their own bridge :data:`BRIDGE` and
subnet ``10.251.0.0/24`` (so that they can exist beside the multi-host tests' hosts),
each running a ``slurmd`` in its network namespace with its own hostname (UTS
namespace) and a private tmpfs on ``/tmp`` (mount namespace), and one more test host,
the login node ``pdls(N+1)`` (:attr:`TestCluster.login`), where no slurmd runs: what is
started there (:meth:`TestCluster.on_node`, e.g. ``salloc``) is removed with the hosts. ``slurmctld`` and a
``munged`` run on this machine, on the bridge's address. The nodes' names resolve
nowhere (no /etc/hosts lines, as on cloud and container clusters that name their nodes
only in ``slurm.conf``): Slurm and whatever runs on the cluster reach a node by its
``NodeAddr``. Everything lives in
:data:`DIRECTORY`: the munge key and socket, ``slurm.conf`` (clients find it through
``SLURM_CONF``, :meth:`TestCluster.env`), state, spool, pid and log files, the
accounting's MariaDB and ``slurmdbd.conf`` (where Debian's ``slurmdbd`` and
``mariadb-server`` are installed: :func:`accounting_unavailable`), and
``work/``, a directory every node sees (for job scripts and their output: /tmp is not
shared). Nothing of the machine's own Slurm or munge configuration is read or changed.

The nodes are entered with ``nsenter --net=/run/netns/NODE unshare --uts --mount``, not
``ip netns exec``, which remounts /sys so that slurmd finds no /sys/fs/cgroup and dies.
Setup removes the leftovers of an earlier, killed run first; :meth:`TestCluster.teardown`
(also on a failed setup, and on leaving the ``with`` block) cancels every job, stops
the daemons by their pid files, kills what is left on each node and removes the nodes,
the bridge and :data:`DIRECTORY`.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from . import netns_hosts
from ..node import procfs

PREFIX = "pdls"
BRIDGE = "pdlsbr0"
SUBNET = "10.251.0"
MARK = "# popdist-lite slurm test node"
LOCK_FILE = "/run/popdist-lite-slurm.lock"
#: Where the cluster keeps everything (removed on teardown).
DIRECTORY = Path("/run/popdist-lite-slurm")
#: Ports of this cluster's daemons (not Slurm's defaults, 6817/6818).
CONTROLLER_PORT = 6917
NODE_PORT = 6918
PARTITION = "test"
#: Ports of the accounting, where it can run (:func:`accounting_unavailable`): MariaDB,
#: on 127.0.0.1 only, and slurmdbd, on the bridge's address.
DB_PORT = 6919
DBD_PORT = 6920
#: Seconds the nodes get to come up idle.
READY_TIMEOUT_SECONDS = 60.0
_TOOLS = ("slurmctld", "slurmd", "munged", "munge", "sinfo", "sbatch", "srun", "scancel",
          "scontrol", "squeue", "nsenter", "unshare", "ip")
_ACCOUNTING_TOOLS = ("slurmdbd", "mariadbd", "mariadb-install-db", "mariadb", "sacctmgr", "sacct")


def unavailable() -> str | None:
    """Why a test cluster cannot be made here (None: it can)."""
    if os.geteuid() != 0:
        return "Slurm tests need root (network namespaces, slurmd)"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None
               and not Path("/usr/sbin", tool).exists()]
    if missing:
        return (f"Slurm tests need {', '.join(missing)} (Debian: apt-get install slurm-wlm "
                f"munge; scripts/test installs them as root)")
    return netns_hosts.unavailable()


def accounting_unavailable() -> str | None:
    """Why the cluster runs without accounting here (None: with it): ``slurmdbd`` and
    MariaDB (Debian's ``slurmdbd`` and ``mariadb-server``)."""
    missing = [tool for tool in _ACCOUNTING_TOOLS if shutil.which(tool) is None
               and not Path("/usr/sbin", tool).exists()]
    if missing:
        return (f"Slurm accounting needs {', '.join(missing)} (Debian: apt-get install slurmdbd "
                f"mariadb-server; scripts/test installs them as root)")
    return None


def _which(tool: str) -> str:
    return shutil.which(tool) or str(Path("/usr/sbin", tool))


def _dbd_config(hostname: str, password: str) -> str:
    """slurmdbd.conf: slurmdbd on the bridge's address, its database the private
    MariaDB's on 127.0.0.1."""
    d = DIRECTORY
    return "\n".join([
        "AuthType=auth/munge",
        f"AuthInfo=socket={d / 'munge.socket'}",
        f"DbdHost={hostname}",
        f"DbdAddr={SUBNET}.1",
        f"DbdPort={DBD_PORT}",
        "SlurmUser=root",
        f"PidFile={d / 'slurmdbd.pid'}",
        f"LogFile={d / 'slurmdbd.log'}",
        "StorageType=accounting_storage/mysql",
        "StorageHost=127.0.0.1",
        f"StoragePort={DB_PORT}",
        "StorageUser=slurm",
        f"StoragePass={password}",
        "StorageLoc=slurm_acct_db",
    ]) + "\n"


def _config(hostname: str, nodes: dict[str, str], cpus: int, accounting: bool = False) -> str:
    d = DIRECTORY
    lines = [
        "ClusterName=popdistlite",
        f"SlurmctldHost={hostname}({SUBNET}.1)",
        f"SlurmctldPort={CONTROLLER_PORT}",
        f"SlurmdPort={NODE_PORT}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={d / 'munge.socket'}",
        f"StateSaveLocation={d / 'state'}",
        f"SlurmdSpoolDir={d / 'spool'}/%n",
        f"SlurmctldPidFile={d / 'slurmctld.pid'}",
        f"SlurmdPidFile={d / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={d / 'slurmctld.log'}",
        f"SlurmdLogFile={d / 'slurmd-%n.log'}",
        "SlurmdParameters=config_overrides",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        # (AccountingStoragePass: the munge socket for connections to slurmdbd)
        *(["AccountingStorageType=accounting_storage/slurmdbd", f"AccountingStorageHost={SUBNET}.1",
           f"AccountingStoragePort={DBD_PORT}", f"AccountingStoragePass={d / 'munge.socket'}"]
          if accounting else
          ["AccountingStorageType=accounting_storage/none"]),
        "JobCompType=jobcomp/none",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "ReturnToService=2",
        "SlurmdTimeout=30",
        "MessageTimeout=10",
        "MinJobAge=5",
        "KillWait=5",
        "InactiveLimit=0",
        "SchedulerParameters=sched_interval=2",
    ]
    for name, address in nodes.items():
        lines.append(f"NodeName={name} NodeAddr={address} CPUs={cpus} State=UNKNOWN")
    lines.append(f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP "
                 f"OverSubscribe=NO")
    return "\n".join(lines) + "\n"


#: Runs a node's slurmd in its own UTS and mount namespace: paths under /tmp that must
#: stay visible (a checkout or venv under /tmp, as in a CI clone) are bind-mounted
#: aside before a tmpfs covers /tmp and back in place after.
_NODE_ENTRY = r"""set -e
host="$1"; shift
kept=()
for path in $KEEP_UNDER_TMP; do
    i=${#kept[@]}; mkdir -p "/run/popdist-lite-slurm/keep-$host-$i"
    mount --bind "$path" "/run/popdist-lite-slurm/keep-$host-$i"; kept+=("$path")
done
mount -t tmpfs tmpfs /tmp
for i in "${!kept[@]}"; do
    mkdir -p "${kept[$i]}" && mount --bind "/run/popdist-lite-slurm/keep-$host-$i" "${kept[$i]}"
done
hostname "$host"
exec "$@"
"""


class TestCluster(netns_hosts.Locked):
    """A Slurm cluster of ``n`` nodes with ``cpus`` CPUs each (declared; more than the
    machine has is allowed) and one partition, :data:`PARTITION` (use as a context
    manager: ``with TestCluster(2) as cluster: cluster.run(["sbatch", ...])``)."""

    lock_file = LOCK_FILE

    def __init__(self, n: int = 2, cpus: int = 2):
        self.hosts = netns_hosts.TestHosts(n + 1, prefix=PREFIX, bridge=BRIDGE, subnet=SUBNET,
                                           mark=MARK, lock_file=LOCK_FILE, hosts_file=False)
        self.nodes = list(self.hosts.names[:n])
        self.login = self.hosts.names[n]
        self.cpus = cpus
        #: Whether the cluster keeps accounts (slurmdbd; ``sacct`` works): where
        #: :func:`accounting_unavailable` says nothing.
        self.accounting = accounting_unavailable() is None
        self.work = DIRECTORY / "work"
        self.conf = DIRECTORY / "slurm.conf"

    # -- life cycle ------------------------------------------------------------------
    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default ``os.environ``) with ``SLURM_CONF`` naming this cluster and
        no variable of an enclosing Slurm job."""
        env = {k: v for k, v in (os.environ if base is None else base).items()
               if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def setup(self) -> None:
        """Make the nodes and start munged, slurmctld and the slurmds; return when every
        node is idle.

        Raises:
            RuntimeError: a daemon did not start, or the nodes were not idle within
                :data:`READY_TIMEOUT_SECONDS` (naming their state and the log's end).
        """
        self._stop_daemons()
        shutil.rmtree(DIRECTORY, ignore_errors=True)
        self.hosts.setup()
        for sub in ("state", "spool", "work"):
            (DIRECTORY / sub).mkdir(parents=True, exist_ok=True)
        DIRECTORY.chmod(0o755)
        self.work.chmod(0o1777)
        key = DIRECTORY / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        self._daemon([_which("munged"), "--force", f"--key-file={key}",
                      f"--socket={DIRECTORY / 'munge.socket'}",
                      f"--pid-file={DIRECTORY / 'munged.pid'}",
                      f"--log-file={DIRECTORY / 'munged.log'}",
                      f"--seed-file={DIRECTORY / 'munged.seed'}"], "munged")
        self._wait(lambda: (DIRECTORY / "munge.socket").exists(), "munged's socket",
                   DIRECTORY / "munged.log")
        nodes = {node: self.hosts.addresses[node] for node in self.nodes}
        self.conf.write_text(_config(socket.gethostname(), nodes, self.cpus, self.accounting))
        if self.accounting:
            self._start_accounting()
        self._daemon([_which("slurmctld")], "slurmctld")
        for node in self.nodes:
            self._start_slurmd(node)
        self._wait(self._idle, "every node idle", DIRECTORY / "slurmctld.log")

    def _start_accounting(self) -> None:
        """A private MariaDB (data, socket, pid and log in :data:`DIRECTORY`, TCP on
        127.0.0.1 only), its ``slurm_acct_db`` and user, slurmdbd, and this cluster
        registered with it (``sacctmgr add cluster``)."""
        d = DIRECTORY
        done = subprocess.run([_which("mariadb-install-db"), "--no-defaults", f"--datadir={d / 'db'}",
                               "--user=root", "--auth-root-authentication-method=socket", "--skip-test-db"],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"test cluster: mariadb-install-db failed: {(done.stderr or done.stdout)[-800:]}")
        socket_path = d / "mariadb.sock"
        subprocess.run(["setsid", "-f", _which("mariadbd"), "--no-defaults", f"--datadir={d / 'db'}",
                        f"--socket={socket_path}", f"--pid-file={d / 'mariadb.pid'}", "--bind-address=127.0.0.1",
                        f"--port={DB_PORT}", "--skip-name-resolve", "--user=root", f"--log-error={d / 'mariadb.log'}",
                        "--skip-log-bin", "--innodb-buffer-pool-size=32M"],
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
        self._wait(socket_path.exists, "MariaDB's socket", d / "mariadb.log")
        password = secrets.token_hex(16)
        sql = (f"CREATE DATABASE slurm_acct_db; CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}'; "
               f"GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';")
        done = subprocess.run([_which("mariadb"), "--no-defaults", f"--socket={socket_path}", "-u", "root",
                               "-e", sql], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"test cluster: MariaDB's accounting user: {(done.stderr or done.stdout)[-800:]}")
        dbd_conf = d / "slurmdbd.conf"  # beside slurm.conf, where slurmdbd looks (SLURM_CONF)
        dbd_conf.touch(mode=0o600)
        dbd_conf.write_text(_dbd_config(socket.gethostname(), password))
        self._daemon([_which("slurmdbd")], "slurmdbd")
        self._wait(lambda: self.run([_which("sacctmgr"), "-i", "add", "cluster", "popdistlite"],
                                    timeout=30).returncode == 0 or self._registered(),
                   "the cluster registered with slurmdbd", d / "slurmdbd.log")

    def _registered(self) -> bool:
        shown = self.run([_which("sacctmgr"), "-n", "-P", "show", "cluster", "format=cluster"], timeout=30)
        return "popdistlite" in shown.stdout.split()

    def _start_slurmd(self, node: str) -> None:
        self._daemon(["nsenter", f"--net=/run/netns/{node}", "unshare", "--uts", "--mount",
                      "--propagation", "private", "/bin/bash", "-c", _NODE_ENTRY, "node",
                      node, _which("slurmd"), "-N", node],
                     f"slurmd on {node}", extra_env={"KEEP_UNDER_TMP": " ".join(self._kept_under_tmp())})

    def kill_node(self, node: str) -> None:
        """Lose ``node``: SIGKILL every process on it, its slurmd included (its link stays
        up, so a connection to it is refused; slurmctld marks it down after
        ``SlurmdTimeout``). :meth:`restart_node` brings it back."""
        netns_hosts.kill_namespace_processes(node)

    def restart_node(self, node: str) -> None:
        """Start ``node``'s slurmd again (after :meth:`kill_node`); return when every node
        is idle (``ReturnToService=2`` returns a node marked down when it registers).

        Raises:
            RuntimeError: as :meth:`setup`.
        """
        netns_hosts.kill_namespace_processes(node)
        self._start_slurmd(node)
        self._wait(self._idle, "every node idle", DIRECTORY / "slurmctld.log")

    def teardown(self) -> None:
        """Cancel every job, stop the daemons, remove the nodes and :data:`DIRECTORY`
        (idempotent; whatever fails, the rest is still done)."""
        try:
            if self.conf.exists() and (DIRECTORY / "slurmctld.pid").exists():
                subprocess.run([_which("scancel"), "--full", "--partition", PARTITION],
                               env=self.env(), capture_output=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            pass
        finally:
            try:
                self._stop_daemons()
            finally:
                try:
                    self.hosts.teardown()  # kills what is left in each namespace
                finally:
                    shutil.rmtree(DIRECTORY, ignore_errors=True)
                    self._release()

    # -- use -------------------------------------------------------------------------
    def run(self, command: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """Run a Slurm client command (``sbatch``, ``squeue``, ...) on this machine against
        the cluster (output captured as text)."""
        kwargs.setdefault("env", self.env())
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)

    def on_node(self, node: str, command: list[str], timeout: float = 60,
                **kwargs) -> subprocess.CompletedProcess:
        """Run ``command`` in the network namespace of ``node`` (a node or :attr:`login`),
        with its hostname and a private /tmp, as on that host."""
        kwargs.setdefault("env", self.env())
        kwargs["env"] = {**kwargs["env"], "KEEP_UNDER_TMP": " ".join(self._kept_under_tmp())}
        return subprocess.run(["nsenter", f"--net=/run/netns/{node}", "unshare", "--uts", "--mount",
                               "--propagation", "private", "/bin/bash", "-c", _NODE_ENTRY, "node",
                               node, *command], capture_output=True, text=True, timeout=timeout,
                              **kwargs)

    def processes(self, node: str) -> list[int]:
        """PIDs of the processes in ``node``'s network namespace (slurmd included)."""
        return self.hosts.processes(node)

    def job_processes(self, node: str) -> list[int]:
        """PIDs on ``node`` other than its slurmd."""
        daemon = _read_pid(DIRECTORY / f"slurmd-{node}.pid")
        return [pid for pid in self.processes(node) if pid != daemon]

    # -- helpers ---------------------------------------------------------------------
    def _kept_under_tmp(self) -> list[str]:
        """The project checkout and this interpreter's environment, when under /tmp."""
        root = Path(__file__).resolve().parents[2]
        paths = {str(root), sys.prefix}
        mpich = os.environ.get("POPDIST_LITE_MPICH_PYTHON")
        if mpich:
            paths.add(str(Path(mpich).resolve().parents[1]))
        return sorted(p for p in paths if p.startswith("/tmp/") and " " not in p)

    def _daemon(self, command: list[str], what: str, extra_env: dict | None = None) -> None:
        proc = subprocess.run(command, env={**self.env(), **(extra_env or {})},
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"test cluster: {what} did not start (exit code "
                               f"{proc.returncode}): {(proc.stderr or proc.stdout).strip()[-800:]}")

    def _idle(self) -> bool:
        proc = self.run([_which("sinfo"), "-h", "-N", "-o", "%N %T"], timeout=20)
        states = dict(line.split() for line in proc.stdout.splitlines() if len(line.split()) == 2)
        self._last_states = states
        return proc.returncode == 0 and all(states.get(node) == "idle" for node in self.nodes)

    def _wait(self, ready, what: str, log: Path) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while not ready():
            if time.monotonic() > deadline:
                try:
                    tail = log.read_text(errors="replace").splitlines()[-15:]
                except OSError:
                    tail = []
                raise RuntimeError(f"test cluster: no {what} within {READY_TIMEOUT_SECONDS:g} s "
                                   f"(states {getattr(self, '_last_states', {})}); {log}:\n"
                                   + "\n".join(tail))
            time.sleep(0.2)

    def _stop_daemons(self) -> None:
        """SIGTERM the daemons named by pid files in :data:`DIRECTORY`, SIGKILL them after
        2 s (a slurmd that has run jobs may take longer to stop; its processes are killed
        with its node)."""
        pids = [pid for f in sorted(DIRECTORY.glob("*.pid")) if (pid := _read_pid(f))]
        pids = [pid for pid in pids if _is_daemon(pid)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
                time.sleep(0.05)


def _read_pid(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdecimal() and int(text) > 1 else None


def _is_daemon(pid: int) -> bool:
    """Whether ``pid`` runs one of the cluster's daemons (a stale pid file may name
    someone else's process by now)."""
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return False
    return name in ("slurmctld", "slurmd", "munged", "slurmdbd", "mariadbd")


def _alive(pid: int) -> bool:
    return procfs.state(pid) not in (None, "Z")


def main(argv: list[str] | None = None) -> int:
    """``python -m popdist_lite_launcher.testing.slurm_cluster [NODES]``: start a cluster of
    NODES nodes (default 2), print how to use it, keep it until SIGINT or SIGTERM, then
    remove it. Exit code 0, or 1 when it cannot be made here (the reason printed)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or (args and not (args[0].isdecimal() and 1 <= int(args[0]) <= 8)):
        print("usage: python -m popdist_lite_launcher.testing.slurm_cluster [NODES (1-8, default 2)]",
              file=sys.stderr)
        return 2
    reason = unavailable()
    if reason:
        print(f"slurm_cluster: {reason}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # as Ctrl-C: the teardown runs
    with TestCluster(int(args[0]) if args else 2) as cluster:
        print(f"Slurm test cluster up: nodes {', '.join(cluster.nodes)}, partition {PARTITION}\n"
              f"  export SLURM_CONF={cluster.conf}\n"
              f"  job files: {cluster.work} (every node sees it; /tmp is private to each)\n"
              f"  a shell on a node: nsenter --net=/run/netns/{cluster.nodes[0]} bash\n"
              f"  the login node (no slurmd): {cluster.login}\n"
              f"Ctrl-C (or SIGTERM) stops it and removes everything.", flush=True)
        try:
            while True:
                signal.pause()
        except KeyboardInterrupt:
            pass
    print("Slurm test cluster removed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
