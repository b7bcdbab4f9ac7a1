"""examples/slurm/shakespeare.sbatch on the test cluster: the job is requeued after its
first checkpoint and its second start resumes from that checkpoint."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from slurmjob import ROOT, wait_for

SCRIPT = ROOT / "examples" / "slurm" / "shakespeare.sbatch"
TEXT = ("ROMEO.\nBut soft, what light through yonder window breaks?\n"
        "It is the east, and Juliet is the sun.\n\n") * 20


def test_requeued_job_resumes_from_its_checkpoint(cluster):
    data, checkpoints = cluster.work / "example.txt", cluster.work / "example-ckpt"
    data.write_text(TEXT)
    out = cluster.work / "example.out"
    env = cluster.env({**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                       "DATA": str(data), "STEPS": "100000", "CHECKPOINT_EVERY": "2",
                       "CHECKPOINTS": str(checkpoints)})
    submitted = cluster.run(["sbatch", "--parsable", "-o", str(out), str(SCRIPT)], env=env, cwd=ROOT)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]

    def text():
        return out.read_text() if out.exists() else ""

    def state():
        return cluster.run(["squeue", "-h", "-j", job, "-o", "%T"]).stdout.strip()

    try:
        first = wait_for(lambda: sorted(checkpoints.glob("step-*")), "checkpoint", 150)[0]
        requeued = cluster.run(["scontrol", "requeue", job])
        assert requeued.returncode == 0, requeued.stderr
        wait_for(lambda: state() == "PENDING", "pending job after the requeue", 60)
        # an administrator's nudge: a requeued job is held back for a while (BeginTime);
        # only once the first run has left the nodes, and 2 s on (slurmd refuses the job's
        # credentials issued up to the second it revoked the first run's: "Job credential
        # revoked", test_slurm_preempt)
        wait_for(lambda: "start 1" in text() or set(cluster.run(
            ["sinfo", "-h", "-N", "-o", "%T"]).stdout.split()) == {"idle"}, "idle nodes", 120)
        wait_for(lambda: "start 1" in text() or cluster.run(
            ["scontrol", "update", f"JobId={job}", "StartTime=now+2"]).returncode == 0, "StartTime=now+2", 60)
        resumed = wait_for(lambda: re.search(r"^resumed from (\S+) \(step (\d+)\)$", text(), re.M),
                           "resumed second start", 150)
    finally:
        cluster.run(["scancel", job])
    output = text()
    assert f"job {job} on pdls[1-2], start 0" in output and f"start 1" in output, output
    assert "no checkpoint in" in output.split("start 1")[0], output
    assert int(resumed[2]) >= int(first.name.split("-")[1]), output
    assert Path(resumed[1]).parent == checkpoints, output
    wait_for(lambda: not any(cluster.job_processes(node) for node in cluster.nodes),
             "empty nodes after scancel", 10)
