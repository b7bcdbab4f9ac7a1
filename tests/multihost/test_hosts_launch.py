"""poprun-lite across two test hosts (network namespaces, own hostnames, private /tmp):
topology, feeders, host checks, hostfiles, and failure reports without a shared
filesystem. Every launch runs under a subprocess timeout and the launcher's --timeout."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time

import pytest

from popdist_lite_launcher import testhosts
from hostlaunch import MPICH_PYTHON, poprun, poprun_command, prog, ROOT

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
    assert testhosts.LAUNCH_AGENT in command
    if mpich:  # hydra: -localhost (the launcher's address on the test network), no CIDR
        assert f"-localhost {testhosts.LAUNCHER_ADDRESS}" in command
    else:
        assert f"oob_tcp_if_include {testhosts.CIDR}" in command
        assert f"btl_tcp_if_include {testhosts.CIDR}" in command


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
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert time.monotonic() - start < 20
    assert proc.returncode == 2
    assert "poprun-lite: error: host pdlh9 is not reachable with the launch agent" in proc.stderr
    assert "no test host named pdlh9" in proc.stderr  # the agent's own error


# ---------------------------------------------------------------- failures

def report_of(proc) -> str:
    return proc.stderr[proc.stderr.index("poprun-lite: job failed"):]


@pytest.mark.parametrize("mpich", [False, pytest.param(True, marks=needs_mpich)],
                         ids=["openmpi", "mpich"])
def test_exception_on_remote_host(hosts, mpich):
    start = time.monotonic()
    proc = poprun(hosts, "--num-replicas", "4", *prog("raise", "3", mpich=mpich), mpich=mpich)
    assert time.monotonic() - start < 30, proc.stderr
    assert proc.returncode == 1, proc.stderr
    report = report_of(proc)
    assert re.search(r"root cause: replica 3 \(rank 3, host pdlh2, pid \d+\): exit code 1\n"
                     r"  KeyError: 'boom on pdlh2'\n  Traceback \(most recent call last\):", report), report
    assert 'raise KeyError(f"boom on {host}")' in report


def test_sigkill_on_remote_host(hosts):
    start = time.monotonic()
    proc = poprun(hosts, "--num-replicas", "4", *prog("sigkill", "2"))
    assert time.monotonic() - start < 30, proc.stderr
    assert proc.returncode == 137, proc.stderr
    assert re.search(r"root cause: replica 2 \(rank 2, host pdlh2, pid \d+\): signal SIGKILL\n"
                     r"  about to die on pdlh2", report_of(proc)), proc.stderr


@pytest.mark.parametrize("kill", [True, False], ids=["link-down-and-killed", "link-down"])
def test_loss_of_a_whole_host(hosts, kill):
    """pdlh2's link goes down (and all its processes are killed): the launcher notices
    that its agents fell silent (or mpirun that its daemon died) and ends the job,
    naming a replica on pdlh2."""
    launcher = subprocess.Popen(poprun_command(hosts, "--num-replicas", "4", *prog("loop"),
                                               job_timeout=90),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=ROOT, stdin=subprocess.DEVNULL)
    ready = []
    reader = threading.Thread(target=lambda: ready.extend(
        line for line in launcher.stdout if line.startswith("READY")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while len(ready) < 4:
            assert time.monotonic() < deadline and launcher.poll() is None, "ranks did not start"
            time.sleep(0.1)
        hosts.kill_host("pdlh2", kill_processes=kill)
        start = time.monotonic()
        _, err = launcher.communicate(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
        hosts.setup()  # bring pdlh2 back for the other tests
    assert elapsed < 30, err
    assert launcher.returncode == 1, err
    report = err[err.index("poprun-lite: job failed"):]
    assert re.search(r"root cause: replica [23] \(rank [23], host pdlh2, pid \d+\): lost: ", report), report
