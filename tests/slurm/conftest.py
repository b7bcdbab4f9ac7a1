"""Slurm tests on a throw-away cluster (popdist_lite_launcher.testing.slurm_cluster): slurmctld on
this machine and two slurmd nodes, pdls1 and pdls2, each in its own network-namespace
test host. They run where root and Slurm (Debian's slurm-wlm and munge, which
scripts/test installs) are available and are skipped with the reason otherwise. Every
job and poprun-lite runs under a timeout."""

import pytest

from popdist_lite_launcher.testing import slurm_cluster

REASON = slurm_cluster.unavailable()


@pytest.fixture(scope="session")
def cluster():
    """The cluster, for the whole session (stopped and removed at its end, also when a
    test failed)."""
    if REASON:
        pytest.skip(REASON)
    with slurm_cluster.TestCluster(2) as made:
        yield made
