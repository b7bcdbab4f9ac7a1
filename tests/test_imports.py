"""``import popdist_lite`` starts nothing: no MPI, no exit handler, no thread; the
launcher and its agents import the record format and progress slot without MPI."""

import subprocess
import sys
import textwrap

import pytest

from helpers import JOB_SECONDS


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=JOB_SECONDS)


@pytest.mark.parametrize("module", ["popdist_lite", "popdist_lite.records", "popdist_lite.progress"])
def test_import_starts_nothing(module):
    proc = run(f"""
        import atexit, sys, threading
        before = atexit._ncallbacks()
        import {module}
        assert "mpi4py.MPI" not in sys.modules, "imported mpi4py.MPI"
        assert atexit._ncallbacks() == before, "registered an exit handler"
        assert threading.active_count() == 1, "started a thread"
        print("clean")
    """)
    assert proc.returncode == 0 and "clean" in proc.stdout, proc.stderr


@pytest.mark.parametrize("module", ["popdist_lite_launcher.cli", "popdist_lite_launcher.agent"])
def test_launcher_imports_no_mpi(module):
    proc = run(f"""
        import sys
        import {module}
        assert "mpi4py.MPI" not in sys.modules, "imported mpi4py.MPI"
        print("clean")
    """)
    assert proc.returncode == 0 and "clean" in proc.stdout, proc.stderr


def test_names_load_on_first_use_and_infeed_stays_the_function():
    proc = run("""
        import sys
        import popdist_lite as pl
        import popdist_lite.infeed.structure   # a submodule of the infeed package
        assert callable(pl.infeed) and pl.infeed.__name__ == "infeed", pl.infeed
        assert "mpi4py.MPI" not in sys.modules
        pl.init()                                  # MPI starts here
        assert "mpi4py.MPI" in sys.modules
        import numpy as np
        assert pl.all_reduce(np.arange(3.0)).tolist() == [0.0, 1.0, 2.0]
        assert pl.wait_checkpoint is pl.checkpoint.wait
        missing = [name for name in pl.__all__ if not hasattr(pl, name)]
        assert not missing, missing
        print("ok")
    """)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr
