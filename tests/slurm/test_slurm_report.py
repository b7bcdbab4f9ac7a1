"""The failure report and the stall inspector under Slurm (``--launcher slurm``, no
-H): the records' identity comes from each rank's agent on its node, so the report and
the stall block name the node (its hostname, pdls2, not localhost or an address) and the
rank. One MPI (Open MPI): records travel from the agents to poprun-lite's collector
over the job's network the same way under MPICH (only how mpirun starts its daemons
differs, which tests/slurm/test_slurm_launch.py covers under both; its sbatch test also
checks the timeline's node labels). Every job runs under a timeout."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from slurmjob import batch_script, mpi_env

ROOT = Path(__file__).resolve().parents[2]
PROG = ROOT / "tests" / "progs" / "hosts_prog.py"


def test_failure_report_names_the_node_and_rank(cluster):
    """Replica 3 (rank 3, on pdls2) raises after a collective; the others wait outside
    MPI: the report's root cause is replica 3 on host pdls2, with its traceback."""
    out = cluster.work / "report.out"
    command = [sys.executable, "-m", "popdist_lite_launcher", "--timeout", "150",
               "--print-topology", sys.executable, str(PROG), "raise", "3"]
    script = batch_script(cluster, "report", command)
    done = cluster.run(["sbatch", "--wait", "-N", "2", "--ntasks-per-node", "2", "-o", str(out),
                        str(script)], timeout=240, env=cluster.env({**os.environ, **mpi_env("openmpi")}))
    output = out.read_text() if out.exists() else ""
    assert done.returncode == 1, f"{done.stdout}{done.stderr}\n{output}"  # not 124: the failure ended it
    assert re.search(r"launcher slurm$", output, re.M), output
    report = output[output.index("poprun-lite: job failed"):]
    assert re.search(r"^root cause: replica 3 \(rank 3, host pdls2, pid \d+\): exit code 1$", report,
                     re.M), report
    assert "KeyError: 'boom on pdls2'" in report, report
    hosts = set(re.findall(r"\(rank \d+, host (\S+), pid \d+\)", report))
    assert hosts and hosts <= {"pdls1", "pdls2"}, report


STALLED = '''
import os, sys, time
import numpy as np
import popdist_lite as pl

work = sys.argv[1]
pl.init()
me = pl.replica_id()
open(os.path.join(work, f"ready-{me}"), "w").close()
for r in range(pl.num_replicas()):  # every replica imported and started: no slow start looks stalled
    while not os.path.exists(os.path.join(work, f"ready-{r}")):
        time.sleep(0.01)
x = np.ones(4)
pl.all_reduce(x)                    # collective call #0 (after pl.init's own)


def sleep_before_all_reduce():
    open(os.path.join(work, "missing"), "w").close()
    time.sleep(300)


if me == 3:
    sleep_before_all_reduce()
while not os.path.exists(os.path.join(work, "missing")):
    time.sleep(0.01)
pl.all_reduce(x)
'''


def test_stall_inspector_names_the_node(cluster):
    """Replica 3 (on pdls2) sleeps before an all-reduce the others entered: the stall
    inspector's block names it, its host pdls2 and its Python stack (fetched from its
    agent on pdls2), and ``--stall-timeout`` ends the job with the block as root cause."""
    work = cluster.work / "stall"
    work.mkdir()
    prog = work / "stalled.py"
    prog.write_text(STALLED)
    out = cluster.work / "stall.out"
    command = [sys.executable, "-m", "popdist_lite_launcher", "--timeout", "150", "--stall-warning", "2",
               "--stall-timeout", "5", sys.executable, str(prog), str(work)]
    script = batch_script(cluster, "stall", command)
    done = cluster.run(["sbatch", "--wait", "-N", "2", "--ntasks-per-node", "2", "-o", str(out),
                        str(script)], timeout=240, env=cluster.env({**os.environ, **mpi_env("openmpi")}))
    output = out.read_text() if out.exists() else ""
    assert done.returncode == 1, f"{done.stdout}{done.stderr}\n{output}"  # the stall ended it, not a timeout
    assert re.search(r"^poprun-lite: stall: replicas [0-2, ]+ have waited", output, re.M), output
    assert re.search(r"in all_reduce \(collective call #\d+\) for replica 3, which did not enter it", output), output
    assert re.search(r"missing: replica 3 \(rank 3, host pdls2, pid \d+\)", output), output
    assert "in sleep_before_all_reduce" in output, output
    assert "poprun-lite: job stalled (exit code 1)" in output, output
