"""poprun-lite and the collectives under MPICH (hydra's mpiexec), from the MPICH venv
that scripts/test prepares (POPDIST_LITE_MPICH_PYTHON)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import JOB_SECONDS, timeout_for

ROOT = Path(__file__).resolve().parents[2]
PYTHON = os.environ.get("POPDIST_LITE_MPICH_PYTHON")
pytestmark = [pytest.mark.skipif(not PYTHON, reason="no MPICH environment (scripts/test prepares one)"),
              timeout_for(1)]

PROGRAM = """
import numpy as np, popdist_lite as pl
pl.init()
r, k = pl.num_replicas(), pl.replica_id()
table = np.arange(40, dtype=np.float32).reshape(10, 4)
for strategy in ("TOKEN", "ENCODING"):
    emb = pl.create_host_embedding("t", shape=[10, 4], partition_strategy=strategy, initializer=table)
    idx = np.arange(k, 10, r)
    assert np.array_equal(emb.lookup(idx), table[idx])
assert pl.all_reduce(np.float16(1.0)) == r
print(f"replica {k} of {r} ok", flush=True)
if k == r - 1 and "fail" in __import__("sys").argv:
    raise KeyError("boom")
pl.all_reduce(np.ones(1))
"""


def poprun(tmp_path, *args, timeout=JOB_SECONDS + 60):
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    bin_dir = Path(PYTHON).parent
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "POPRUN_LITE_MPIRUN": str(bin_dir / "mpiexec")}
    return subprocess.run([PYTHON, "-m", "popdist_lite_launcher", "--num-replicas", "3", "--timeout", str(JOB_SECONDS), "-v",
                           PYTHON, str(script), *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_job_runs_under_mpich(tmp_path):
    proc = poprun(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "mpiexec" in proc.stderr + proc.stdout and "-env POPDIST_REPLICA_INDEX_OFFSET 2" in proc.stderr + proc.stdout
    # the collector's address and the job's key reach the agents through hydra's
    # forwarding of mpiexec's environment, never on its command line
    assert "POPRUN_LITE_COLLECTOR" not in proc.stderr + proc.stdout
    assert "POPRUN_LITE_JOB_KEY" not in proc.stderr + proc.stdout
    for k in range(3):
        assert f"replica {k} of 3 ok" in proc.stdout


def test_failure_report_under_mpich(tmp_path):
    proc = poprun(tmp_path, "fail")
    assert proc.returncode != 0
    assert "root cause: replica 2 (rank 2" in proc.stderr and "KeyError: 'boom'" in proc.stderr, proc.stderr


def test_collectives_module_under_mpich():
    bin_dir = Path(PYTHON).parent
    proc = subprocess.run([str(bin_dir / "mpiexec"), "-n", "3", PYTHON, "-m", "pytest", "--with-mpi", "-q",
                           "--color=no", "-p", "no:cacheprovider", "--timeout", "240", "--timeout-method", "thread",
                           "-x", "tests/mpi/test_collectives.py"],
                          capture_output=True, text=True, timeout=JOB_SECONDS, cwd=ROOT, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
