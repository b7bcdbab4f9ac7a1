"""Test layout.

- ``tests/*.py``, ``tests/launcher/``: single-process tests (run by plain ``pytest``).
- ``tests/mpi/``: multi-rank tests, pytest-mpi style (``@pytest.mark.mpi``). They run
  inside ``mpirun -n N python -m pytest --with-mpi tests/mpi/<module>``, one mpirun per
  module and rank count, each under a timeout: ``tests/test_multirank.py`` drives them
  at 1, 2, 3 and 4 ranks, so one ``pytest`` command runs the whole suite and a hang
  fails one module at one rank count within seconds, never the whole run.

Under pytest-xdist's ``--dist loadgroup`` (``scripts/test`` without paths; docs/testing.md)
the tests are sent to the workers in groups (:func:`_group_of`): a
module's tests go to one worker, in order, as in a serial run (its module fixtures are
made once, and no two of its tests ever run at the same time), but for
``test_multirank.py``, whose tests are independent mpiruns; the Slurm tests are one
group (one test cluster, which a lock under /run lets only one user have at a time) and
so are the multi-host tests (one set of test hosts, likewise). Those two groups, mostly
waiting for daemons and jobs, come first, so that they run beside the rest, and the tests
sent one by one come last.
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


# ------------------------------------------------------------------ pytest-xdist's groups

#: Directories whose tests are one group each (a session fixture holds a machine-wide
#: resource, taken under a lock), sent to the workers first: they are long and mostly wait.
_EXCLUSIVE = ("slurm", "multihost")
#: Modules whose tests are sent to the workers one by one (no module fixtures, no shared state).
_UNGROUPED = ("tests/test_multirank.py",)


def _group_of(nodeid: str) -> str:
    """The group of the test ``nodeid`` (module docstring)."""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")
    if len(parts) > 2 and parts[0] == "tests" and parts[1] in _EXCLUSIVE:
        return f"tests/{parts[1]}"
    return nodeid if path in _UNGROUPED else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadgroup``, xdist's scheduler of whole groups with this module's
    groups (:func:`_group_of`; xdist's own, from ``xdist_group`` marks, cannot rename a
    node ID under pytest 9), sent in the order collected (see below), not largest first."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group_of(nodeid)

    config.option.loadscopereorder = False
    return Groups(config, log)


#: Tests that look at state of the whole machine which other tests' jobs change, so they
#: must not run beside any other test: marked ``alone`` here (scripts/test runs them after
#: the others, one at a time), with what they look at.
ALONE = {
    "tests/launcher/test_key_unreadable.py::test_program_cannot_read_the_key": "every key directory in /dev/shm",
    "tests/multihost/test_hosts_launch.py::test_program_cannot_read_the_key": "every key directory in /dev/shm",
    "tests/launcher/test_session_dirs.py::test_a_job_whose_mpirun_gets_a_killed_ones_pid_runs":
        "the PIDs the next processes get",
    "tests/test_restart_resume.py::test_killed_replica_restarts_from_the_checkpoint":
        "every process, for the replica it kills",
    "tests/test_disk_memory.py::test_disk_table_trains_in_a_quarter_of_its_bytes":
        "the kernel's write-back of dirty pages, under a memory cgroup's limit",
}


def pytest_collection_modifyitems(config, items):
    """The ``alone`` mark on the tests of :data:`ALONE`. In an xdist worker under ``--dist
    loadgroup``, the order in which the groups are sent: the Slurm and multi-host groups
    first, then the modules, then the tests sent one by one, so that no long group starts
    when the other workers are nearly done. A serial run keeps the order collected."""
    for item in items:
        if item.nodeid.split("[", 1)[0] in ALONE:
            item.add_marker(pytest.mark.alone)
    if not getattr(config.option, "loadgroup", False):  # set in a worker by xdist
        return
    first = {f"tests/{name}": i for i, name in enumerate(_EXCLUSIVE)}

    def order(item):
        group = _group_of(item.nodeid)
        return first.get(group, len(first) + (group == item.nodeid))

    items.sort(key=order)
