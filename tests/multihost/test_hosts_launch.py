"""poprun-lite across two test hosts (network namespaces, own hostnames, private /tmp):
topology, feeders, host checks, hostfiles, and failure reports without a shared
filesystem. Every launch runs under a subprocess timeout and the launcher's --timeout."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from popdist_lite_launcher.testing import netns_hosts
from helpers import JOB_SECONDS, timeout_for
from keyhunt import HUNT, check_nothing_found, hunts, key_dirs, recording_launcher
from hostlaunch import MPICH_PYTHON, mpich_env, poprun, poprun_command, prog, ROOT

pytestmark = timeout_for(1)

needs_mpich = pytest.mark.skipif(not MPICH_PYTHON, reason="no MPICH environment (scripts/test prepares one)")


def tagged(stdout: str, tag: str) -> list[dict]:
    """The JSON objects printed after ``tag`` (hydra may interleave ranks' lines)."""
    return [json.loads(m) for m in re.findall(tag + r" (\{[^{}]*\})", stdout)]


# ---------------------------------------------------------------- topology

@pytest.mark.parametrize("mpich", [False, pytest.param(True, marks=needs_mpich)],
                         ids=["openmpi", "mpich"])
def test_topology_across_hosts(hosts, mpich):
    proc = poprun(hosts, "--num-replicas", "4", "--print-topology", "-v",
                  *prog("topology", mpich=mpich), mpich=mpich)
    assert proc.returncode == 0, proc.stderr
    table = [line.split() for line in proc.stdout.splitlines()[:5]]
    assert table[0] == ["replica", "instance", "rank", "host", "role"]
    assert [row[3] for row in table[1:]] == ["pdlh1", "pdlh1", "pdlh2", "pdlh2"]
    infos = sorted(tagged(proc.stdout, "TOPO"), key=lambda d: d["replica"])
    assert [(d["replica"], d["host"], d["local_instance_index"]) for d in infos] == [
        (0, "pdlh1", 0), (1, "pdlh1", 1), (2, "pdlh2", 0), (3, "pdlh2", 1)]
    assert all(d["num_replicas"] == 4 and d["role"] == "replica" for d in infos)
    command = proc.stderr.splitlines()[0]
    assert netns_hosts.LAUNCH_AGENT in command
    # torchrun's variables: rank 0's host's address and a port reserved there, on every replica
    assert re.findall(r"[ =]RANK[= ](\d+)", command) == ["0", "1", "2", "3"]
    assert re.findall(r"MASTER_ADDR[= ](\S+)", command) == [socket.gethostbyname("pdlh1")] * 4
    assert len(set(re.findall(r"MASTER_PORT[= ](\d+)", command))) == 1
    if mpich:  # hydra: -localhost (the launcher's address on the test network), no CIDR
        assert f"-localhost {netns_hosts.LAUNCHER_ADDRESS}" in command
    else:
        assert f"oob_tcp_if_include {netns_hosts.CIDR}" in command
        assert f"btl_tcp_if_include {netns_hosts.CIDR}" in command


def test_feeders_run_on_their_replicas_host(hosts):
    proc = poprun(hosts, "--num-replicas", "2", "--feeders-per-replica", "1", "--print-topology",
                  *prog("feed"))
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()[1:5]]
    assert [(r[0], r[3], " ".join(r[4:])) for r in rows] == [
        ("0", "pdlh1", "replica"), ("1", "pdlh2", "replica"),
        ("0", "pdlh1", "feeder 0 of replica 0"), ("1", "pdlh2", "feeder 0 of replica 1")]
    for info in tagged(proc.stdout, "FEED"):
        # every batch was made on the replica's own host, by its one feeder (shard r of 2)
        assert info["got"] == [[info["host"], [info["replica"], 2, step]] for step in range(3)]
    assert len(tagged(proc.stdout, "FEED")) == 2


