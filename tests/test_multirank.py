"""Drive the multi-rank modules in tests/mpi/ under mpirun at 1, 2 and 3 ranks, and the
few whose behaviour changes at 4 at 4 too.

Each (module, ranks) pair is one test: one ``mpirun`` under a timeout, running the
module's pytest-mpi tests on every rank (pytest-timeout bounds each test inside).
1 rank is the degenerate job (every collective a copy, one partition), 2 the first
real exchange, 3 an uneven partition of every table and batch (rows and IDs that do not
divide by the replica count) and a count that is not a power of two. The PyTorch and
JAX bindings' modules skip 1 rank (:data:`NOT_AT_ONE`): there the bindings run the
core's degenerate path (its collectives and partitions, which the numpy modules test
at 1 rank) with no branch of their own on the replica count, except JAX's ``TrainStep``
(no all-reduce at 1 replica), whose module keeps it; each costs its framework's
import and start-up, seconds a run. 4 adds coverage
only where the code or MPI takes another path at an even count above 2
(:data:`AT_FOUR`): the collectives (MPI's recursive-doubling and other power-of-two
algorithms), the sparse exchange's all-to-all with three peers of each replica, and
checkpoints at the largest count (the core module: one writer per replica, 4 files per
partitioned array; a user object saved by 3 replicas and read by 4, a reshard between
two counts above 2). The other modules' arithmetic at 4 is the same as at 2 and 3 (a
partition by ``row % n``, a sum over replicas); the multi-host suite (tests/multihost/test_hosts_suite.py) runs the modules
whose path differs across hosts at 4 ranks too.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, run_mpi

MODULES = sorted(p.name for p in (Path(__file__).parent / "mpi").glob("test_*.py"))
RANKS = (1, 2, 3, 4)
#: The modules that also run at 4 ranks (see above).
AT_FOUR = ("test_checkpoint.py", "test_collectives.py", "test_sparse_exchange.py", "test_stateful.py")
#: The modules that skip 1 rank (see above).
NOT_AT_ONE = ("test_jax_checkpoint.py", "test_jax_embedding.py", "test_torch_checkpoint.py",
              "test_torch_data_parallel.py", "test_torch_embedding.py")
#: Seconds for one test inside a module, and for a whole module's mpirun: ample for 4
#: ranks on one busy core (they only bound a hang).
TEST_SECONDS, MODULE_SECONDS = 240, 900


@pytest.mark.timeout(MODULE_SECONDS + 60)
@pytest.mark.parametrize(("module", "ranks"),
                         [(m, r) for m in MODULES for r in RANKS
                          if (r < 4 or m in AT_FOUR) and (r > 1 or m not in NOT_AT_ONE)],
                         ids=lambda v: str(v))
def test_module_on_ranks(module: str, ranks: int):
    assert module in MODULES and set(AT_FOUR) | set(NOT_AT_ONE) <= set(MODULES), (module, AT_FOUR, NOT_AT_ONE)
    args = [sys.executable, "-m", "pytest", "--with-mpi", "-q", "--color=no", "-p", "no:cacheprovider",
            "--timeout", str(TEST_SECONDS), "--timeout-method", "thread", "-x", f"tests/mpi/{module}"]
    try:
        result = run_mpi(ranks, args, timeout=MODULE_SECONDS)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{module} on {ranks} ranks hung for {e.timeout} s:\n{(e.stdout or b'')[-4000:]!r}")
    if result.returncode != 0:
        pytest.fail(f"{module} on {ranks} ranks failed (exit {result.returncode}):\n"
                    f"{result.stdout[-8000:]}\n{result.stderr[-4000:]}")
