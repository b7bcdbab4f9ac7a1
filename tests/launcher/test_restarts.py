"""poprun-lite --max-restarts: a failed attempt is reported and the job launched again,
POPDIST_LITE_RESTART_COUNT tells the program which attempt it is, the final report
lists every attempt (also when an attempt could not be started, in fixed and elastic
jobs), and SIGTERM stops without restarting. Every run under a timeout."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import JOB_SECONDS, timeout_for

from popdist_lite_launcher import attempts, cli
from popdist_lite_launcher.core.api import AttemptError, AttemptResult, Outcome
from popdist_lite_launcher.launch.command import find_mpirun
from popdist_lite_launcher.membership.policies import FixedPolicy

LAUNCHER = [sys.executable, "-m", "popdist_lite_launcher"]

# Every rank appends "<attempt> <replica>" to a log; replica 1 fails on attempts before
# argv[2] (exit code 3), and everyone sleeps until killed when argv[3] == "sleep".
PROG = textwrap.dedent("""
    import os, sys, time
    attempt = int(os.environ["POPDIST_LITE_RESTART_COUNT"])
    replica = int(os.environ["POPDIST_REPLICA_INDEX_OFFSET"])
    with open(os.path.join(sys.argv[1], "log"), "a") as f:
        f.write(f"{attempt} {replica}\\n")
    if sys.argv[3] == "sleep":
        time.sleep(10 * 300)
    if replica == 1 and attempt < int(sys.argv[2]):
        print(f"replica 1 fails on attempt {attempt}", file=sys.stderr, flush=True)
        sys.exit(3)
    print(f"attempt {attempt} replica {replica} ok", flush=True)
