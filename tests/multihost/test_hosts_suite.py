"""The single-host suite's checks whose path differs across hosts, at 2 hosts x 2
replicas over TCP.

The tests/mpi modules in :data:`MODULES` run under plain mpirun across the two test
hosts, as tests/test_multirank.py runs every module on one host, with every byte between
ranks on TCP (``--mca btl tcp,self``); the collectives module also under MPICH; and the
host feed end to end (tests/progs/infeed_prog.py under poprun-lite) with 2 feeders per
replica. Each launch runs under a timeout.

Only the modules whose code path differs between one host and two run here: on one host
Open MPI moves bytes through shared memory (``vader``), across hosts through TCP, and
each test host has its own hostname and a private ``/tmp``. What that changes:

- ``test_collectives.py``: every collective (and its checks' ``Allgather``) between
  hosts over TCP, where MPI picks other algorithms and segment sizes than in shared memory;
- ``test_sparse_exchange.py``: the TOKEN exchanges' all-to-all (sparse, with its
  per-peer counts, and dense) between hosts;
- ``test_checkpoint.py``: saves and loads where replicas write their own files from
  different hosts into the shared checkout, a background save's writer thread talking
  across hosts, and a directory under a host's private ``/tmp`` that the other host's
  replicas cannot see (refused before writing);
- ``test_checkpoint_hostile.py``: a checkpoint tampered with on one host, read on both;
- ``test_infeed.py``: the feed thread's per-step agreement between hosts.

The other modules (embeddings' arithmetic, optimizers, precision, layouts, limits, the
torch and JAX bindings, table state, topology under plain mpirun) run the same code on
top of those same collectives whatever the transport: test_multirank.py covers them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hostlaunch import MPICH_PYTHON, ROOT, mpirun, poprun

#: The tests/mpi modules whose path differs across hosts (see above).
MODULES = ("test_checkpoint.py", "test_checkpoint_hostile.py", "test_collectives.py", "test_infeed.py",
           "test_sparse_exchange.py")
TCP_ONLY = "--mpi-global-args=--mca btl tcp,self"
PYTEST = ["-m", "pytest", "--with-mpi", "-q", "--color=no", "-p", "no:cacheprovider",
          "--timeout", "120", "--timeout-method", "thread", "-x"]


@pytest.mark.timeout(900)
def test_mpi_modules_at_2_hosts_x_2_replicas(hosts):
    """The modules of :data:`MODULES` in one pytest session per rank, 4 ranks on 2 hosts."""
    assert all((ROOT / "tests" / "mpi" / m).is_file() for m in MODULES), MODULES
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
