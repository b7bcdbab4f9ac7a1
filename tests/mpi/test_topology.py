"""Topology under plain mpirun (no POPDIST_* variables): replicas = COMM_WORLD."""

import os

import numpy as np
import pytest
from mpi4py import MPI

import popdist_lite as pl


@pytest.mark.mpi
def test_plain_mpirun_topology(comm):
    world = MPI.COMM_WORLD
    assert not pl.is_popdist_env_set() and not pl.isPopdistEnvSet()
    assert pl.replica_id() == world.rank == pl.getReplicaIndexOffset() == pl.getInstanceIndex()
    assert pl.num_replicas() == world.size == pl.getNumTotalReplicas() == pl.getNumInstances()
    assert pl.getNumLocalReplicas() == 1 and pl.getNumIpusPerReplica() == 1 and pl.getLocalInstanceIndex() == 0
    assert pl.role() == "replica" and comm.size == world.size and comm.rank == world.rank
    pl.init()  # idempotent
    assert pl.replica_comm() is comm


@pytest.mark.mpi
def test_execute_on_instances(comm):
    got = pl.execute_on_instances({0}, lambda a, b=0: a + b + pl.replica_id(), 1, b=2)
    assert got == (3 if comm.rank == 0 else None)
    flags = pl.all_gather(np.array(pl.execute_on_instances({comm.size - 1}, lambda: 1) or 0))
    np.testing.assert_array_equal(flags, [0] * (comm.size - 1) + [1])
