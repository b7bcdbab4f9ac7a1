import numpy as np
import pytest

import popdist_lite


@pytest.fixture
def comm():
    popdist_lite.init()
    return popdist_lite.replica_comm()


@pytest.fixture
def rng():
    """The same generator on every rank: tests build global data, then slice their part."""
    return np.random.default_rng(1234)
