"""The scheduler's signals in every form, without a cluster (issue 37's reproductions):
poprun-lite with ``--preemption on`` on this machine, in a stand-in Slurm job where a
requeue is involved (``SLURM_JOB_ID`` 17 on this host, a stand-in ``scontrol`` that
shows KillWait 5 s, ``Requeue=1``, an ``EndTime`` an hour away, expands the node list to
this host and logs ``requeue``), 2 replicas of tests/progs/preempt_prog.py (1 for the
children's dispositions). The forms that need Slurm itself run on the test cluster
(tests/slurm/test_slurm_preempt.py).

- SIGUSR1's grace is the job's end, not SIGTERM's (``--grace-period 0``): replicas busy
  inside a step when it comes still checkpoint, and the job is requeued.
- SIGUSR1 to every process below poprun-lite (``scancel --signal=USR1 JOB``: the steps),
  and to poprun-lite too (``scancel --full``): mpirun holds it, the agents report it, the
  job checkpoints once and is requeued; to poprun-lite's watch step alone (a one-node
  job under Open MPI, whose ranks run in no step): the same.
- a second SIGUSR1 once every replica announced its boundary waits for the save; a third
  stops the job without it.
- the program holds the signals, its children (a subprocess, one in its own session, a
  python child, a fork) start with default dispositions.
- SIGUSR1 or SIGTERM while poprun-lite expands the node list (``scontrol show
  hostnames``): remembered; no replica starts, the job is requeued (SIGUSR1) or ends.
- a program that signals its own agent stops the job, and the report does not claim a
  checkpoint nobody saved.

Every poprun-lite runs under a timeout; the tests wait for lines and files."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import JOB_SECONDS, timeout_for
from peers import wait_for
from test_preempt_launch import _descendants

PROG = str(Path(__file__).resolve().parents[1] / "progs" / "preempt_prog.py")
LAUNCHER = [sys.executable, "-m", "popdist_lite_launcher"]
HOST = socket.gethostname()


class Run:
    """poprun-lite running preempt_prog.py, its output lines collected as they come."""

    def __init__(self, tmp_path, *options: str, prog_args=(), replicas: int = 2, env=None):
        self.ckpt = tmp_path / "ckpt"
        cmd = [*LAUNCHER, "--timeout", str(JOB_SECONDS), *options, sys.executable, PROG, str(self.ckpt),
               "--steps", "8", *prog_args]
        if replicas is not None:
            cmd[len(LAUNCHER):len(LAUNCHER)] = ["--num-replicas", str(replicas)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     stdin=subprocess.DEVNULL, env=env)
        _RUNS.append(self.proc)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(
            line.rstrip("\n") for line in self.proc.stdout), daemon=True)
        self.reader.start()

    @property
    def text(self) -> str:
        return "\n".join(list(self.lines))

    def wait_line(self, part: str, count: int = 1) -> None:
        """Until ``count`` lines hold ``part`` (failing at once if poprun-lite ended first)."""
        def seen():
            found = sum(part in line for line in list(self.lines)) >= count
            assert found or self.proc.poll() is None, f"poprun-lite ended before {part!r}:\n{self.text}"
            return found
        try:
            wait_for(seen, JOB_SECONDS, repr(part))
        except BaseException:
            self.proc.kill()
            raise

    def signal_below(self, signum: int, launcher_too: bool = False) -> None:
        """``signum`` to every process below poprun-lite (mpirun, agents, programs), as
        Slurm signals a job's steps, and to poprun-lite too with ``launcher_too``."""
        for pid in _descendants(self.proc.pid):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        if launcher_too:
            self.proc.send_signal(signum)

    def finish(self) -> int:
        try:
            return self.proc.wait(timeout=JOB_SECONDS + 60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.reader.join(10)

    def checkpoints(self) -> list[int]:
        return sorted(int(p.name.split("-")[1]) for p in self.ckpt.glob("step-*"))


_RUNS: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def no_slurm(monkeypatch):
    """No Slurm variables from outside; a poprun-lite a failed test left running is killed."""
    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    yield
    while _RUNS:
        proc = _RUNS.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
def stand_in(tmp_path):
    """The environment of a stand-in Slurm job 17 on this host: its ``scontrol`` first on
    PATH (``show hostnames`` waits for the file ``release-hostnames`` once the file
    ``block-hostnames`` exists, after writing ``in-hostnames``), and an ``srun`` that runs
    its command here (poprun-lite's watch step); returns (env, directory, log of the
    scontrol calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "scontrol.log"
    (bin_dir / "scontrol").write_text(f"""#!/bin/bash
echo "$*" >> {log}
case "$1 $2" in
  "show config") echo "KillWait                = 5 sec" ;;
  "show job") echo "JobId=17 JobName=x Requeue=1 Restarts=0 EndTime=$(date -d '+1 hour' +%Y-%m-%dT%H:%M:%S)" ;;
  "show hostnames")
    if [ -e {tmp_path}/block-hostnames ]; then
      touch {tmp_path}/in-hostnames
      while [ ! -e {tmp_path}/release-hostnames ]; do sleep 0.05; done
    fi
    echo {HOST} ;;
  "requeue 17") ;;
  *) echo "stand-in scontrol: $*" >&2; exit 1 ;;
