"""Drive the multi-rank modules in tests/mpi/ at 1, 2, 3 and 4 ranks.

Each (module, ranks) pair is one test: one ``mpirun`` under a timeout, running the
module's pytest-mpi tests on every rank (pytest-timeout bounds each test inside).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, run_mpi

MODULES = sorted(p.name for p in (Path(__file__).parent / "mpi").glob("test_*.py"))
RANKS = (1, 2, 3, 4)
#: Seconds for one test inside a module, and for a whole module's mpirun: ample for 4
#: ranks on one busy core (they only bound a hang).
TEST_SECONDS, MODULE_SECONDS = 240, 900


@pytest.mark.timeout(MODULE_SECONDS + 60)
@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("module", MODULES)
def test_module_on_ranks(module: str, ranks: int):
    args = [sys.executable, "-m", "pytest", "--with-mpi", "-q", "--color=no", "-p", "no:cacheprovider",
            "--timeout", str(TEST_SECONDS), "--timeout-method", "thread", "-x", f"tests/mpi/{module}"]
    try:
        result = run_mpi(ranks, args, timeout=MODULE_SECONDS)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{module} on {ranks} ranks hung for {e.timeout} s:\n{(e.stdout or b'')[-4000:]!r}")
    if result.returncode != 0:
        pytest.fail(f"{module} on {ranks} ranks failed (exit {result.returncode}):\n"
                    f"{result.stdout[-8000:]}\n{result.stderr[-4000:]}")
