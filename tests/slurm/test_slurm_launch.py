"""poprun-lite inside a Slurm allocation on the test cluster (two nodes, pdls1 and pdls2),
with no -H: hosts, slots and --num-replicas come from the allocation and every process
on the other node starts through Slurm (Open MPI's slurm plm, MPICH's -launcher slurm),
so that ``scancel`` ends them all. Under both MPIs (MPICH: POPDIST_LITE_MPICH_PYTHON).
Every job runs under a timeout; the tests wait for files and process lists, never for
a time."""

from __future__ import annotations

import json
import os
import re
import socket
import time

import pytest

from popdist_lite_launcher.testing import slurm_cluster
from slurmjob import MPIS, REPORT, ROOT, batch_script, mpi_env, poprun_command, python_of, wait_for


def check_run(output: str, mpi: str, replicas: int = 4) -> None:
    """Every replica reported a node, two on each; the job ran through Slurm."""
    reports = dict(REPORT.findall(output))
    assert sorted(map(int, reports)) == list(range(replicas)), output
    assert sorted(reports.values()) == ["pdls1", "pdls1", "pdls2", "pdls2"], output
    assert re.search(r"^slurm job \d+: 2 node\(s\) pdls\[1-2\], 4 task\(s\): pdls1 2, pdls2 2; "
                     r"launcher slurm$", output, re.M), output
    assert ("--prtemca plm slurm" if mpi == "openmpi" else "-launcher slurm") in output, output
    assert "plm_ssh_agent" not in output and "-launcher ssh" not in output, output
    assert re.search(r"^Step 2, loss = ", output, re.M), output


@pytest.mark.parametrize("mpi", MPIS)
def test_sbatch(cluster, mpi):
    """``sbatch -N 2``: poprun-lite in the batch script on pdls1, with ``--timeline``. The
    nodes' names do not resolve (only Slurm knows their addresses, ``NodeAddr``), as in
    every test on this cluster."""
    for node in cluster.nodes:
        with pytest.raises(socket.gaierror):
            socket.getaddrinfo(node, None)
    out, trace = cluster.work / f"sbatch-{mpi}.out", cluster.work / f"sbatch-{mpi}.json"
    script = batch_script(cluster, f"sbatch-{mpi}", poprun_command(cluster, mpi, 3, "--timeline", str(trace)))
    done = cluster.run(["sbatch", "--wait", "-N", "2", "--ntasks-per-node", "2", "-o", str(out),
                        str(script)], timeout=240, env=cluster.env({**os.environ, **mpi_env(mpi)}))
    output = out.read_text() if out.exists() else ""
    assert done.returncode == 0, f"{done.stdout}{done.stderr}\n{output}"
    check_run(output, mpi)
    # the timeline (written by poprun-lite on pdls1 from the agents' timeline records):
    # each replica's track labelled with the node it ran on, as the replicas reported it
    events = json.loads(trace.read_text())["traceEvents"]
    labels = {e["pid"]: e["args"]["labels"] for e in events if e["name"] == "process_labels"}
    assert labels == {int(r): host for r, host in REPORT.findall(output)}, labels
    assert {e["pid"] for e in events if e["ph"] == "X" and e["name"] == "all_reduce"} == {0, 1, 2, 3}


#: The step each MPI's Slurm launch makes for its daemons (named by poprun-lite: both
#: start through launcher/node/hold_signals.py) and the nodes it spans.
DAEMON_STEP = {"openmpi": ("prted", "pdls2"), "mpich": ("hydra_pmi_proxy", "pdls[1-2]")}


@pytest.mark.parametrize("mpi", MPIS)
def test_sacct_lists_the_steps(cluster, mpi):
    """Slurm's accounting (slurmdbd, ``sacct``) of a poprun-lite job: the batch step, the
    MPI daemons' step and poprun-lite's own steps on pdls2 (the host check before the
    launch, the cleanup after it: ``srun --overlap`` steps named poprun-lite-agent),
    each COMPLETED."""
    if not cluster.accounting:
        pytest.skip(slurm_cluster.accounting_unavailable())
    out = cluster.work / f"sacct-{mpi}.out"
    script = batch_script(cluster, f"sacct-{mpi}", poprun_command(cluster, mpi, 1))
    done = cluster.run(["sbatch", "--parsable", "--wait", "-N", "2", "--ntasks-per-node", "2", "-o", str(out),
                        str(script)], timeout=240, env=cluster.env({**os.environ, **mpi_env(mpi)}))
    assert done.returncode == 0, f"{done.stdout}{done.stderr}\n{out.read_text() if out.exists() else ''}"
    job = done.stdout.strip().split(";")[0]
    daemon, nodes = DAEMON_STEP[mpi]

    def steps():  # accounting records arrive after the job's end
        shown = cluster.run(["sacct", "-j", job, "-P", "-n", "-o", "JobID,JobName,NodeList,State"])
        rows = [line.split("|") for line in shown.stdout.splitlines() if line.count("|") == 3]
        names = {(name, where, state) for step, name, where, state in rows if step.startswith(f"{job}.")}
        return names if (daemon, nodes, "COMPLETED") in names else None

    found = wait_for(steps, f"the {daemon} step in sacct", 60)
    assert ("batch", "pdls1", "COMPLETED") in found, found
    agents = [row for row in found if row[0] == "poprun-lite-agent"]
    assert agents and all(row[1:] == ("pdls2", "COMPLETED") for row in agents), found


