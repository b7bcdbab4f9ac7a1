"""Elastic jobs across the test hosts (2 hosts x 2 replicas, docs/elastic.md), with
tests/progs/hosts_elastic_prog.py: one epoch of numbered samples, the global batch kept
fixed by gradient accumulation, a checkpoint every 10 steps.

- Host 2 disappears at step 25 (its link set down, its processes killed): the job goes
  on at 2 replicas on host 1 from the step-20 checkpoint; when host 2 comes back
  (discovery lists it again) it grows back to 4 replicas at a step boundary, losing no
  step, and finishes the epoch. Every sample is consumed exactly once by the steps that
  count (those of the checkpoints the attempts resumed from), and the final checkpoint's
  counting table says so too.
- Equivalence: after a shrink, the final tables and dense weights equal (float32
  tolerance) a run that did the same steps at 2 replicas from the same step-20
  checkpoint, and an uninterrupted run at 4 replicas.
- A host whose link is down fails the probe in words (no "daemon failed to report back").
- Processes a failed job's ranks left behind outside their session are killed on every
  host by the cleanup after the attempt.

The job waits at the steps where a test changes the hosts (the program's ``--hold``:
after step 25 of the first attempt until the host loss tears it down, after step 32
of the second until the launcher asks for the grow), so every event happens at a known
step however fast the steps run. After every job, nothing of it runs on any test host
within a minute (at once, normally). Every poprun-lite runs under a subprocess timeout and its own
--timeout."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hostlaunch import ROOT, poprun, poprun_command, prog
from popdist_lite.checkpoint.__main__ import export
from popdist_lite_launcher.testing import netns_hosts

PROG = str(Path(__file__).parent.parent / "progs" / "hosts_elastic_prog.py")
#: Seconds a job may take (its --timeout; the subprocess gets 60 more); a test runs at most three.
JOB_SECONDS = 300
pytestmark = pytest.mark.timeout(3 * (JOB_SECONDS + 60) + 60)
SAMPLES, BATCH, GLOBAL_BATCH = 480, 2, 8  # 60 steps of 8 samples
STEPS = SAMPLES // GLOBAL_BATCH
PROG_ARGS = ["--samples", str(SAMPLES), "--batch", str(BATCH), "--global-batch", str(GLOBAL_BATCH)]


@pytest.fixture
def work():
    """A directory in the project (the test hosts share it, not /tmp)."""
    base = ROOT / ".test-multihost"
    base.mkdir(exist_ok=True)
    path = Path(tempfile.mkdtemp(dir=base))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def discovery_script(work: Path, listing: str) -> Path:
    (work / "hosts").write_text(listing)
    script = work / "discover.sh"
    script.write_text(f"#!/usr/bin/env bash\ncat {work / 'hosts'}\n")
    script.chmod(0o755)
    return script


class Job:
    """poprun-lite running hosts_elastic_prog.py over the test hosts; ``on_line(line)`` sees
    every line of its stdout as it comes."""

    def __init__(self, hosts, work: Path, on_line, *, holds: list[str]):
        cmd = poprun_command(hosts, "--num-replicas", "4", "--min-replicas", "2", "--host-discovery-script",
                             str(work / "discover.sh"), "--discovery-interval", "1", sys.executable, PROG,
                             str(work / "ckpt"), *PROG_ARGS, *(f"--hold={hold}" for hold in holds),
                             job_timeout=JOB_SECONDS)
        cmd.remove("-H")
        cmd.remove(",".join(hosts.names))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                     stdin=subprocess.DEVNULL)
        self.lines: list[str] = []
        self.errors: list[str] = []
        self.failures: list[BaseException] = []

        def read():
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                try:
                    on_line(line.rstrip("\n"))
                except BaseException as exc:  # noqa: BLE001 - reported by wait()
                    self.failures.append(exc)
        self.readers = [threading.Thread(target=read, daemon=True),
                        threading.Thread(target=lambda: self.errors.append(self.proc.stderr.read()), daemon=True)]
        for reader in self.readers:
            reader.start()

    def wait(self, timeout: float = JOB_SECONDS + 60) -> tuple[int, str]:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        for reader in self.readers:
            reader.join(10)
        if self.failures:
            raise self.failures[0]
        return code, "".join(self.errors)


def took(lines: list[str]) -> dict[tuple[int, int], dict[int, list[int]]]:
    """``{(attempt, step): {replica: sample ids}}`` from the TOOK lines."""
    found: dict = {}
    for line in lines:
        if line.startswith("TOOK "):
            attempt, step, replica, *ids = map(int, line.split()[1:])
            found.setdefault((attempt, step), {})[replica] = ids
    return found


def final_arrays(ckpt: Path) -> dict[str, np.ndarray]:
    out = {}
    for name in ("table/weights", "table/optimizer/m", "table/optimizer/v", "seen/weights", "params/w",
                 "optimizer/state/w/velocity", "table/optimizer/steps"):
        path = ckpt.parent / f"{name.replace('/', '.')}.npy"
        export(ckpt, name, path)
        out[name] = np.load(path)
    return out


def assert_hosts_clean(hosts, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while True:
        left = {host: hosts.processes(host) for host in hosts.names}
        if not any(left.values()):
            return
        if time.monotonic() > deadline:
            details = {host: [_cmdline(pid) for pid in pids] for host, pids in left.items() if pids}
            pytest.fail(f"processes of the job still run on the test hosts: {details}")
        time.sleep(0.1)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"


def test_shrink_then_grow_every_sample_once(hosts, work):
    discovery_script(work, "pdlh1:2\npdlh2:2\n")
    events = {}

    def on_line(line):
        if line.startswith("TOOK 0 25 0 ") and "lost" not in events:
            hosts.kill_host("pdlh2")          # its link down, then its processes killed
            (work / "hosts").write_text("pdlh1:2\n")
            events["lost"] = time.monotonic()
        elif line.startswith("TOOK 1 32 0 ") and "back" not in events:
            hosts.restore_host("pdlh2")
            (work / "hosts").write_text("pdlh1:2\npdlh2:2\n")
            events["back"] = time.monotonic()

    job = Job(hosts, work, on_line, holds=["0:25", "1:32"])
    try:
        code, err = job.wait()
    finally:
        hosts.restore_host("pdlh2")
    assert code == 0, err
    assert_hosts_clean(hosts)
    out = job.lines
    stopped = [int(line.split()[1]) for line in out if line.startswith("STOPPED ")]
    resumed = [tuple(map(int, line.split()[1:])) for line in out if line.startswith("RESUMED ")]
    assert stopped == [33], out
    grow_step = 33
    # from the step-20 checkpoint at 2 replicas, then from the grow's checkpoint at 4: no step lost
    assert resumed == [(20, 2), (grow_step, 4)], resumed
    assert f"DONE {STEPS}" in out

    assert re.search(r"attempt 1: 4 replicas on pdlh1 \(2\), pdlh2 \(2\); host pdlh2 lost: replica [23] "
                     r"\(rank [23], host pdlh2, pid \d+\): lost: ", err), err
    assert "attempt 2: 2 replicas on pdlh1 (2), after host pdlh2 lost; stopped at a step boundary for a " \
           "resize (host pdlh2 added)" in err
    assert "attempt 3: 4 replicas on pdlh1 (2), pdlh2 (2), after host pdlh2 added; succeeded" in err
    assert "poprun-lite: job succeeded on attempt 3" in err

    # exactly once: the steps each attempt committed (up to where the next one resumed)
    steps = took(out)
    committed = [(0, s, 4) for s in range(20)] + [(1, s, 2) for s in range(20, grow_step)] + \
                [(2, s, 4) for s in range(grow_step, STEPS)]
    samples = []
    for attempt, step, replicas in committed:
        assert sorted(steps[attempt, step]) == list(range(replicas)), (attempt, step)
        samples += [i for ids in steps[attempt, step].values() for i in ids]
    assert sorted(samples) == list(range(SAMPLES))  # every sample once, none twice, none skipped
    assert max(s for a, s in steps if a == 0) == 25  # attempt 1's steps 20-25 were redone
    final = final_arrays(work / "ckpt" / f"step-{STEPS:08d}")
    assert np.array_equal(final["seen/weights"], np.ones((SAMPLES, 1), np.float32))


def test_shrink_equals_the_same_steps_at_the_smaller_size(hosts, work):
    """Host 2 lost at step 25 and still listed by discovery (its probe fails, in words):
    2 replicas from the step-20 checkpoint to the end. The final tables, optimizer state
    and dense weights equal a local run at 2 replicas from a copy of that checkpoint, and
    an uninterrupted local run at 4 replicas (same global batch: the same math)."""
    discovery_script(work, "pdlh1:2\npdlh2:2\n")
    events = {}

    def on_line(line):
        if line.startswith("TOOK 0 25 0 ") and "lost" not in events:
            hosts.kill_host("pdlh2")
            events["lost"] = True
        elif line.startswith("RESUMED 20 2") and "copied" not in events:
            shutil.copytree(work / "ckpt" / "step-00000020", work / "from20" / "step-00000020")
            events["copied"] = True

    job = Job(hosts, work, on_line, holds=["0:25"])
    try:
        code, err = job.wait()
    finally:
        hosts.restore_host("pdlh2")
    assert code == 0, err
    assert_hosts_clean(hosts)
    assert [line for line in job.lines if line.startswith(("RESUMED", "DONE"))] == ["RESUMED 20 2", f"DONE {STEPS}"]
    assert re.search(r"host pdlh2 cannot connect to poprun-lite at 10\.250\.0\.1:\d+ over the job network: "
                     r"(timed out after 5 s|no route to host)", err), err
    assert "attempt 2: 2 replicas on pdlh1 (2), after host pdlh2 lost; succeeded" in err
    elastic = final_arrays(work / "ckpt" / f"step-{STEPS:08d}")

    local = [sys.executable, "-m", "popdist_lite_launcher", "--timeout", str(JOB_SECONDS), "--num-replicas"]
    for replicas, ckpt in (("2", work / "from20"), ("4", work / "straight")):
        proc = subprocess.run([*local, replicas, sys.executable, PROG, str(ckpt), *PROG_ARGS],
                              capture_output=True, text=True, timeout=JOB_SECONDS + 60, cwd=ROOT,
                              stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, proc.stderr
        reference = final_arrays(ckpt / f"step-{STEPS:08d}")
        for name, array in reference.items():
            np.testing.assert_allclose(elastic[name], array, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{name}: elastic run vs {replicas} replicas")


def test_a_host_whose_link_is_down_fails_the_probe_in_words(hosts):
    hosts.kill_host("pdlh2", kill_processes=False)
    try:
        proc = subprocess.run(poprun_command(hosts, "--num-replicas", "4", sys.executable, "-c", "pass"),
                              capture_output=True, text=True, timeout=JOB_SECONDS, cwd=ROOT, stdin=subprocess.DEVNULL)
    finally:
        hosts.restore_host("pdlh2")
    assert proc.returncode == 2, proc.stderr
    assert re.search(r"poprun-lite: error: host pdlh2 cannot connect to poprun-lite at "
                     rf"{re.escape(netns_hosts.LAUNCHER_ADDRESS)}:\d+ over the job network: "
                     r"(timed out after 5 s|no route to host)", proc.stderr), proc.stderr
    assert "daemon failed to report back" not in proc.stderr
    assert_hosts_clean(hosts)


def test_what_a_failed_attempt_leaves_behind_is_killed_on_every_host(hosts):
    """Every rank starts a process in a session of its own (outside mpirun's and its
    daemon's reach) and replica 3 fails: after the job, nothing carrying its mark runs on
    either host (without the cleanup the 4 sleeps would run for 5 minutes)."""
    proc = poprun(hosts, "--num-replicas", "4", *prog("detach", "3"))
    assert proc.returncode == 3, proc.stderr
    assert re.search(r"root cause: replica 3 \(rank 3, host pdlh2, pid \d+\): exit code 3", proc.stderr)
    assert "cleanup after the attempt failed" not in proc.stderr
    assert_hosts_clean(hosts)
