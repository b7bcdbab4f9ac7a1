"""Preemption on the test cluster (docs/slurm.md, launcher/slurm/preempt.py): the scheduler's
signals in each form Slurm sends them: to poprun-lite alone, the batch script's
``exec``'d process (``scancel --signal=SIG --batch``, what ``sbatch
--signal=B:USR1@SECONDS`` sends before the time limit), to the job's steps (``scancel
--signal=SIG ID``, ``sbatch --signal=SIG@SECONDS``), to every process (``scancel --full``,
a cancel, a time limit).

The job: tests/progs/hosts_elastic_prog.py, 4 replicas on pdls1 and pdls2, one epoch of
96 numbered samples in 12 steps, a checkpoint every 2 steps. ``--hold 0:5`` keeps the
replicas at the boundary after step 5 (asking should_checkpoint()) until the signal
comes, so the signal meets the job at a known step, after its checkpoints of steps 2
and 4; ``--busy 0:5`` keeps them inside step 5 instead (no boundary in time).

- SIGUSR1 in its four forms, one job requeued four times under Open MPI (``--hold`` at
  steps 1, 3, 5 and 7, one in each run): to the batch shell alone, to the steps, to
  every process (``--full``), and from the time limit (submitted with ``--signal=USR1@150``, its
  ``TimeLimit`` cut so that its end is two minutes away or less: slurmctld sends the
  signal at its next time-limit check, and poprun-lite's grace runs to that end). Each
  time the replicas checkpoint at the next boundary and exit, poprun-lite runs
  ``scontrol requeue``, the job (submitted with ``--requeue``) starts again (an
  administrator's ``scontrol update StartTime=now+2`` instead of Slurm's requeue delay)
  and resumes; the last run finishes: every step taken once by every replica, every
  sample once, and the final checkpoint's arrays bit-identical to an uninterrupted job's
  on the same nodes. Under MPICH the forms that reach its proxies (steps, ``--full``):
  its ranks start through its own Slurm launch, whose daemons hold the signal, and
  every requeued run launches again through it.
- SIGUSR1 to the steps of a one-node job under Open MPI, whose ranks run in no step:
  poprun-lite's watch step gets it, and the replicas checkpoint (``--no-requeue``).
- SIGTERM: the same checkpoint, no requeue (the job leaves the queue); also when Slurm
  signals the job's processes instead of poprun-lite (launcher/node/hold_signals.py):
  ``scancel --signal=TERM ID`` (the steps, as a preemption's GraceTime does) under both
  MPIs, and a plain ``scancel ID`` (every process, as a time limit) on both nodes, where
  it reaches the ranks on the batch node, mpirun and the srun that runs the MPI daemons
  too; and without a boundary in time, the report comes before Slurm's SIGKILL.
- a second SIGTERM while the replicas are busy: stopped at once, no checkpoint, the
  report says so; SIGUSR1 while they are busy: stopped when the grace
  (``--preemption-grace 3``) is over, naming the ranks.
  These three under Open MPI only: what differs between the MPIs is how the ranks
  start, which the SIGUSR1 test covers under both; the signal's path (poprun-lite, the
  collector, the agents) is the same, and the suite's time is kept down.

The tests wait for lines and files under generous deadlines, never for a time; every
job and poprun-lite has a timeout. The uninterrupted job is run once per MPI for the
module (:func:`reference`)."""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest

from popdist_lite.checkpoint.__main__ import export
from popdist_lite_launcher.testing import slurm_cluster
from test_slurm_launch import MPIS, ROOT, mpi_env, python_of, wait_for

PROG = ROOT / "tests" / "progs" / "hosts_elastic_prog.py"
SAMPLES, BATCH, GLOBAL_BATCH = 96, 2, 8  # 12 steps of 8 samples at 4 replicas
STEPS = SAMPLES // GLOBAL_BATCH
TOOK = re.compile(r"TOOK (\d+) (\d+) (\d+)((?: \d+)+)")
ARRAYS = ("table/weights", "table/optimizer/m", "table/optimizer/v", "table/optimizer/steps",
          "seen/weights", "params/w", "optimizer/state/w/velocity")


