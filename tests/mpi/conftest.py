import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

import popdist_lite

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def comm():
    popdist_lite.init()
    return popdist_lite.replica_comm()


@pytest.fixture
def rng():
    """The same generator on every rank: tests build global data, then slice their part."""
    return np.random.default_rng(1234)


@pytest.fixture
def shared(comm):
    """One directory every replica sees, on every test host: a fresh directory inside the
    project checkout (test hosts share the project's filesystem, not /tmp), removed after
    the test."""
    path = None
    if comm.rank == 0:
        base = ROOT / ".test-checkpoints"
        base.mkdir(exist_ok=True)
        path = tempfile.mkdtemp(dir=base)
    path = Path(comm.bcast(path, root=0))
    yield path
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
