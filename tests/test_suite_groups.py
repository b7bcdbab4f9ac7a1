"""tests/conftest.py's groups of tests for pytest-xdist's workers and its list of tests that
run alone (docs/testing.md, "Running in parallel")."""

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load_conftest():
    """tests/conftest.py as a module of its own (``import conftest`` may give another
    directory's conftest.py: they share the name)."""
    spec = importlib.util.spec_from_file_location("popdist_lite_tests_conftest", ROOT / "tests" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


conftest = _load_conftest()


def test_every_test_listed_to_run_alone_exists():
    """A renamed or moved test would silently run beside the others again."""
    for nodeid in conftest.ALONE:
        path, name = nodeid.split("::")
        tree = ast.parse((ROOT / path).read_text())
        assert name in {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}, nodeid


def test_groups():
    group = conftest._group_of
    assert group("tests/slurm/test_slurm_launch.py::test_sbatch[openmpi]") == "tests/slurm"
    assert group("tests/slurm/test_slurm_report.py::test_stall_inspector_names_the_node") == "tests/slurm"
    assert group("tests/multihost/test_hosts_suite.py::test_mpi_modules_at_2_hosts_x_2_replicas") == "tests/multihost"
    one = "tests/test_multirank.py::test_module_on_ranks[test_collectives.py-4]"
    assert group(one) == one
    assert group("tests/launcher/test_launch.py::test_version") == "tests/launcher/test_launch.py"
    assert group("tests/test_dlrm_example.py::test_trains[a::b]") == "tests/test_dlrm_example.py"