class Job:
    """One sbatch job of the program on both nodes (2 tasks each), output appended to
    ``out``; the batch script prints ``start N`` (Slurm's restart count) and ``exec``s
    poprun-lite."""

    def __init__(self, cluster, mpi: str, name: str, *prog_args: str, sbatch=(), wait=False, nodes=2, options=()):
        self.cluster, self.ckpt = cluster, cluster.work / f"{name}-ckpt"
        self.out = cluster.work / f"{name}.out"
        assert not self.ckpt.exists(), f"left from an earlier run: {self.ckpt}"
        python = python_of(mpi)
        command = [python, "-m", "popdist_lite_launcher", "--timeout", "240", "--print-topology", *options,
                   python, str(PROG), str(self.ckpt), "--samples", str(SAMPLES), "--batch", str(BATCH),
                   "--global-batch", str(GLOBAL_BATCH), "--every", "2", *prog_args]
        script = cluster.work / f"{name}.sh"
        script.write_text(f"#!/bin/bash\ncd {shlex.quote(str(ROOT))}\n"
                          f"echo \"start ${{SLURM_RESTART_COUNT:-0}}\"\nexec {shlex.join(command)}\n")
        submitted = cluster.run(["sbatch", "--parsable", *(["--wait"] if wait else []), "-N", str(nodes),
                                 *(["--ntasks-per-node", "2"] if nodes == 2 else ["-n", "4", "--overcommit"]),
                                 "--open-mode=append", "-o", str(self.out),
                                 *sbatch, str(script)], timeout=300,
                                env=cluster.env({**os.environ, **mpi_env(mpi)}))
        self.submitted = submitted
        self.id = submitted.stdout.strip().split(";")[0] if submitted.stdout.strip() else None
        assert submitted.returncode == 0 and self.id, f"{submitted.stderr}\n{self.text()}"

    def text(self) -> str:
        return self.out.read_text() if self.out.exists() else ""

    def state(self) -> str:
        return self.cluster.run(["squeue", "-h", "-j", self.id, "-o", "%T"]).stdout.strip()

    def signal(self, name: str, batch: bool = True) -> None:
        """``scancel --signal=NAME --batch ID``: poprun-lite alone (the batch script's
        process); without ``batch`` every process of every step but the batch step's."""
        sent = self.cluster.run(["scancel", f"--signal={name}", *(["--batch"] if batch else []), self.id])
        assert sent.returncode == 0, sent.stderr

    def wait(self, predicate, what: str, timeout: float) -> None:
        """:func:`wait_for` ``predicate``, the job's output in the error."""
        try:
            wait_for(predicate, what, timeout)
        except AssertionError as exc:
            shown = self.cluster.run(["scontrol", "show", "job", self.id])
            log = slurm_cluster.DIRECTORY / "slurmctld.log"
            said = [line for line in (log.read_text(errors="replace") if log.exists() else "").splitlines()
                    if f"JobId={self.id}" in line or f"job {self.id}" in line.lower()][-30:]
            raise AssertionError(f"{exc}; job {self.id} ({self.state() or 'gone'}), its output:\n"
                                 f"{self.text()}\nscontrol show job: {shown.stdout}{shown.stderr}\n"
                                 f"slurmctld.log:\n" + "\n".join(said)) from None

    def wait_requeued(self, run: int, before=None) -> None:
        """Until run ``run`` of the requeued job (``SLURM_RESTART_COUNT``) has started:
        once the previous run has left the nodes, and 2 s on, an administrator's
        ``scontrol update StartTime=now+2`` cuts Slurm's requeue delay short (slurmd
        refuses the job's credentials issued up to the second it revoked the previous
        run's: "Killing non-startable batch JobId=15: Job credential revoked", seen with
        StartTime=now). ``before()``, if given, runs first once the job is pending."""
        started = lambda: f"start {run}" in self.text()  # noqa: E731
        self.wait(lambda: started() or self.state() == "PENDING", f"run {run} of the requeued job", 120)
        if before is not None:
            self.wait(before, "the update of the pending job", 60)
        if not started():
            self.wait(lambda: started() or set(self.cluster.run(
                ["sinfo", "-h", "-N", "-o", "%T"]).stdout.split()) == {"idle"}, "idle nodes", 120)
            self.wait(lambda: started() or self.cluster.run(
                ["scontrol", "update", f"JobId={self.id}", "StartTime=now+2"]).returncode == 0,
                "StartTime=now+2", 60)
        self.wait(started, f"run {run} of the requeued job", 120)

    def wait_held(self, step: int = 5) -> None:
        """Until every replica took step ``step`` (and is held after it)."""
        self.wait(lambda: sorted(took(self.text()).get(step, {})) == [0, 1, 2, 3],
                  f"step {step} on every replica", 180)

    def wait_busy(self, step: int = 5) -> None:
        """Until a replica is busy inside step ``step`` (``--busy 0:STEP``)."""
        self.wait(lambda: f"BUSY {step}" in self.text(), "busy replicas", 180)

    def scancel(self) -> None:
        """A plain ``scancel ID``, as a time limit: SIGTERM to every process of the job,
        SIGKILL after KillWait."""
        sent = self.cluster.run(["scancel", self.id])
        assert sent.returncode == 0, sent.stderr

    def wait_gone(self, timeout: float = 120) -> None:
        self.wait(lambda: self.state() == "", "the job out of the queue", timeout)

    def checkpoints(self) -> list[int]:
        return sorted(int(path.name.split("-")[1]) for path in self.ckpt.glob("step-*"))

    def cancel(self) -> None:
        self.cluster.run(["scancel", self.id])
        wait_for(lambda: not any(self.cluster.job_processes(node) for node in self.cluster.nodes),
                 "empty nodes after the job", 60)


