#!/usr/bin/env python3
"""What running under Slurm costs (docs/slurm.md), on the test cluster of
popdist_lite_launcher.testing.slurm_cluster (2 nodes, 2 tasks each):

- ``cluster_up_s``, ``cluster_down_s``: starting the cluster until both nodes are idle,
  and removing it;
- ``srun_job_s``: in a batch script of ``sbatch -N 2 --ntasks-per-node 2``, the time
  ``srun true`` takes (one step of 4 tasks: Slurm's own launch);
- ``poprun_job_s[MPI]``: the time ``poprun-lite true`` takes there instead (4 replicas,
  two on each node, the other node's through mpirun's Slurm launch; the host check and
  the cleanup are steps too), under Open MPI and, with POPDIST_LITE_MPICH_PYTHON,
  MPICH;
- ``scancel_to_empty_s[MPI]``: a job running ``poprun-lite --preemption off sleep 600``
  is cancelled once every replica's ``sleep`` runs; the time until no process of it is
  left on any node (``ip netns pids``, polled every 20 ms);
- ``scancel_preempted_to_empty_s[MPI]``: the same with preemption on (the default in an
  allocation): the job's processes hold Slurm's SIGTERM and poprun-lite asks the
  replicas for a checkpoint; ``sleep`` reaches no step boundary, so the job ends when
  the grace (Slurm's KillWait less 2 s: 3 s here) is over;
- ``sbatch_to_first_step_s[MPI]``: from running ``sbatch -N 2 --ntasks-per-node 2`` (the
  batch script ``exec``s poprun-lite, 4 replicas of the Shakespeare example on a tiny
  text, the other node's through Slurm) until its output file holds ``Step 0, loss``
  (polled every 20 ms): scheduling, the batch script's start, the launch, the example's
  imports and its first step;
- ``ssh_to_first_step_s[MPI]``: the same job started from this machine over the test
  hosts' ssh stand-in (``launcher/testing/netns-agent``, ``-H pdls1,pdls2 --launcher ssh``, on the
  cluster's network), from starting poprun-lite until ``Step 0, loss``: every replica
  remote, no scheduler;
- ``signal_to_requeued_first_step_s[MPI]``: ``examples/slurm/shakespeare.sbatch`` (4
  replicas, a checkpoint every 2 steps, ``--requeue``) gets ``scancel --signal=USR1
  --batch`` once it has a checkpoint; the time until the requeued job prints its first
  step. It is the sum of ``signal_to_requeued_s`` (the replicas checkpoint at their next
  step boundary and exit, poprun-lite runs ``scontrol requeue``: the job is pending
  again), ``requeued_to_idle_s`` (Slurm finishes the first run on the nodes) and
  ``idle_to_first_step_s`` (from ``scontrol update StartTime=now+1``, which lifts the
  hold Slurm puts on a requeued job, to the resumed job's first step: the second slurmd
  needs before it accepts the job's new credential, scheduling, the launch, the imports,
  the checkpoint's load). Slurm's hold itself is a cluster's setting and is left out.

The two first-step figures run one after the other in every run, on the same nodes.

    python scripts/bench_slurm.py [--runs 3]

prints one JSON object on stdout (medians over ``--runs``, every run's figures in
``all``, the load average before and after). Needs root and Debian's slurm-wlm and
munge. Every job runs under a timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from popdist_lite_launcher.testing import netns_hosts, slurm_cluster

JOB_TIMEOUT = 180


def mpis() -> dict[str, str]:
    found = {"openmpi": sys.executable}
    if os.environ.get("POPDIST_LITE_MPICH_PYTHON"):
        found["mpich"] = os.environ["POPDIST_LITE_MPICH_PYTHON"]
    return found


def mpi_env(cluster, python: str, mpi: str) -> dict[str, str]:
    bin_dir = Path(python).parent
    mpirun = bin_dir / ("mpiexec" if mpi == "mpich" else "mpirun")
    return cluster.env({**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                        "POPRUN_LITE_MPIRUN": str(mpirun)})


def timed_job(cluster, command: str, env: dict) -> float:
    """Seconds ``command`` took in the batch script (``sbatch --wait`` itself polls the
    job's state every few seconds, too coarse to time it)."""
    out = cluster.work / "bench.out"
    wrap = f's=$(date +%s.%N); {command}; e=$(date +%s.%N); echo "BENCH $s $e"'
    done = cluster.run(["sbatch", "--wait", "-N", "2", "--ntasks-per-node", "2", "-o",
                        str(out), "--wrap", wrap], timeout=JOB_TIMEOUT, env=env, cwd=cluster.work)
    text = out.read_text(errors="replace")
    times = [line.split()[1:] for line in text.splitlines() if line.startswith("BENCH ")]
    if done.returncode != 0 or len(times) != 1:
        raise RuntimeError(f"job {command!r} failed: {done.stderr}\n{text[-2000:]}")
    return float(times[0][1]) - float(times[0][0])


def scancel_to_empty(cluster, python: str, env: dict, preemption: str) -> float:
    submitted = cluster.run(["sbatch", "--parsable", "-N", "2", "--ntasks-per-node", "2", "-o",
                             str(cluster.work / "bench.out"), "--wrap",
                             f"exec {python} -m popdist_lite_launcher --preemption {preemption} sleep 600"],
                            env=env, cwd=cluster.work)
    job = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + JOB_TIMEOUT

    def sleeping(node):
        return sum(1 for pid in cluster.job_processes(node) if _comm(pid) == "sleep")

    try:
        while not all(sleeping(node) == 2 for node in cluster.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the replicas' sleep did not start")
            time.sleep(0.05)
    finally:
        start = time.monotonic()
        cluster.run(["scancel", job])
    while any(cluster.job_processes(node) for node in cluster.nodes):
        if time.monotonic() > start + 60:
            raise RuntimeError("processes left 60 s after scancel")
        time.sleep(0.02)
    return time.monotonic() - start


TEXT = ("ROMEO.\nBut soft, what light through yonder window breaks?\n"
        "It is the east, and Juliet is the sun.\n\n") * 20
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "shakespeare.py"


def example(cluster, python: str) -> list[str]:
    """The Shakespeare example for 2 steps on a tiny text every node sees."""
    data = cluster.work / "bench.txt"
    data.write_text(TEXT)
    return [python, str(EXAMPLE), "--data", str(data), "--steps", "2", "--seq-len", "20",
            "--batch-size", "4", "--log-every", "1", "--sample-chars", "5"]


def first_step(out: Path, start: float, what: str) -> float:
    """Seconds from ``start`` until ``out`` holds ``Step 0, loss`` (polled every 20 ms)."""
    while True:
        try:
            if "Step 0, loss" in out.read_text(errors="replace"):
                return time.monotonic() - start
        except OSError:
            pass
        if time.monotonic() > start + JOB_TIMEOUT:
            text = out.read_text(errors="replace") if out.exists() else ""
            raise RuntimeError(f"{what}: no first step within {JOB_TIMEOUT} s:\n{text[-2000:]}")
        time.sleep(0.02)


def sbatch_to_first_step(cluster, python: str, env: dict) -> float:
    out = cluster.work / "bench-first.out"
    out.unlink(missing_ok=True)
    script = cluster.work / "bench-first.sh"
    command = [python, "-m", "popdist_lite_launcher", "--timeout", str(JOB_TIMEOUT),
               *example(cluster, python)]
    script.write_text(f"#!/bin/bash\nexec {shlex.join(command)}\n")
    start = time.monotonic()
    submitted = cluster.run(["sbatch", "--parsable", "-N", "2", "--ntasks-per-node", "2", "-o",
                             str(out), str(script)], env=env, cwd=cluster.work)
    if submitted.returncode != 0:
        raise RuntimeError(f"sbatch failed: {submitted.stderr}")
    job = submitted.stdout.strip().split(";")[0]
    try:
        took = first_step(out, start, f"sbatch job {job}")
        deadline = time.monotonic() + JOB_TIMEOUT
        while cluster.run(["squeue", "-h", "-j", job]).stdout.strip():
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job} did not end")
            time.sleep(0.2)
    finally:
        cluster.run(["scancel", job])
    if "Step 1, loss" not in out.read_text(errors="replace"):
        raise RuntimeError(f"job {job} failed:\n{out.read_text(errors='replace')[-2000:]}")
    return took


REQUEUE_SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "slurm" / "shakespeare.sbatch"


def signal_to_requeued_first_step(cluster, python: str, env: dict) -> dict[str, float]:
    out = cluster.work / "bench-requeue.out"
    out.unlink(missing_ok=True)
    checkpoints = cluster.work / "bench-requeue-checkpoints"
    shutil.rmtree(checkpoints, ignore_errors=True)  # every run starts at step 0
    data = cluster.work / "bench.txt"
    data.write_text(TEXT)
    env = {**env, "DATA": str(data), "STEPS": "100000", "CHECKPOINT_EVERY": "2",
           "CHECKPOINTS": str(checkpoints)}
    submitted = cluster.run(["sbatch", "--parsable", "-o", str(out), str(REQUEUE_SCRIPT), "--log-every", "1"],
                            env=env, cwd=REQUEUE_SCRIPT.parents[2])
    if submitted.returncode != 0:
        raise RuntimeError(f"sbatch failed: {submitted.stderr}")
    job = submitted.stdout.strip().split(";")[0]

    def text() -> str:
        return out.read_text(errors="replace") if out.exists() else ""

    def until(predicate, what: str, poll: float = 0.02) -> float:
        start = time.monotonic()
        while not predicate():
            if time.monotonic() > start + JOB_TIMEOUT:
                raise RuntimeError(f"job {job}: no {what} within {JOB_TIMEOUT} s:\n{text()[-2000:]}")
            time.sleep(poll)
        return time.monotonic() - start

    def state() -> str:
        return cluster.run(["squeue", "-h", "-j", job, "-o", "%T"]).stdout.strip()

    def resumed_step() -> bool:
        second = text().partition("start 1")[2]
        return "resumed from" in second and "Step " in second.partition("resumed from")[2]

    try:
        until(lambda: any(checkpoints.glob("step-*")), "checkpoint", 0.2)
        start = time.monotonic()
        signalled = cluster.run(["scancel", "--signal=USR1", "--batch", job])
        if signalled.returncode != 0:
            raise RuntimeError(f"scancel --signal failed: {signalled.stderr}")
        phases = {"signal_to_requeued_s": until(lambda: "start 1" in text() or state() == "PENDING",
                                                "requeue", 0.05)}
        phases["requeued_to_idle_s"] = until(lambda: "start 1" in text() or set(cluster.run(
            ["sinfo", "-h", "-N", "-o", "%T"]).stdout.split()) == {"idle"}, "idle nodes", 0.05)
        nudged = time.monotonic()
        cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now+1"])
        until(resumed_step, "first step of the requeued job")
        phases["idle_to_first_step_s"] = time.monotonic() - nudged
        phases["signal_to_requeued_first_step_s"] = time.monotonic() - start
    finally:
        cluster.run(["scancel", job])
    return phases


def ssh_to_first_step(cluster, python: str, env: dict) -> float:
    out = cluster.work / "bench-ssh.out"
    command = [python, "-m", "popdist_lite_launcher", "--timeout", str(JOB_TIMEOUT),
               "-H", ",".join(cluster.nodes), "--launcher", "ssh", "--num-replicas", "4",
               "--launch-agent", netns_hosts.LAUNCH_AGENT, "--network-interface",
               f"{slurm_cluster.SUBNET}.0/24", *example(cluster, python)]
    with open(out, "w") as sink:
        start = time.monotonic()
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, cwd=cluster.work)
        try:
            took = first_step(out, start, "ssh job")
            code = proc.wait(timeout=JOB_TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if code != 0:
        raise RuntimeError(f"ssh job failed ({code}):\n{out.read_text(errors='replace')[-2000:]}")
    return took


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    reason = slurm_cluster.unavailable()
    if reason:
        sys.exit(f"bench_slurm: {reason}")
    uptime_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    load_before = os.getloadavg()
    runs: list[dict] = []
    for _ in range(args.runs):
        run: dict = {}
        start = time.monotonic()
        cluster = slurm_cluster.TestCluster(2)
        with cluster:
            run["cluster_up_s"] = time.monotonic() - start
            run["srun_job_s"] = timed_job(cluster, "srun true", cluster.env())
            for mpi, python in mpis().items():
                env = mpi_env(cluster, python, mpi)
                run[f"poprun_job_s[{mpi}]"] = timed_job(
                    cluster, f"{python} -m popdist_lite_launcher true", env)
                run[f"scancel_to_empty_s[{mpi}]"] = scancel_to_empty(cluster, python, env, "off")
                run[f"scancel_preempted_to_empty_s[{mpi}]"] = scancel_to_empty(cluster, python, env, "auto")
                run[f"sbatch_to_first_step_s[{mpi}]"] = sbatch_to_first_step(cluster, python, env)
                run[f"ssh_to_first_step_s[{mpi}]"] = ssh_to_first_step(cluster, python, env)
                for key, value in signal_to_requeued_first_step(cluster, python, env).items():
                    run[f"{key}[{mpi}]"] = value
            down = time.monotonic()
        run["cluster_down_s"] = time.monotonic() - down
        runs.append(run)
    result = {key: round(statistics.median(r[key] for r in runs), 3) for key in runs[0]}
    result.update(runs=args.runs, all=[{k: round(v, 3) for k, v in r.items()} for r in runs],
                  load_before=load_before, load_after=os.getloadavg(), cpus=os.cpu_count(),
                  uptime_before=uptime_before,
                  uptime_after=subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
