"""The failure report under Slurm (``--launcher slurm``, no -H): the records' identity
comes from each rank's agent on its node, so the report names the node (its hostname,
pdls2, not localhost or an address) and the rank. One MPI (Open MPI): records travel
from the agents to poprun-lite's collector over the job's network the same way under
MPICH (only how mpirun starts its daemons differs, which tests/slurm/test_slurm_launch.py
covers under both). Every job runs under a timeout."""

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