@pytest.mark.parametrize("style", ["openmpi", "mpich"])
def test_hostfile_with_slots(hosts, tmp_path, style):
    hostfile = hosts.hostfile(tmp_path / "hosts", slots=2, style=style)
    cmd = poprun_command(hosts, "--num-replicas", "4", *prog("topology"))
    cmd[cmd.index("-H"):cmd.index("-H") + 2] = ["--hostfile", str(hostfile)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90, cwd=ROOT,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert sorted((d["replica"], d["host"]) for d in tagged(proc.stdout, "TOPO")) == [
        (0, "pdlh1"), (1, "pdlh1"), (2, "pdlh2"), (3, "pdlh2")]
    # 3 replicas per host do not fit in 2 slots: refused before anything starts
    cmd[cmd.index("--num-replicas") + 1] = "6"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert proc.returncode == 2 and "host pdlh1 has 2 slot(s) but would run 3 ranks" in proc.stderr


def test_unreachable_host_fails_fast_naming_it(hosts):
    cmd = poprun_command(hosts, "--num-replicas", "2", *prog("topology"))
    cmd[cmd.index("-H") + 1] = "pdlh1,pdlh9"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_SECONDS, cwd=ROOT)
    assert proc.returncode == 2  # refused before the job: nothing ran
    assert "poprun-lite: error: host pdlh9 is not reachable with the launch agent" in proc.stderr
    assert "no test host named pdlh9" in proc.stderr  # the agent's own error


# ---------------------------------------------------------------- failures

def report_of(proc) -> str:
    return proc.stderr[proc.stderr.index("poprun-lite: job failed"):]


@pytest.mark.parametrize("mpich", [False, pytest.param(True, marks=needs_mpich)],
                         ids=["openmpi", "mpich"])
def test_exception_on_remote_host(hosts, mpich):
    proc = poprun(hosts, "--num-replicas", "4", *prog("raise", "3", mpich=mpich), mpich=mpich)
    assert proc.returncode == 1, proc.stderr  # the others outlive --timeout: the failure ended them
    report = report_of(proc)
    assert re.search(r"root cause: replica 3 \(rank 3, host pdlh2, pid \d+\): exit code 1\n"
                     r"  Traceback \(most recent call last\):", report), report
    assert report.count("KeyError: 'boom on pdlh2'") == 1, report  # told once, at the traceback's end
    assert 'raise KeyError(f"boom on {host}")' in report


def test_sigkill_on_remote_host(hosts):
    proc = poprun(hosts, "--num-replicas", "4", *prog("sigkill", "2"))
    assert proc.returncode == 137, proc.stderr  # the others outlive --timeout: the failure ended them
    assert re.search(r"root cause: replica 2 \(rank 2, host pdlh2, pid \d+\): signal SIGKILL\n"
                     r"  about to die on pdlh2", report_of(proc)), proc.stderr


def launch_until_ready(hosts, *args: str) -> tuple[subprocess.Popen, list[list[str]]]:
    """poprun-lite running tests/progs/hosts_prog.py ``args`` on 4 replicas over the test
    hosts, once every replica has printed its READY line: (launcher, READY lines split)."""
    launcher = subprocess.Popen(poprun_command(hosts, "--num-replicas", "4", *prog(*args), job_timeout=JOB_SECONDS),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=ROOT, stdin=subprocess.DEVNULL)
    ready = []
    threading.Thread(target=lambda: ready.extend(
        line.split() for line in launcher.stdout if line.startswith("READY")), daemon=True).start()
    deadline = time.monotonic() + 240
    while len(ready) < 4:
        if time.monotonic() > deadline or launcher.poll() is not None:
            launcher.kill()
            _, err = launcher.communicate()
            raise AssertionError(f"ranks did not start: {err[-2000:]}")
        time.sleep(0.1)
    return launcher, ready