""")


def run(tmp_path, *args, fail_attempts, mode="run"):
    prog = tmp_path / "prog.py"
    prog.write_text(PROG)
    return subprocess.run([*LAUNCHER, "--timeout", str(JOB_SECONDS), "--num-replicas", "2", *args,
                           sys.executable, str(prog), str(tmp_path), str(fail_attempts), mode],
                          capture_output=True, text=True, timeout=JOB_SECONDS + 60, stdin=subprocess.DEVNULL)


def attempts_logged(tmp_path):
    lines = (tmp_path / "log").read_text().split("\n")
    return sorted(tuple(map(int, line.split())) for line in lines if line)


@timeout_for(1)
def test_restart_after_failures_then_success(tmp_path):
    proc = run(tmp_path, "--max-restarts", "3", fail_attempts=2)
    assert proc.returncode == 0, proc.stderr
    assert attempts_logged(tmp_path) == [(a, r) for a in range(3) for r in range(2)]
    err = proc.stderr
    for attempt in (1, 2):
        assert f"poprun-lite: attempt {attempt} of 4 failed (exit code 3)" in err
        assert (f"poprun-lite: restarting the job after failure {attempt} of at most 3 (--max-restarts)\n"
                f"poprun-lite: attempt {attempt + 1} of 4: 2 replicas on this host (2), after a failure "
                f"(POPDIST_LITE_RESTART_COUNT={attempt})") in err
    assert "root cause: replica 1 (rank 1" in err
    assert "replica 1 fails on attempt 0" in err and "replica 1 fails on attempt 1" in err
    assert "poprun-lite: job succeeded on attempt 3 of 4; attempts:" in err
    summary = err[err.index("job succeeded on attempt"):].splitlines()
    assert summary[1].startswith("  attempt 1: 2 replicas on this host (2); failed: replica 1 (rank 1") \
        and summary[1].endswith(": exit code 3")  # said once
    assert summary[2].startswith("  attempt 2: 2 replicas on this host (2), after a failure; failed: replica 1 (rank 1")
    assert summary[3] == "  attempt 3: 2 replicas on this host (2), after a failure; succeeded"
    assert "attempt 2 replica 1 ok" in proc.stdout


@timeout_for(1)
def test_no_restarts_left_final_report_lists_every_attempt(tmp_path):
    proc = run(tmp_path, "--max-restarts", "1", fail_attempts=5)
    assert proc.returncode == 3, proc.stderr
    assert attempts_logged(tmp_path) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    err = proc.stderr
    assert "poprun-lite: attempt 1 of 2 failed (exit code 3)" in err
    final = err[err.rindex("poprun-lite: job failed (exit code 3)"):]
    assert "root cause: replica 1 (rank 1" in final and "replica 1 fails on attempt 1" in final
    lines = final.splitlines()
    listed = lines[lines.index("attempts:") + 1:]
    assert [line.split(":")[0] for line in listed] == ["  attempt 1", "  attempt 2", "log (every failed rank's whole error, MPI's messages)"]


@timeout_for(1)
def test_without_max_restarts_no_restart(tmp_path):
    proc = run(tmp_path, fail_attempts=1)
    assert proc.returncode == 3
    assert attempts_logged(tmp_path) == [(0, 0), (0, 1)]
    assert "restarting" not in proc.stderr
    final = proc.stderr[proc.stderr.rindex("poprun-lite: job failed (exit code 3)"):].splitlines()
    assert final[-3] == "attempts:" and final[-2].startswith("  attempt 1: 2 replicas on this host (2); failed: "
                                                             "replica 1 (rank 1")
    assert final[-1].startswith("log (every failed rank's whole error, MPI's messages): ")  # the job's log, named


@timeout_for(1)
def test_sigterm_stops_without_restarting(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(PROG)
    launcher = subprocess.Popen([*LAUNCHER, "--timeout", str(JOB_SECONDS), "--num-replicas", "2",
                                 "--max-restarts", "3", sys.executable, str(prog), str(tmp_path),
                                 "0", "sleep"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "log").exists() or len(attempts_logged(tmp_path)) < 2:
            assert time.monotonic() < deadline and launcher.poll() is None, "ranks did not start"
            time.sleep(0.1)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=JOB_SECONDS)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 128 + signal.SIGTERM, err
    assert "poprun-lite: job interrupted by SIGTERM" in err
    assert "restarting" not in err
    assert attempts_logged(tmp_path) == [(0, 0), (0, 1)]


def test_bad_max_restarts_value():
    proc = subprocess.run([*LAUNCHER, "--max-restarts", "-1", "true"], capture_output=True,
                          text=True, timeout=JOB_SECONDS)
    assert proc.returncode == 2 and "--max-restarts: must be 0 or more" in proc.stderr
    env = {**os.environ, "POPDIST_LITE_STALL_TIMEOUT": "soon"}
    proc = subprocess.run([*LAUNCHER, "true"], capture_output=True, text=True, timeout=JOB_SECONDS, env=env)
    assert proc.returncode == 2 and "$POPDIST_LITE_STALL_TIMEOUT: invalid float value: 'soon'" in proc.stderr


@pytest.mark.parametrize("elastic", [False, True], ids=["fixed", "elastic"])
def test_an_attempt_that_cannot_start_still_prints_the_attempts(tmp_path, elastic):
    """Attempt 1 fails; attempt 2 cannot start mpirun (the fake mpirun made itself not
    executable after its first run): the job ends with exit code 2, the error and the
    attempts, both of them, in a fixed and an elastic job."""
    real = find_mpirun(None)
    fake = tmp_path / "mpirun"
    fake.write_text(f'#!/usr/bin/env bash\n[ "$1" = --version ] || chmod -x "$0"\nexec {real} "$@"\n')
    fake.chmod(0o755)
    elastic_args = ["--min-replicas", "2"] if elastic else []
    proc = run(tmp_path, "--max-restarts", "1", "--mpirun", str(fake), *elastic_args, fail_attempts=1)
    assert proc.returncode == 2, proc.stderr
    assert attempts_logged(tmp_path) == [(0, 0), (0, 1)]
    err = proc.stderr
    of = "" if elastic else " of 2"
    assert f"poprun-lite: attempt 1{of} failed (exit code 3)" in err
    final = err[err.index(f"poprun-lite: error: cannot run {fake}: [Errno 13] Permission denied"):].splitlines()
    assert final[1] == "attempts:", err
    assert final[2].startswith("  attempt 1: 2 replicas on this host (2); failed: replica 1 (rank 1") \
        and final[2].endswith(": exit code 3")  # said once, err
    assert final[3] == (f"  attempt 2: 2 replicas on this host (2), after a failure; could not be started: "
                        f"cannot run {fake}: [Errno 13] Permission denied: '{fake}' (exit code 2)"), err
    assert len(final) == 4, err


class ScriptedLauncher:
    """A launcher (core.api.Launcher) that plays back ``outcomes``: a
    AttemptResult to return, or an exception to raise; it records the attempts it got."""

    def __init__(self, *outcomes):
        self.outcomes, self.attempts = list(outcomes), []

    def run(self, attempt):
        self.attempts.append(attempt)
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return Outcome(outcome)


@pytest.mark.parametrize("error, code, line", [
    (AttemptError("no mpirun today"), 2,
     "  attempt 2: 1 replica on this host (1), after a failure; could not be started: no mpirun today "
     "(exit code 2)"),
    (RuntimeError("a bug"), 1, "  attempt 2: 1 replica on this host (1), after a failure; ended by an internal "
                               "error in poprun-lite"),
])
def test_the_loop_with_another_launcher(capsys, error, code, line):
    """The loop drives any Launcher: attempt 1 fails (mpirun's code 3), attempt 2 raises;
    the attempts are printed either way (an AttemptError: exit code 2; a launcher bug: 1)."""
    opts = cli.parse_args(["--max-restarts", "2", "prog"])
    launcher = ScriptedLauncher(AttemptResult(returncode=3), error)
    loop = attempts.AttemptsLoop(opts, launcher, FixedPolicy(opts), say=lambda text: None)
    assert loop.run() == code
    assert [(a.index, a.membership.hosts, a.hosts_checked, a.watch) for a in launcher.attempts] == \
        [(0, ((None, 1),), False, None), (1, ((None, 1),), False, None)]
    err = capsys.readouterr().err
    assert "poprun-lite: attempt 1 of 3 failed (exit code 3)" in err
    assert f"attempts:\n  attempt 1: 1 replica on this host (1); failed: failed (exit code 3)\n{line}\n" in err, err
    if code == 1:
        assert "poprun-lite: internal error: RuntimeError: a bug (at test_restarts.py:" in err


@timeout_for(1)
def test_an_attempt_that_ends_mid_line_does_not_run_into_the_next(tmp_path):
    """Attempt 0's replica 1 writes half a line and is killed: the launcher ends that line
    (it passes mpirun's stdout through), so attempt 1's first line stands on its own, as
    does the launcher's report after it."""
    prog = tmp_path / "half_line.py"
    prog.write_text(textwrap.dedent("""
        import os, signal, sys
        attempt = int(os.environ["POPDIST_LITE_RESTART_COUNT"])
        replica = int(os.environ["POPDIST_REPLICA_INDEX_OFFSET"])
        if replica == 1:
            if attempt == 0:
                sys.stdout.write("half a line from attempt 0")
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            print(f"attempt {attempt} starts a line", flush=True)
    """))
    proc = subprocess.run([*LAUNCHER, "--timeout", str(JOB_SECONDS), "--num-replicas", "2", "--max-restarts", "1",
                           sys.executable, str(prog)],
                          capture_output=True, text=True, timeout=JOB_SECONDS + 60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["half a line from attempt 0", "attempt 1 starts a line"], proc.stdout
