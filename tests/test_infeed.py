"""The host feed end to end: the real poprun-lite (or plain mpirun with the role
variables) running tests/progs/infeed_prog.py with feeders or the replica's thread.

Every job runs under the launcher's --timeout and a subprocess timeout.
"""

import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import JOB_SECONDS, ROOT, mpirun_command, timeout_for

LAUNCHER = [sys.executable, "-m", "popdist_lite_launcher"]
PROG = [sys.executable, str(Path(__file__).parent / "progs" / "infeed_prog.py")]
ITEMS_PER_BATCH = 4


pytestmark = timeout_for(2)


def launch(replicas, feeders, *prog_args):
    return subprocess.run([*LAUNCHER, "--timeout", str(JOB_SECONDS), "--num-replicas", str(replicas),
                           "--feeders-per-replica", str(feeders), *PROG, *map(str, prog_args)],
                          capture_output=True, text=True, timeout=JOB_SECONDS + 60,
                          stdin=subprocess.DEVNULL, cwd=ROOT)


def got(proc):
    """{replica: (items, steps)} from the replicas' GOT lines."""
    assert proc.returncode == 0, proc.stderr
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("GOT "):
            record = json.loads(line[4:])
            out[record["replica"]] = (record["items"], record["steps"])
    return out


@functools.lru_cache(maxsize=None)
def feed_run(replicas, feeders, n, run=0):
    """Items per replica for one job (cached: several tests compare the same runs)."""
    return got(launch(replicas, feeders, n, "--depth", 2))


# ---------------------------------------------------------------- delivery and order

def test_exactly_once_across_2_replicas_x_2_feeders():
    n = 24
    result = feed_run(2, 2, n)
    assert sorted(result) == [0, 1]
    every = sorted(i for items, _ in result.values() for i in items)
    assert every == list(range(n * ITEMS_PER_BATCH))  # each item exactly once
    assert [steps for _, steps in result.values()] == [n // 2, n // 2]


def test_order_is_deterministic():
    assert feed_run(2, 2, 24, run=0) == feed_run(2, 2, 24, run=1)


@pytest.mark.parametrize("feeders", [0, 1])
def test_same_batches_in_the_same_order_for_any_number_of_feeders(feeders):
    # replica r gets batches r, r + R, r + 2R, ... whatever F is (strided dataset)
    assert feed_run(2, feeders, 24) == feed_run(2, 2, 24)
    items, _ = feed_run(2, feeders, 24)[1]
    assert items[:8] == [4, 5, 6, 7, 12, 13, 14, 15]


@pytest.mark.parametrize("feeders", [0, 2])
def test_end_of_data_every_replica_stops_at_the_same_step(feeders):
    # 25 batches: replica 0 has 13, replica 1 has 12 -> both stop after 12 steps (the
    # minimum); with F = 2 the extra batch sits with feeder 0 of replica 0
    result = feed_run(2, feeders, 25)
    assert [result[r][1] for r in (0, 1)] == [12, 12]
    every = sorted(i for items, _ in result.values() for i in items)
    assert every == list(range(24 * ITEMS_PER_BATCH))


def test_plain_mpirun_with_role_variables():
    """No launcher: the user sets the role variables per MPMD context."""
    base = mpirun_command(2, [*PROG, "24", "--depth", "2"])
    feeder = []
    for replica in (0, 1):
        feeder += [":", "-n", "1", "-x", "POPDIST_LITE_ROLE=feeder", "-x",
                   f"POPDIST_LITE_FEEDER_OF={replica}", *PROG, "24", "--depth", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(base + feeder, capture_output=True, text=True, timeout=JOB_SECONDS, env=env,
                          cwd=ROOT, stdin=subprocess.DEVNULL)
    assert got(proc) == feed_run(2, 1, 24)


# ---------------------------------------------------------------- prefetch bound

def events(path):
    return [float(line) for line in path.read_text().split()]


@pytest.mark.parametrize("feeders, depth", [(2, 2), (0, 3)])
def test_prefetch_bound_with_a_patient_replica(tmp_path, feeders, depth):
    """Sent (feeder side: the dataset was resumed after handing a batch over) minus
    released (the replica asked for the next batch) never exceeds the depth, and the
    feed does run ahead up to it: the patient replica releases each batch only once the
    feed is that far ahead (it fails if the feed never gets there)."""
    n = 16
    proc = launch(1, feeders, n, "--depth", depth, "--patient", "--log", tmp_path)
    assert got(proc)[0][1] == n
    sent = sorted(t for p in tmp_path.glob("sent-*") for t in events(p))
    released = events(tmp_path / "released-0")
    assert len(sent) == n and len(released) == n
    in_flight = [sum(s <= t for s in sent) - sum(r <= t for r in released) for t in sent]
    assert max(in_flight) == depth, in_flight


# ---------------------------------------------------------------- failures

def test_feeder_exception_names_the_feeder():
    proc = launch(2, 1, 40, "--fail-at", "1:0:3")
    assert proc.returncode == 1, proc.stderr
    report = proc.stderr[proc.stderr.index("poprun-lite: job failed"):]
    assert "root cause: feeder 0 of replica 1 (rank 3" in report
    assert "RuntimeError: dataset failure in shard 1 at batch 7" in report
    assert "in make_dataset" in report  # the feeder's traceback


@pytest.mark.parametrize("feeders", [1, 0])
def test_sys_exit_in_make_dataset_ends_the_job_naming_its_process(feeders):
    """sys.exit(0) in one replica's dataset: a feeder that ended quietly (or a replica
    that exited 0) would leave the other replica waiting until --timeout; the job ends
    at once, naming the feeder (or, without feeders, the replica whose thread it was)."""
    proc = launch(2, feeders, 40, "--exit-at", "1:0:3")
    assert proc.returncode == 1, proc.stderr
    report = proc.stderr[proc.stderr.index("poprun-lite: job failed"):]
    if feeders:
        assert "root cause: feeder 0 of replica 1 (rank 3" in report
        assert "  SystemExit: 0\n" in report
    else:
        assert "root cause: replica 1 (rank 1" in report
        assert "RuntimeError: infeed: the dataset of replica 1 raised SystemExit(0) in its feed thread" in report
    assert "in make_dataset" in report and "sys.exit(0)" in report  # where it came from
    assert "timed out" not in proc.stderr


def test_killed_feeder_names_the_feeder():
    proc = launch(2, 2, 40, "--kill-at", "0:1:2")
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr
    assert "root cause: feeder 1 of replica 0 (rank 3" in proc.stderr
    assert "signal SIGKILL\n  feeder about to be killed" in proc.stderr


def test_feeders_with_different_structure_is_a_clear_error():
    proc = launch(1, 2, 8, "--mixed")
    assert proc.returncode == 1, proc.stderr
    report = proc.stderr[proc.stderr.index("poprun-lite: job failed"):]
    assert "root cause: replica 0 (rank 0" in report
    assert "TypeError: infeed: the feeders of replica 0 yield batches of different structure" in report
    assert "'item': int64 (1-d)" in report and "'item': float64 (1-d)" in report
