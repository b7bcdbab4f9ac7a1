"""Multi-host tests on network-namespace test hosts (popdist_lite_launcher.testing.netns_hosts).

They run where root, iproute2 and network namespaces are available and are skipped
with the reason otherwise. Every poprun-lite/mpirun runs under a timeout.
"""

import pytest

from popdist_lite_launcher.testing import netns_hosts

REASON = netns_hosts.unavailable()


@pytest.fixture(scope="session")
def hosts():
    """Two test hosts, pdlh1 and pdlh2, for the whole session (removed at its end)."""
    if REASON:
        pytest.skip(REASON)
    with netns_hosts.TestHosts(2) as made:
        yield made
