#!/usr/bin/env python3
"""What running under Slurm costs (docs/slurm.md), on the test cluster of
popdist_lite_launcher.testcluster (2 nodes, 2 tasks each):

- ``cluster_up_s``, ``cluster_down_s``: starting the cluster until both nodes are idle,
  and removing it;
- ``srun_job_s``: in a batch script of ``sbatch -N 2 --ntasks-per-node 2``, the time
  ``srun true`` takes (one step of 4 tasks: Slurm's own launch);
- ``poprun_job_s[MPI]``: the time ``poprun-lite true`` takes there instead (4 replicas,
  two on each node, the other node's through mpirun's Slurm launch; the host check and
  the cleanup are steps too), under Open MPI and, with POPDIST_LITE_MPICH_PYTHON,
  MPICH;
- ``scancel_to_empty_s[MPI]``: a job running ``poprun-lite sleep 600`` is cancelled once
  every replica's ``sleep`` runs; the time until no process of it is left on any node
  (``ip netns pids``, polled every 20 ms).

    python scripts/bench_slurm.py [--runs 3]

prints one JSON object on stdout (medians over ``--runs``, every run's figures in
``all``, the load average before and after). Needs root and Debian's slurm-wlm and
munge. Every job runs under a timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from popdist_lite_launcher import testcluster

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


def scancel_to_empty(cluster, python: str, env: dict) -> float:
    submitted = cluster.run(["sbatch", "--parsable", "-N", "2", "--ntasks-per-node", "2", "-o",
                             str(cluster.work / "bench.out"), "--wrap",
                             f"exec {python} -m popdist_lite_launcher sleep 600"],
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


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    reason = testcluster.unavailable()
    if reason:
        sys.exit(f"bench_slurm: {reason}")
    load_before = os.getloadavg()
    runs: list[dict] = []
    for _ in range(args.runs):
        run: dict = {}
        start = time.monotonic()
        cluster = testcluster.TestCluster(2)
        with cluster:
            run["cluster_up_s"] = time.monotonic() - start
            run["srun_job_s"] = timed_job(cluster, "srun true", cluster.env())
            for mpi, python in mpis().items():
                env = mpi_env(cluster, python, mpi)
                run[f"poprun_job_s[{mpi}]"] = timed_job(
                    cluster, f"{python} -m popdist_lite_launcher true", env)
                run[f"scancel_to_empty_s[{mpi}]"] = scancel_to_empty(cluster, python, env)
            down = time.monotonic()
        run["cluster_down_s"] = time.monotonic() - down
        runs.append(run)
    result = {key: round(statistics.median(r[key] for r in runs), 3) for key in runs[0]}
    result.update(runs=args.runs, all=[{k: round(v, 3) for k, v in r.items()} for r in runs],
                  load_before=load_before, load_after=os.getloadavg(), cpus=os.cpu_count())
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