esac
""")
    (bin_dir / "scontrol").chmod(0o755)
    (bin_dir / "srun").write_text('#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"\n')
    (bin_dir / "srun").chmod(0o755)  # the watch step's srun: runs the task here
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "17",
           "SLURM_JOB_NODELIST": HOST, "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NUM_NODES": "1",
           "SLURMD_NODENAME": HOST}
    return env, tmp_path, log


def _calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


@timeout_for(1)
def test_usr1_grace_is_the_jobs_end(tmp_path, stand_in):
    """Issue 37, 1: SIGUSR1 is the early warning; SIGTERM's grace (here 0 s) does not bound
    it. Replicas inside a step when it comes reach their boundary when the step ends."""
    env, _, log = stand_in
    busy = tmp_path / "busy-over"
    run = Run(tmp_path, "--grace-period", "0", prog_args=["--busy", "3", str(busy)], env=env)
    run.wait_line("BUSY 3")
    run.proc.send_signal(signal.SIGUSR1)
    run.wait_line("SIGUSR1: asking the replicas to checkpoint at their next step boundary (within ")
    busy.touch()
    code = run.finish()
    text = run.text
    assert code == 138, text
    assert "less 2 s)" in text and "until the job's end at" in text, text
    assert "STOPPED 4" in text and run.checkpoints() == [4], text
    assert "poprun-lite: job stopped at a step boundary after SIGUSR1 (checkpoint saved); requeued " \
           "(scontrol requeue 17) (exit code 138)" in text, text
    assert "requeue 17" in _calls(log)


@timeout_for(2)
@pytest.mark.parametrize("launcher_too", [False, True], ids=["steps", "full"])
def test_usr1_to_every_process(tmp_path, stand_in, launcher_too):
    """Issue 37, 2: SIGUSR1 to the job's steps (``scancel --signal=USR1 JOB``, ``sbatch
    --signal=USR1@N``) reaches mpirun, the agents and the programs, and with ``--full``
    poprun-lite too: one checkpoint, one requeue, with --max-restarts no restart."""
    env, _, log = stand_in
    run = Run(tmp_path, "--max-restarts", "2", prog_args=["--hold", "3"], env=env)
    run.wait_line("STEP 3 ", count=2)
    run.signal_below(signal.SIGUSR1, launcher_too)
    code = run.finish()
    text = run.text
    assert code == 138, text
    if not launcher_too:
        assert re.search(rf"poprun-lite: SIGUSR1 reached (rank [01] on {HOST} from pid \d+|the watch step on "
                         rf"{HOST}) \(as Slurm signals the job's steps\)", text), text
    assert "STOPPED 4" in text and run.checkpoints() == [4], text
    assert "poprun-lite: job stopped at a step boundary after SIGUSR1 (checkpoint saved); requeued " \
           "(scontrol requeue 17) (exit code 138)" in text, text
    assert "second" not in text and "lost" not in text and "restarting" not in text, text
    assert _calls(log).count("requeue 17") == 1


@timeout_for(1)
def test_watch_step_reports_the_steps_signal(tmp_path, stand_in):
    """Inside a Slurm job poprun-lite runs a watch step on its node: where no rank runs in
    a step (Open MPI's ranks on the batch node are mpirun's children), a signal Slurm
    sends the job's steps reaches that step alone, and the job checkpoints and is
    requeued."""
    env, _, log = stand_in
    run = Run(tmp_path, prog_args=["--hold", "3"], env=env)
    run.wait_line("STEP 3 ", count=2)
    watch = [pid for pid in _descendants(run.proc.pid) if b"--watch" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(watch) == 1, (watch, run.text)
    os.kill(watch[0], signal.SIGUSR1)
    code = run.finish()
    text = run.text
    assert code == 138, text
    assert f"poprun-lite: SIGUSR1 reached the watch step on {HOST} (as Slurm signals the job's steps)" in text, text
    assert "poprun-lite: job stopped at a step boundary after SIGUSR1 (checkpoint saved); requeued " \
           "(scontrol requeue 17) (exit code 138)" in text, text
    assert _calls(log).count("requeue 17") == 1


@timeout_for(2)
@pytest.mark.parametrize("third", [False, True], ids=["second", "third"])
def test_second_signal_waits_for_the_save(tmp_path, stand_in, third):
    """Issue 37, 3: once every replica announced its boundary, a second SIGUSR1 waits for
    their save (checkpoint, requeue); a third stops the job without it."""
    env, _, log = stand_in
    release = tmp_path / "save-now"
    run = Run(tmp_path, prog_args=["--hold", "3", "--save-after", str(release)], env=env)
    run.wait_line("STEP 3 ", count=2)
    run.proc.send_signal(signal.SIGUSR1)
    run.wait_line("poprun-lite: every replica reached its step boundary; waiting for their checkpoint")
    run.proc.send_signal(signal.SIGUSR1)
    run.wait_line("poprun-lite: SIGUSR1: every replica is saving its checkpoint; waiting for it")
    if third:
        run.proc.send_signal(signal.SIGUSR1)
        code = run.finish()
        text = run.text
        assert code == 138, text
        assert "poprun-lite: third signal (SIGUSR1) while the replicas saved their checkpoint: stopping " \
               "without waiting for it (exit code 138)" in text, text
        assert run.checkpoints() == [] and "requeue 17" not in _calls(log), text
        return
    release.touch()
    code = run.finish()
    text = run.text
    assert code == 138, text
    assert "STOPPED 4" in text and run.checkpoints() == [4], text
    assert "poprun-lite: job stopped at a step boundary after SIGUSR1 (checkpoint saved); requeued " \
           "(scontrol requeue 17) (exit code 138)" in text, text
    assert "requeue 17" in _calls(log)


@timeout_for(1)
def test_children_start_with_default_dispositions(tmp_path):
    """Issue 37, 4: the program holds SIGTERM (its own SIGTERM leaves it running), its
    children do not: a subprocess and a helper in its own session end on SIGTERM, a
    python child has the default handlers, a fork's child the default dispositions."""
    run = Run(tmp_path, "--preemption", "on", prog_args=["--children"], replicas=1)
    code = run.finish()
    text = run.text
    assert code == 0 and "DONE 8" in text, text
    assert "SELF alive none" in text, text  # held by a handler: nothing ignored or blocked
    assert f"CHILD none {-signal.SIGTERM}" in text, text
    assert f"SESSION none {-signal.SIGTERM}" in text, text
    assert "PYCHILD SIG_DFL handler SIG_DFL" in text, text  # SIGINT: Python's KeyboardInterrupt
    assert "FORKED 0" in text, text


