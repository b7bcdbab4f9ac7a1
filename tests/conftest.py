"""Test layout.

- ``tests/*.py``, ``tests/launcher/``: single-process tests (run by plain ``pytest``).
- ``tests/mpi/``: multi-rank tests, pytest-mpi style (``@pytest.mark.mpi``). They run
  inside ``mpirun -n N python -m pytest --with-mpi tests/mpi/<module>``, one mpirun per
  module and rank count, each under a timeout: ``tests/test_multirank.py`` drives them
  at 1, 2, 3 and 4 ranks, so one ``pytest`` command runs the whole suite and a hang
  fails one module at one rank count within seconds, never the whole run.
"""

import os
from pathlib import Path

import pytest

# The suite runs outside any Slurm allocation, also when started inside one (salloc, a CI
# runner under Slurm): poprun-lite and mpirun would otherwise take their hosts from it.
# The Slurm tests (tests/slurm/) run their jobs on a cluster of their own.
for _name in [name for name in os.environ if name.startswith("SLURM_")]:
    del os.environ[_name]


def pytest_ignore_collect(collection_path: Path, config):
    # The multi-rank modules only run under mpirun (driven by test_multirank.py).
    if "mpi" in collection_path.parts[-2:-1] and not config.getoption("with_mpi", False):
        return True
    return None


@pytest.fixture(scope="session")
def torchrec():
    """The ``torchrec`` module, or the test is skipped with the reason TorchRec cannot be
    used here (``helpers.torchrec_unavailable``; ``helpers.requires_torchrec`` is the mark)."""
    from helpers import torchrec_unavailable

    reason = torchrec_unavailable()
    if reason is not None:
        pytest.skip(reason)
    import torchrec as module

    return module