def took(text: str) -> dict[int, dict[int, list[list[int]]]]:
    """``{step: {replica: [sample ids, once per TOOK line]}}`` (MPICH's hydra may write
    two ranks' lines with no newline between them: ``TOOK ... 5TOOK ...``)."""
    found: dict = {}
    for match in TOOK.finditer(text):
        step, replica = int(match[2]), int(match[3])
        found.setdefault(step, {}).setdefault(replica, []).append(list(map(int, match[4].split())))
    return found


def final_arrays(ckpt_dir: Path, work: Path) -> dict[str, np.ndarray]:
    final = max(ckpt_dir.glob("step-*"), key=lambda path: int(path.name.split("-")[1]))
    assert int(final.name.split("-")[1]) == STEPS, final
    out = {}
    for name in ARRAYS:
        path = work / f"{ckpt_dir.name}.{name.replace('/', '.')}.npy"
        export(final, name, path)
        out[name] = np.load(path)
    return out


_REFERENCES: dict[str, dict[str, np.ndarray]] = {}


def reference(cluster, mpi: str) -> dict[str, np.ndarray]:
    """The final checkpoint's arrays of an uninterrupted job under ``mpi`` (one job per
    MPI for the module)."""
    if mpi not in _REFERENCES:
        job = Job(cluster, mpi, f"reference-{mpi}", wait=True)
        assert f"DONE {STEPS}" in job.text(), job.text()
        _REFERENCES[mpi] = final_arrays(job.ckpt, cluster.work)
    return _REFERENCES[mpi]