@timeout_for(1)
@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM], ids=["USR1", "TERM"])
def test_signal_during_start_up(tmp_path, stand_in, signum):
    """Issue 37, 5: a signal while ``scontrol show hostnames`` runs is remembered; no
    replica starts and the job is requeued (SIGUSR1) or ends (SIGTERM)."""
    env, directory, log = stand_in
    (directory / "block-hostnames").touch()
    run = Run(tmp_path, prog_args=["--hold", "3"], replicas=None, env=env)
    wait_for(lambda: (directory / "in-hostnames").exists() or run.proc.poll() is not None, JOB_SECONDS,
             "scontrol show hostnames")
    run.proc.send_signal(signum)
    (directory / "release-hostnames").touch()
    code = run.finish()
    text = run.text
    name = signal.Signals(signum).name
    assert code == 128 + signum, text
    outcome = "requeued (scontrol requeue 17)" if signum == signal.SIGUSR1 else "not requeued (SIGTERM)"
    assert f"poprun-lite: job {name} came while no replica was running: nothing to save; {outcome} " \
           f"(exit code {128 + signum})" in text, text
    assert "STEP" not in text, text
    assert ("requeue 17" in _calls(log)) == (signum == signal.SIGUSR1)


@timeout_for(1)
def test_no_checkpoint_claimed_without_a_save(tmp_path):
    """Issue 37, 7: a program that sends its agent SIGTERM stops the job at a boundary
    like the scheduler would; when the replicas exit there without saving, the report
    says so instead of "(checkpoint saved)"."""
    run = Run(tmp_path, "--preemption", "on", "--grace-period", "60",
              prog_args=["--kill-agent", "2", "--hold", "2", "--no-save"])
    code = run.finish()
    text = run.text
    assert code == 143, text
    assert re.search(rf"poprun-lite: SIGTERM reached rank 0 on {HOST} from pid \d+ \(as Slurm signals the "
                     rf"job's steps\)", text), text
    assert "(checkpoint saved)" not in text and run.checkpoints() == [], text
    assert "poprun-lite: job stopped at a step boundary after SIGTERM, but ranks 0, 1 reported no checkpoint " \
           "saved; not requeued (SIGTERM) (exit code 143)" in text, text
