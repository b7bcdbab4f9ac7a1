"""One process, no launcher: one replica, and the library still works."""

import os
import subprocess
import sys

import numpy as np

from helpers import run_python, timeout_for

pytestmark = timeout_for(1)


def test_single_process_is_one_replica():
    code = """
import numpy as np, popdist_lite as pl
pl.init()
assert (pl.replica_id(), pl.num_replicas(), pl.num_instances()) == (0, 1, 1)
x = np.arange(6.0).reshape(1, 6)
assert np.array_equal(pl.reduce_scatter_sum(x), x[0])
emb = pl.create_host_embedding("t", shape=[10, 3], partition_strategy="ENCODING")
assert emb.local_shard.shape == (10, 3)
print("OK")
"""
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout


def test_popdist_variables_are_checked_against_the_job():
    code = "import popdist_lite as pl; pl.init()"
    result = run_python(code, env={"POPDIST_NUM_TOTAL_REPLICAS": "2", "POPDIST_REPLICA_INDEX_OFFSET": "0"})
    assert result.returncode != 0
    assert "POPDIST_NUM_TOTAL_REPLICAS: expected 1 (the number of replica ranks in this MPI job), got 2" in result.stderr


def test_popdist_names_read_the_environment():
    code = "import popdist_lite as pl; print(pl.getNumTotalReplicas(), pl.getReplicaIndexOffset(), pl.getNumIpusPerReplica(), pl.isPopdistEnvSet())"
    result = run_python(code, env={"POPDIST_NUM_TOTAL_REPLICAS": "1", "POPDIST_REPLICA_INDEX_OFFSET": "0",
                                   "POPDIST_NUM_IPUS_PER_REPLICA": "4"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "0", "4", "True"]