def _run_time(text: str) -> int:
    """Seconds of ``RunTime=[D-]HH:MM:SS`` in ``scontrol show job``."""
    match = re.search(r"(?<!\S)RunTime=(?:(\d+)-)?(\d+):(\d+):(\d+)", text)
    assert match, text
    days, hours, minutes, seconds = (int(x or 0) for x in match.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


#: The forms of SIGUSR1 each MPI's job gets, one per run: every form under Open MPI; under
#: MPICH those that reach its proxies (the batch shell's and the time limit's paths do
#: not differ between the MPIs: poprun-lite alone, the steps).
FORMS = {"openmpi": ("batch", "steps", "full", "time limit"), "mpich": ("steps", "full")}


def _send(job, form: str) -> None:
    """SIGUSR1 in ``form`` to the job (held at a boundary)."""
    if form == "batch":                                        # the batch shell: poprun-lite alone
        job.signal("USR1")
    elif form == "steps":                                      # the job's steps
        job.signal("USR1", batch=False)
    elif form == "full":                                       # every process
        sent = job.cluster.run(["scancel", "--full", "--signal=USR1", job.id])
        assert sent.returncode == 0, sent.stderr
    else:  # the time limit: the job's end 60-119 s away, within its --signal=USR1@150
        shown = job.cluster.run(["scontrol", "show", "job", job.id]).stdout
        minutes = -(-(_run_time(shown) + 60) // 60)
        cut = job.cluster.run(["scontrol", "update", f"JobId={job.id}", f"TimeLimit={minutes}"])
        assert cut.returncode == 0, cut.stderr


@pytest.mark.timeout(900)  # the reference and one job of up to five runs, each under its own deadline
@pytest.mark.parametrize("mpi", MPIS)
def test_usr1_in_every_form_checkpoints_requeues_and_resumes(cluster, mpi):
    want = reference(cluster, mpi)
    forms = FORMS[mpi]
    job = Job(cluster, mpi, f"usr1-{mpi}", *(a for run in range(len(forms)) for a in ("--hold", f"0:{2 * run + 1}")),
              sbatch=["--requeue", "--time=10", "--signal=USR1@150"])
    try:
        for run, form in enumerate(forms):
            job.wait_held(2 * run + 1)
            _send(job, form)
            job.wait_requeued(run + 1, before=(lambda: cluster.run(  # the time limit back for the next run
                ["scontrol", "update", f"JobId={job.id}", "TimeLimit=10"]).returncode == 0)
                if form == "time limit" else None)
        job.wait(lambda: f"DONE {STEPS}" in job.text(), "the end of the requeued job", 240)
        job.wait_gone()
    finally:
        job.cancel()
    text = job.text()
    runs = re.split(r"^start \d+$", text, flags=re.M)[1:]
    assert len(runs) == len(forms) + 1, text
    assert "preemption on: SIGUSR1 -> checkpoint and requeue (grace until the job's end (EndTime) less 2 s), " \
           "SIGTERM -> checkpoint (grace 3 s: Slurm's KillWait 5 s, less 2 s to report)" in runs[0], text
    for run, form in enumerate(forms):
        said = runs[run]
        assert f"STOPPED {2 * run + 2}" in said, text
        assert f"poprun-lite: job stopped at a step boundary after SIGUSR1 (checkpoint saved); requeued " \
               f"(scontrol requeue {job.id}) (exit code 138)" in said, text
        assert "second SIGUSR1" not in said and "lost" not in said, text
        if run:
            assert f"RESUMED {2 * run} 4" in said, text
        if form == "batch":                                    # no process of a step got it
            assert "SIGUSR1 reached" not in said, text
        if form in ("steps", "time limit"):                    # the agents in steps, or the watch step
            assert re.search(r"poprun-lite: SIGUSR1 reached (rank \d on pdls\d from pid \d+|the watch step on "
                             r"pdls1) \(as Slurm signals the job's steps\)", said), text
        if form == "time limit":
            assert re.search(r"SIGUSR1: asking the replicas to checkpoint at their next step boundary \(within "
                             r"\d+ s: until the job's end at [0-9:]+ less 2 s\)", said), text
    assert f"RESUMED {2 * len(forms)} 4" in runs[-1] and f"DONE {STEPS}" in runs[-1], text
    # every step once on every replica, every sample once
    steps = took(text)
    assert sorted(steps) == list(range(STEPS)), text
    assert all(sorted(steps[s]) == [0, 1, 2, 3] and all(len(v) == 1 for v in steps[s].values())
               for s in steps), text
    samples = sorted(i for s in steps.values() for lines in s.values() for i in lines[0])
    assert samples == list(range(SAMPLES)), samples
    got = final_arrays(job.ckpt, cluster.work)
    assert np.array_equal(got["seen/weights"], np.ones((SAMPLES, 1), np.float32)), got["seen/weights"].ravel()
    for name in ARRAYS:
        assert got[name].dtype == want[name].dtype and got[name].tobytes() == want[name].tobytes(), name


@pytest.mark.timeout(400)
def test_usr1_to_the_steps_of_a_one_node_job(cluster):
    """``scancel --signal=USR1 ID`` (``sbatch --signal=USR1@N``) on a one-node job under
    Open MPI: its ranks are mpirun's own children, in the batch step, which that signal
    skips; poprun-lite's watch step on the node gets it, and the replicas checkpoint."""
    job = Job(cluster, "openmpi", "steps-usr1-1", "--hold", "0:5", nodes=1, sbatch=["--requeue"],
              options=["--no-requeue"])
    try:
        job.wait_held()
        job.signal("USR1", batch=False)
        job.wait_gone()
    finally:
        job.cancel()
    text = job.text()
    assert "poprun-lite: SIGUSR1 reached the watch step on pdls1 (as Slurm signals the job's steps)" in text, text
    assert "STOPPED 6" in text and job.checkpoints() == [2, 4, 6], text
    assert "poprun-lite: job stopped at a step boundary after SIGUSR1 (checkpoint saved); not requeued " \
           "(--no-requeue) (exit code 138)" in text, text


@pytest.mark.timeout(400)
def test_sigterm_checkpoints_without_requeue(cluster):
    job = Job(cluster, "openmpi", "term", "--hold", "0:5", sbatch=["--requeue"])
    try:
        job.wait_held()
        job.signal("TERM")
        job.wait_gone()  # a requeued job would wait in the queue
    finally:
        job.cancel()
    text = job.text()
    assert "STOPPED 6" in text and job.checkpoints() == [2, 4, 6], text
    assert "poprun-lite: job stopped at a step boundary after SIGTERM (checkpoint saved); not requeued " \
           "(SIGTERM) (exit code 143)" in text, text
    assert "start 1" not in text, text


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mpi", MPIS)
def test_sigterm_to_the_steps_checkpoints(cluster, mpi):
    """``scancel --signal=TERM ID`` (what a preemption with a GraceTime sends): every
    process of the steps gets SIGTERM, poprun-lite does not. The MPI daemons, agents
    and programs hold it; the agents (and poprun-lite's watch step) pass it on, and the
    replicas checkpoint as on poprun-lite's own SIGTERM."""
    job = Job(cluster, mpi, f"steps-term-{mpi}", "--hold", "0:5", sbatch=["--requeue"])
    try:
        job.wait_held()
        job.signal("TERM", batch=False)
        job.wait_gone()
    finally:
        job.cancel()
    text = job.text()
    assert re.search(r"poprun-lite: SIGTERM reached (rank \d on pdls\d from pid \d+|the watch step on pdls1) "
                     r"\(as Slurm signals the job's steps\)", text), text
    assert "STOPPED 6" in text and job.checkpoints() == [2, 4, 6], text
    assert "poprun-lite: job stopped at a step boundary after SIGTERM (checkpoint saved); not requeued " \
           "(SIGTERM) (exit code 143)" in text, text
    assert "start 1" not in text, text


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mpi", MPIS)
def test_cancel_checkpoints(cluster, mpi):
    """A plain ``scancel ID`` (what a time limit does): SIGTERM to every process of the
    job, the batch step's too (poprun-lite, mpirun, the srun of the daemons), SIGKILL
    after KillWait (5 s). The replicas checkpoint at their boundary within it."""
    job = Job(cluster, mpi, f"cancel-{mpi}", "--hold", "0:5")
    try:
        job.wait_held()
        job.scancel()
        job.wait_gone()
    finally:
        job.cancel()
    text = job.text()
    assert "STOPPED 6" in text and job.checkpoints() == [2, 4, 6], text
    assert "poprun-lite: job stopped at a step boundary after SIGTERM (checkpoint saved); not requeued " \
           "(SIGTERM) (exit code 143)" in text, text
    assert "second SIGTERM" not in text, text  # the steps' SIGTERM and poprun-lite's are one


@pytest.mark.timeout(400)
def test_cancel_without_a_boundary_is_reported_before_the_kill(cluster):
    """``scancel ID`` while the replicas are inside a step: the grace (KillWait less 2 s)
    ends before Slurm's SIGKILL, so poprun-lite stops the job and says why."""
    job = Job(cluster, "openmpi", "cancel-busy", "--busy", "0:5")
    try:
        job.wait_busy()
        job.scancel()
        job.wait_gone()
    finally:
        job.cancel()
    text = job.text()
    assert "no replica reached a step boundary within 3 s of SIGTERM: ranks 0, 1, 2, 3 did not " \
           "(exit code 143)" in text, text
    assert job.checkpoints() == [2, 4] and "STOPPED" not in text, text


@pytest.mark.timeout(400)
def test_second_sigterm_stops_without_checkpoint(cluster):
    job = Job(cluster, "openmpi", "second", "--busy", "0:5")
    try:
        job.wait_busy()
        job.signal("TERM")
        job.wait(lambda: "poprun-lite: SIGTERM: asking the replicas to checkpoint" in job.text(),
                 "the checkpoint request", 60)
        job.signal("TERM")
        job.wait_gone()
    finally:
        job.cancel()
    text = job.text()
    assert re.search(r"second SIGTERM: stopping without a checkpoint \(exit code 143\)", text), text
    assert job.checkpoints() == [2, 4] and "STOPPED" not in text and "start 1" not in text, text


@pytest.mark.timeout(400)
def test_no_boundary_within_the_grace(cluster):
    job = Job(cluster, "openmpi", "grace", "--busy", "0:5", sbatch=["--requeue"],
              options=["--preemption-grace", "3"])
    try:
        job.wait_busy()
        job.signal("USR1")
        job.wait_gone()
    finally:
        job.cancel()
    text = job.text()
    assert "no replica reached a step boundary within 3 s of SIGUSR1: ranks 0, 1, 2, 3 did not " \
           "(exit code 138)" in text, text
    assert job.checkpoints() == [2, 4] and "STOPPED" not in text and "start 1" not in text, text