@pytest.mark.parametrize("mpi", MPIS)
def test_salloc(cluster, mpi):
    """``salloc -N 2`` on the login node: every rank on another node."""
    done = cluster.on_node(cluster.login, ["salloc", "-N", "2", "--ntasks-per-node", "2",
                                           *poprun_command(cluster, mpi, 3)], timeout=240,
                           env=cluster.env({**os.environ, **mpi_env(mpi)}), cwd=ROOT)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    check_run(output, mpi)


@pytest.mark.parametrize("mpi", MPIS)
def test_program_cannot_read_the_key(cluster, mpi):
    """``sbatch -N 2``: four replicas (two on the launcher's node, two on the other, whose
    key files srun-agent wrote) hunt the job's key in their environments, every
    ancestor's (agent, MPI's daemon, slurmstepd) and the key file they find
    (tests/keyhunt.py): none is found and every key file is gone."""
    from keyhunt import HUNT, check_nothing_found, hunts, recording_launcher

    python = python_of(mpi)
    keys, out = cluster.work / f"keys-{mpi}", cluster.work / f"keyhunt-{mpi}.out"
    keys.unlink(missing_ok=True)
    script = batch_script(cluster, f"keyhunt-{mpi}", recording_launcher(python, keys, "--timeout", "150",
                                                                        python, HUNT))
    done = cluster.run(["sbatch", "--wait", "-N", "2", "--ntasks-per-node", "2", "-o", str(out),
                        str(script)], timeout=240, env=cluster.env({**os.environ, **mpi_env(mpi)}))
    output = out.read_text() if out.exists() else ""
    assert done.returncode == 0, f"{done.stdout}{done.stderr}\n{output}"
    found = hunts(output)
    assert sorted(h["host"] for h in found) == ["pdls1", "pdls1", "pdls2", "pdls2"], output
    check_nothing_found(found, keys.read_text().split(), 4, 2, output)


@pytest.mark.parametrize("mpi", MPIS)
def test_scancel_leaves_nothing(cluster, mpi):
    """``scancel`` of a running job: within 10 s no process of it is left on any node
    (the ranks on pdls2 were started through Slurm steps, which it ends)."""
    out = cluster.work / f"scancel-{mpi}.out"
    script = batch_script(cluster, f"scancel-{mpi}", poprun_command(cluster, mpi, 100000))
    submitted = cluster.run(["sbatch", "--parsable", "-N", "2", "--ntasks-per-node", "2", "-o",
                             str(out), str(script)], env=cluster.env({**os.environ, **mpi_env(mpi)}))
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    try:
        wait_for(lambda: out.exists() and len(REPORT.findall(out.read_text())) == 4
                 and "Step 1, loss" in out.read_text(), "report of every replica", 150)
        steps = cluster.run(["squeue", "-h", "-s", "-j", job, "-o", "%i %j"]).stdout
        # mpirun's daemons on pdls2 run as a step of the job (the host check and the
        # cleanup are steps named poprun-lite-agent)
        daemons = [line for line in steps.splitlines()
                   if re.fullmatch(rf"{job}\.\d+ \S+", line) and not line.endswith("poprun-lite-agent")]
        assert daemons, steps
        for node in cluster.nodes:
            assert cluster.job_processes(node), f"nothing of the job runs on {node}"
    finally:
        cancelled = cluster.run(["scancel", job])
    assert cancelled.returncode == 0, cancelled.stderr
    start = time.monotonic()
    wait_for(lambda: not any(cluster.job_processes(node) for node in cluster.nodes),
             "empty nodes after scancel", 10)
    print(f"nodes empty {time.monotonic() - start:.2f} s after scancel")
