"""A node lost mid-run on the test cluster (pdls1, pdls2): every process on pdls2 is
killed, its slurmd included, once the job has saved the checkpoint of step 2 and holds
after its third step, ``Step 2, loss`` (the Shakespeare example's ``--test-hold-at``, a
count of polls, so that the loss meets the job at a known step whatever the machine's
speed). The job is submitted with ``sbatch --no-kill``, so the allocation outlives the
node.

- ``--max-restarts 1``: the next attempt leaves pdls2 out (the probe through Slurm
  fails there at once; Slurm itself marks it down only after ``SlurmdTimeout``) and
  finishes on pdls1 from the checkpoint, with the replicas pdls1's task slots hold.
  Under both MPIs: the second attempt's launch differs (Open MPI starts the ranks on
  the batch node itself; MPICH's hydra starts its proxy there through ``srun``, a step
  that must not wait for the first attempt's step on the lost node).
- ``--min-replicas 2`` (an elastic job whose hosts are the allocation's usable nodes):
  the same, pdls2 being a host lost. One MPI (Open MPI): the second attempt's launch is
  the fixed job's, tested under both.
- no option: the job fails with a report naming pdls2 and the replicas on it, and why
  pdls2 counts as lost without probing it again after the failed cleanup. One MPI
  (Open MPI): what notices the loss and reports it is poprun-lite's (the agents'
  connections and the probe through Slurm), the same under both.

Every job runs under a timeout; the tests wait for files and lines, never for a time.
pdls2's slurmd is started again after each test (``TestCluster.restart_node``)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from slurmjob import MPIS, REPORT, batch_script, mpi_env, poprun_command, wait_for

STEPS = 4
SAVED = 2     # --checkpoint-every: the checkpoint of step 2 is the one resumed from
HOLD_AT = 3   # the job holds after step index 2 ("Step 2, loss") until pdls2 is lost
#: The checkpoint within 180 s, the job's end within 240 s, pdls2 back within 60 s.
pytestmark = pytest.mark.timeout(540)


def _command(cluster, mpi: str, name: str, *options: str) -> tuple[list[str], Path]:
    ckpt = cluster.work / f"ckpt-{name}"
    command = [*poprun_command(cluster, mpi, STEPS, *options), "--checkpoint-dir", str(ckpt),
               "--checkpoint-every", str(SAVED), "--resume", "--test-hold-at", str(HOLD_AT),
               "--data-order", "global", "--global-batch-size", "16"]
    return command, ckpt


def _lose_pdls2(cluster, mpi: str, name: str, *options: str) -> str:
    """Run the job with ``options`` in ``sbatch --no-kill -N 2``, kill pdls2 once the
    checkpoint of step 2 is saved, wait for the end of the batch script; its output."""
    command, ckpt = _command(cluster, mpi, name, *options)
    out = cluster.work / f"{name}.out"
    script = batch_script(cluster, name, command)
    submitted = cluster.run(["sbatch", "--parsable", "--no-kill", "-N", "2", "--ntasks-per-node", "2",
                             "-o", str(out), str(script)],
                            env=cluster.env({**os.environ, **mpi_env(mpi)}))
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]

    def said() -> str:
        return out.read_text() if out.exists() else ""

    try:
        wait_for(lambda: (ckpt / f"step-{SAVED:08d}" / "manifest.json").exists()
                 and f"Step {HOLD_AT - 1}, loss" in said(), "checkpoint of step 2", 180, said)
        cluster.kill_node("pdls2")
        # the batch script's end (poprun-lite exec'd it): the job leaves RUNNING; it stays
        # COMPLETING until pdls2 is back or marked down (SlurmdTimeout), which is not waited for
        wait_for(lambda: cluster.run(["squeue", "-h", "-j", job, "-o", "%T"]).stdout.strip()
                 in ("", "COMPLETING"), "end of the job's batch script", 240, said)
    finally:
        cluster.run(["scancel", job])
        cluster.restart_node("pdls2")
    return out.read_text()


def _check_resumed_on_pdls1(after: str) -> None:
    """The second attempt's output ``after``: its two replicas on pdls1, resumed from the
    checkpoint of step SAVED, every step from there to the end once."""
    assert sorted(REPORT.findall(after)) == [("0", "pdls1"), ("1", "pdls1")], after
    assert re.search(rf"^resumed from \S+ \(step {SAVED}\)$", after, re.M), after
    steps = [int(n) for n in re.findall(r"^Step (\d+), loss = ", after, re.M)]
    assert steps == list(range(SAVED, STEPS)), after


@pytest.mark.parametrize("mpi", MPIS)
def test_lost_node_with_max_restarts(cluster, mpi):
    """``--max-restarts 1``: attempt 2 runs on pdls1 alone, resumes from step 2 and
    finishes all the steps."""
    output = _lose_pdls2(cluster, mpi, f"lost-restart-{mpi}", "--max-restarts", "1")
    assert re.search(r"^poprun-lite: Slurm node pdls2 lost: ", output, re.M), output
    assert re.search(r"^poprun-lite: attempt 2 of 2: 2 replicas on pdls1 \(2\), after host pdls2 lost",
                     output, re.M), output
    assert re.search(r"^poprun-lite: job succeeded on attempt 2 of 2", output, re.M), output
    after = output[output.index("attempt 2 of 2"):]
    _check_resumed_on_pdls1(after)


def test_lost_node_with_min_replicas(cluster):
    """``--min-replicas 2``: attempt 2 runs on pdls1 alone, resumes from step 2 and
    finishes all the steps."""
    output = _lose_pdls2(cluster, "openmpi", "lost-elastic", "--min-replicas", "2")
    assert re.search(r"^poprun-lite: attempt 2: 2 replicas on pdls1 \(2\), after host pdls2 lost",
                     output, re.M), output
    assert re.search(r"^poprun-lite: job succeeded on attempt 2", output, re.M), output
    after = output[output.index("poprun-lite: attempt 2:"):]
    _check_resumed_on_pdls1(after)


def test_lost_node_without_restarts(cluster):
    """No ``--max-restarts`` or ``--min-replicas``: the job fails; the report names
    pdls2 and a replica on it."""
    output = _lose_pdls2(cluster, "openmpi", "lost-fail")
    # in Slurm's words (not responding) or the cleanup's, which reached pdls2 just
    # before: never a second contact (each costs Slurm's MessageTimeout on a dead node)
    assert re.search(r"^poprun-lite: Slurm node pdls2 lost: (node pdls2 of Slurm job \d+ is \S+|host pdls2 is "
                     r"not reachable with the launch agent '\S+srun-agent': the cleanup after the attempt: )",
                     output, re.M), output
    assert "poprun-lite: not restarting without node pdls2" in output, output
    report = output[output.index("poprun-lite: job failed"):]
    assert re.search(r"replica [23] \(rank [23], host pdls2, pid \d+\)", report), report
    assert "attempt 2" not in output, output
