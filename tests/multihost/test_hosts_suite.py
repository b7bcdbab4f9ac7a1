"""The single-host suite's checks, run once at 2 hosts x 2 replicas over TCP.

The multi-rank modules of tests/mpi (collectives, embeddings TOKEN/ENCODING, the sparse
exchange, ID limits, optimizers, precision, data parallelism, topology, the feed
thread) run under plain mpirun across the two test hosts, as tests/test_multirank.py
runs them on one, with every byte between ranks on TCP (``--mca btl tcp,self``); the
collectives module also under MPICH; and the host feed end to end (tests/progs/infeed_prog.py
under poprun-lite) with 2 feeders per replica. Each launch runs under a timeout.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hostlaunch import MPICH_PYTHON, ROOT, mpirun, poprun

MODULES = sorted(p.name for p in (ROOT / "tests" / "mpi").glob("test_*.py"))
TCP_ONLY = "--mpi-global-args=--mca btl tcp,self"
PYTEST = ["-m", "pytest", "--with-mpi", "-q", "--color=no", "-p", "no:cacheprovider",
          "--timeout", "120", "--timeout-method", "thread", "-x"]


@pytest.mark.timeout(900)
def test_mpi_modules_at_2_hosts_x_2_replicas(hosts):
    """Every tests/mpi module in one pytest session per rank, 4 ranks on 2 hosts."""
    proc = mpirun(hosts, 2, [sys.executable, *PYTEST, *(f"tests/mpi/{m}" for m in MODULES)],
                  timeout=840)
    summaries = re.findall(r"^(\d+) passed.*$", proc.stdout, re.M)
    assert proc.returncode == 0 and len(summaries) == 4, proc.stdout[-6000:] + proc.stderr[-3000:]


@pytest.mark.timeout(300)
@pytest.mark.skipif(not MPICH_PYTHON, reason="no MPICH environment (scripts/test prepares one)")
def test_collectives_module_at_2_hosts_under_mpich(hosts):
    proc = mpirun(hosts, 2, [MPICH_PYTHON, *PYTEST, "tests/mpi/test_collectives.py"], mpich=True,
                  timeout=280)
    assert proc.returncode == 0 and proc.stdout.count(" passed") == 4, \
        proc.stdout[-6000:] + proc.stderr[-3000:]


@pytest.mark.timeout(200)
def test_feeders_exactly_once_at_2_hosts(hosts):
    n = 24
    proc = poprun(hosts, "--num-replicas", "2", "--feeders-per-replica", "2", TCP_ONLY,
                  sys.executable, str(ROOT / "tests" / "progs" / "infeed_prog.py"), str(n), "--depth", "2",
                  timeout=180, job_timeout=150)
    assert proc.returncode == 0, proc.stderr
    got = {}
    for match in re.findall(r"GOT (\{[^{}]*\})", proc.stdout):
        record = json.loads(match)
        got[record["replica"]] = (record["items"], record["steps"])
    assert sorted(got) == [0, 1]
    every = sorted(i for items, _ in got.values() for i in items)
    assert every == list(range(4 * n))  # every item exactly once
    assert [steps for _, steps in got.values()] == [n // 2, n // 2]
