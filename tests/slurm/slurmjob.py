"""What the Slurm tests share (the tests' own module, as tests/multihost/hostlaunch.py
is the multi-host tests'): the MPIs, poprun-lite running the Shakespeare example with no
-H, batch scripts, and waiting for an event under a deadline."""

from __future__ import annotations

import os
import re
import shlex
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "shakespeare.py"
MPICH_PYTHON = os.environ.get("POPDIST_LITE_MPICH_PYTHON")
TEXT = ("ROMEO.\nBut soft, what light through yonder window breaks?\n"
        "It is the east, and Juliet is the sun.\n\n") * 20
REPORT = re.compile(r"^replica (\d+) on (\S+)$", re.M)

MPIS = ["openmpi", pytest.param("mpich", marks=pytest.mark.skipif(
    not MPICH_PYTHON, reason="no MPICH environment (scripts/test prepares one)"))]


def python_of(mpi: str) -> str:
    return MPICH_PYTHON if mpi == "mpich" else sys.executable


def mpi_env(mpi: str) -> dict[str, str]:
    """The variables that make poprun-lite use ``mpi``'s mpirun."""
    bin_dir = Path(python_of(mpi)).parent
    mpirun = bin_dir / ("mpiexec" if mpi == "mpich" else "mpirun")
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "POPRUN_LITE_MPIRUN": str(mpirun)}


def poprun_command(cluster, mpi: str, steps: int, *options: str) -> list[str]:
    """poprun-lite running the Shakespeare example (a tiny text), with no -H; every
    replica first prints ``replica N on HOST``."""
    data = cluster.work / "tiny.txt"
    data.write_text(TEXT)
    python = python_of(mpi)
    report = 'echo "replica $POPDIST_REPLICA_INDEX_OFFSET on $(hostname)"; exec "$@"'
    return [python, "-m", "popdist_lite_launcher", "--timeout", "150", "--print-topology", "-v",
            *options, "/bin/sh", "-c", report, "sh", python, str(EXAMPLE), "--data", str(data),
            "--steps", str(steps), "--seq-len", "20", "--batch-size", "4", "--log-every", "1",
            "--sample-chars", "5"]


def batch_script(cluster, name: str, command: list[str]) -> Path:
    script = cluster.work / f"{name}.sh"
    script.write_text(f"#!/bin/bash\ncd {shlex.quote(str(ROOT))}\nexec {shlex.join(command)}\n")
    return script


def wait_for(predicate, what: str, timeout: float, said=None):
    """``predicate()`` once true, polled every 0.1 s; AssertionError after ``timeout``
    seconds (with ``said()``, e.g. the job's output, when given)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:g} s" + (f":\n{said()}" if said else ""))
        time.sleep(0.1)
