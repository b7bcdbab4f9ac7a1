"""Prefetch of a disk table's rows from a feed with host feeders: the real poprun-lite,
2 replicas, 0 and 1 feeder per replica, tests/progs/disk_prefetch_prog.py. Every
lookup and the final table equal the in-memory table's, and a step whose prefetch was
waited for misses nothing. Every job runs under the launcher's --timeout and a
subprocess timeout."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import JOB_SECONDS, ROOT, timeout_for

PROG = [sys.executable, str(Path(__file__).parent / "progs" / "disk_prefetch_prog.py")]


@timeout_for(1)
@pytest.mark.parametrize("feeders", [0, 1])
def test_prefetch_from_a_feed_with_feeders(feeders, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "popdist_lite_launcher", "--timeout", str(JOB_SECONDS),
                           "--num-replicas", "2", "--feeders-per-replica", str(feeders), *PROG, str(tmp_path)],
                          capture_output=True, text=True, timeout=JOB_SECONDS + 60, stdin=subprocess.DEVNULL,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = sorted((json.loads(line[len("PREFETCH "):]) for line in proc.stdout.splitlines()
                      if line.startswith("PREFETCH ")), key=lambda x: x["replica"])
    assert [x["replica"] for x in results] == [0, 1], proc.stdout[-4000:]
    for x in results:
        assert x["steps"] == 30 and x["same"] and x["misses_after_wait"] == 0 and x["prefetched_rows"] > 0, x