@pytest.mark.parametrize("kill", [True, False], ids=["link-down-and-killed", "link-down"])
def test_loss_of_a_whole_host(hosts, kill):
    """pdlh2's link goes down (and all its processes are killed): the launcher notices
    that its agents fell silent (or mpirun that its daemon died) and ends the job,
    naming a replica on pdlh2."""
    launcher, _ = launch_until_ready(hosts, "loop")
    try:
        hosts.kill_host("pdlh2", kill_processes=kill)
        _, err = launcher.communicate(timeout=JOB_SECONDS + 30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
        hosts.setup()  # bring pdlh2 back for the other tests
    assert launcher.returncode == 1, err  # not 124: the loss ended the job, not --timeout
    report = err[err.index("poprun-lite: job failed"):]
    assert re.search(r"root cause: replica [23] \(rank [23], host pdlh2, pid \d+\): lost: ", report), report


# ---------------------------------------------------------------- the control plane

STRANGER = """
import json, os, socket, sys
host, port = os.environ["TARGET"].rsplit(":", 1)
forged = {"kind": "error", "rank": 3, "replica": 3, "role": "replica", "feeder": None, "host": "FORGED",
          "pid": 1, "time": 1.0, "exception": "FORGED", "message": "FORGED", "traceback": "FORGED"}
for line in (json.dumps(forged), json.dumps({"kind": "lost"}), "0" * 64 + " 0 " + json.dumps(forged)):
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.recv(1000)
        sock.sendall(line.encode() + b"\\n")
print("sent from", socket.gethostname())
"""


def test_control_plane_across_hosts(hosts):
    """Agents on both hosts authenticate across the job network; the job's key is in no
    environment (mpirun's included; the programs' key hunt is test_program_cannot_read_the_key)
    and the collector's address on no command line on any host (mpirun's daemons
    included: the hosts share this machine's process table); a stranger on a test host
    who sends a forged error and `lost` changes nothing: the job exits 0."""
    base = ROOT / ".test-multihost"
    base.mkdir(exist_ok=True)
    go = Path(tempfile.mkdtemp(dir=base))
    launcher, ready = launch_until_ready(hosts, "wait", str(go))
    try:
        pids = {int(me): int(pid) for _, me, _, pid in ready}
        assert {host for _, _, host, _ in ready} == {"pdlh1", "pdlh2"}
        environs = {me: _environ(pid) for me, pid in pids.items()}
        collector = environs[3]["POPRUN_LITE_COLLECTOR"]
        assert collector.startswith(netns_hosts.LAUNCHER_ADDRESS + ":")
        assert not [me for me, env in environs.items() if "POPRUN_LITE_JOB_KEY" in env]
        [mpirun] = [p for p in _pids() if _ppid(p) == launcher.pid]
        assert "POPRUN_LITE_JOB_KEY" not in _environ(mpirun)
        assert not [p for p in _pids() if collector.encode() in _read(f"/proc/{p}/cmdline")]
        sent = hosts.run("pdlh2", f"TARGET={collector} {sys.executable} -c '{STRANGER}'")
        assert sent.returncode == 0 and "sent from pdlh2" in sent.stdout, sent.stderr
        (go / "go").touch()
        _, err = launcher.communicate(timeout=JOB_SECONDS + 30)
    finally:
        (go / "go").touch()
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
        shutil.rmtree(go, ignore_errors=True)
    assert launcher.returncode == 0, err
    assert "FORGED" not in err and "root cause" not in err
    assert "poprun-lite: ignored 3 unauthenticated connection(s) to the collector" in err


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _ppid(pid: int) -> int | None:
    stat = _read(f"/proc/{pid}/stat")
    return int(stat.rsplit(b")", 1)[1].split()[1]) if stat else None


def _environ(pid: int) -> dict[str, str]:
    return dict(e.decode(errors="replace").partition("=")[::2]
                for e in _read(f"/proc/{pid}/environ").split(b"\0") if e)


@pytest.mark.parametrize("mpich", [False, pytest.param(True, marks=needs_mpich)], ids=["openmpi", "mpich"])
def test_program_cannot_read_the_key(hosts, tmp_path, mpich):
    """Four replicas on two hosts (the launcher on neither: every key file is written
    through the launch agent) hunt the job's key in their environments, every ancestor's
    (the agent, MPI's daemon, the launch agent's shell) and the key file they find: none
    is found, every key file is gone (tests/launcher/test_key_unreadable.py for one host),
    and no key directory is left after the job."""
    python = MPICH_PYTHON if mpich else sys.executable
    keys, before = tmp_path / "keys", key_dirs()  # the test hosts share this machine's /dev/shm
    command = poprun_command(hosts, "--num-replicas", "4", python, HUNT, job_timeout=JOB_SECONDS, python=python)
    proc = subprocess.run(recording_launcher(python, keys, *command[3:]), capture_output=True, text=True,
                          timeout=JOB_SECONDS + 120, cwd=ROOT, stdin=subprocess.DEVNULL,
                          env={**os.environ, **(mpich_env() if mpich else {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = hunts(proc.stdout)
    assert [h["host"] for h in found] == ["pdlh1", "pdlh1", "pdlh2", "pdlh2"]
    check_nothing_found(found, keys.read_text().split(), 4, 2, proc.stderr)
    assert not key_dirs() - before


# ---------------------------------------------------------------- the launcher's death

UP = """
import os, socket, sys, time
d = sys.argv[1]
name = f"{os.environ['POPDIST_LITE_ROLE']}-{os.environ['POPDIST_REPLICA_INDEX_OFFSET']}"
with open(os.path.join(d, name + ".tmp"), "w") as f:
    f.write(f"{os.getpid()} {socket.gethostname()}")
os.replace(os.path.join(d, name + ".tmp"), os.path.join(d, name + ".up"))
time.sleep(120)
"""


@pytest.mark.parametrize("mpich", [False, pytest.param(True, marks=needs_mpich)],
                         ids=["openmpi", "mpich"])
def test_launcher_killed_ends_its_job_on_every_host(hosts, mpich):
    """kill -9 of poprun-lite under 2 replicas with a feeder each, one replica on each
    test host: within 5 s of the kill nothing is left on either host (no MPI daemon,
    agent, rank or feeder: the agents see their connections to the launcher end) and
    nothing of the attempt on this machine (mpirun: PR_SET_PDEATHSIG)."""
    from popdist_lite_launcher.node import cleanup
    from hostlaunch import mpich_env

    base = ROOT / ".test-multihost"
    base.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=base))
    (work / "up.py").write_text(UP)
    python = MPICH_PYTHON if mpich else sys.executable
    assert not [h for h in hosts.names if hosts.processes(h)]  # nothing there before
    launcher = subprocess.Popen(poprun_command(hosts, "--num-replicas", "2", "--feeders-per-replica", "1",
                                               python, str(work / "up.py"), str(work),
                                               job_timeout=120, python=python),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT,
                                stdin=subprocess.DEVNULL, env={**os.environ, **(mpich_env() if mpich else {})})
    mark = None
    try:
        deadline = time.monotonic() + 240
        while len(list(work.glob("*.up"))) < 4:
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the ranks and feeders did not start"
            time.sleep(0.05)
        where = sorted((p.name, p.read_text().split()[1]) for p in work.glob("*.up"))
        assert where == [("feeder-0.up", "pdlh1"), ("feeder-1.up", "pdlh2"),
                         ("replica-0.up", "pdlh1"), ("replica-1.up", "pdlh2")]
        [mpirun] = [p for p in _pids() if _ppid(p) == launcher.pid]
        mark = _environ(mpirun)[cleanup.MARK_ENV]
        before = {h: hosts.processes(h) for h in hosts.names}
        assert all(len(pids) >= 4 for pids in before.values()), before  # daemon, 2 agents, 2 programs
        launcher.kill()
        killed = time.monotonic()
        launcher.communicate(timeout=30)
        left = before
        while time.monotonic() - killed < 5.0:
            left = {h: pids for h in hosts.names if (pids := hosts.processes(h))}
            if not left and not cleanup.marked(mark):
                break
            time.sleep(0.05)
        assert not left and not cleanup.marked(mark), (
            f"{time.monotonic() - killed:.1f} s after the kill: " + "; ".join(
                f"{h}: " + ", ".join(_read(f"/proc/{p}/cmdline").replace(b"\0", b" ").decode()[:100]
                                     for p in pids) for h, pids in left.items())
            + f"; marked here: {cleanup.marked(mark)}")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
        if mark is not None:
            cleanup.kill_marked(mark)
        for name in hosts.names:
            for pid in hosts.processes(name):
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
        shutil.rmtree(work, ignore_errors=True)
