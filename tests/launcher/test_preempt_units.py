"""popdist_lite_launcher.preempt without a cluster: the options (signal names, KillWait
and Requeue= read from scontrol's output, --preemption auto inside and outside an
allocation), the decisions on each signal (checkpoint, second signal, grace over,
naming the ranks), the requeue decision with a stand-in scontrol, and what the attempts
loop does with a preempted attempt."""

from __future__ import annotations

import signal

import pytest

from popdist_lite_launcher import attempts, cli, job, preempt

USR1, TERM = int(signal.SIGUSR1), int(signal.SIGTERM)


@pytest.fixture(autouse=True)
def no_slurm(monkeypatch):
    for name in [k for k in __import__("os").environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)


@pytest.fixture
def keep_sigterm():
    """Preemption.finish lets SIGTERM pass before a requeue: restore pytest's handler."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("text, want", [("USR1", USR1), ("SIGUSR1", USR1), ("usr2", int(signal.SIGUSR2)),
                                        (" hup ", int(signal.SIGHUP)), (str(USR1), USR1)])
def test_parse_signal(text, want):
    assert preempt.parse_signal(text) == want


@pytest.mark.parametrize("text, match", [
    ("TERM", "SIGTERM cannot be the requeue signal"), ("SIGKILL", "SIGKILL cannot"),
    ("INT", "SIGINT cannot"), ("STOP", "SIGSTOP cannot"), ("USR3", "not a signal"),
    ("", "not a signal"), ("999", "not a signal"), ("-10", "not a signal"), ("USR1; reboot", "not a signal"),
])
def test_bad_signals(text, match):
    with pytest.raises(ValueError, match=match):
        preempt.parse_signal(text)


def test_kill_wait_and_requeue_from_scontrol_output():
    config = "Configuration data as of 2026-11-26T08:00:00\nJobRequeue              = 1\n" \
             "KillOnBadExit           = 0\nKillWait                = 5 sec\nLaunchParameters        = (null)\n"
    assert preempt.parse_kill_wait(config) == 5.0
    for bad in ("KillWait = 5 min\n", "KillWait = -5 sec\n", "MyKillWait = 5 sec\n", "", "KillWait = 9999999 sec"):
        assert preempt.parse_kill_wait(bad) is None, bad
    line = "JobId=12 JobName=x UserId=root(0) Priority=1 Requeue=1 Restarts=0 BatchFlag=1"
    assert preempt.parse_requeue(line) is True
    assert preempt.parse_requeue(line.replace("Requeue=1", "Requeue=0")) is False
    assert preempt.parse_requeue("JobId=12 Comment=Requeue=0 Requeue=1") is True  # a field, not a value
    assert preempt.parse_requeue("JobId=12 Comment=a Requeue=0 Requeue=1") is None  # two answers: none
    assert preempt.parse_requeue("JobId=12 NoRequeue=1") is None


def test_settings():
    inside = preempt.settings("auto", "USR1", True, None, "17")
    assert (inside.enabled, inside.requeue_signal, inside.requeue, inside.grace) == (True, USR1, True, None)
    outside = preempt.settings("auto", "USR1", True, None, None)
    assert (outside.enabled, outside.grace) == (False, preempt.DEFAULT_GRACE_SECONDS)
    assert preempt.settings("on", "USR2", False, 7, None) == preempt.Settings(
        True, int(signal.SIGUSR2), False, 7, "--grace-period", None)
    assert not preempt.settings("off", "USR1", True, None, "17").enabled
    with pytest.raises(ValueError, match="--preemption 'maybe'"):
        preempt.settings("maybe", "USR1", True, None, None)
    # the grace left to Slurm: its KillWait, else the default
    assert preempt.with_grace(inside, lambda: 5.0).grace == 3.0  # 2 s kept to report
    assert preempt.with_grace(inside, lambda: 5.0).grace_source == "Slurm's KillWait 5 s, less 2 s to report"
    assert preempt.with_grace(inside, lambda: 30.0).grace == 28.0
    assert preempt.with_grace(inside, lambda: 3.0).grace == 1.5  # at most half of a short KillWait
    unknown = preempt.with_grace(inside, lambda: None)
    assert (unknown.grace, unknown.grace_source) == (30.0, "default; Slurm's KillWait unknown")
    assert preempt.with_grace(outside, lambda: 1 / 0) is outside  # never read when known


def test_options(monkeypatch, capsys):
    """Outside Slurm preemption is off unless asked for; inside it is on; parsing never
    runs scontrol (the grace is read when the job starts)."""
    monkeypatch.setattr(preempt, "kill_wait", lambda scontrol=None: pytest.fail("scontrol run while parsing"))
    assert not cli.parse_args(["prog"]).preempt.enabled
    opts = cli.parse_args(["--preemption", "on", "--requeue-signal", "SIGUSR2", "--no-requeue",
                           "--grace-period", "25", "prog"])
    assert opts.preempt == preempt.Settings(True, int(signal.SIGUSR2), False, 25.0, "--grace-period", None)
    monkeypatch.setenv("SLURM_JOB_ID", "17")
    opts = cli.parse_args(["-H", "h1", "prog"])  # inside a job, even with hosts of one's own
    assert (opts.preempt.enabled, opts.preempt.job_id, opts.preempt.grace) == (True, "17", None)
    assert not cli.parse_args(["-H", "h1", "--preemption", "off", "prog"]).preempt.enabled
    for bad, said in ((["--requeue-signal", "TERM"], "SIGTERM cannot be the requeue signal"),
                      (["--grace-period", "-1"], "must be 0 or more"),
                      (["--preemption", "yes"], "invalid choice: 'yes'")):
        with pytest.raises(SystemExit) as exc:
            cli.parse_args([*bad, "-H", "h1", "prog"])
        assert exc.value.code == 2 and said in capsys.readouterr().err


def _preemption(grace=25.0, requeue=True, job_id="17", scontrol=None):
    settings = preempt.Settings(True, USR1, requeue, grace, "--grace-period", job_id)
    return preempt.Preemption(settings, say=lambda text: None, scontrol=scontrol)


def test_signals_during_an_attempt():
    p = _preemption()
    assert p.signals == (USR1, TERM) and not p.asked
    assert p.on_signal(int(signal.SIGINT)) == ""          # Ctrl-C first: stops as without preemption
    assert p.on_signal(USR1) is None and p.asked           # asks for the checkpoint
    assert p.on_signal(USR1) == "second SIGUSR1: stopping without a checkpoint"
    assert p.on_signal(TERM) == "SIGTERM after SIGUSR1: stopping without a checkpoint"
    q = _preemption()
    assert q.on_signal(TERM) is None
    assert q.on_signal(TERM) == "second SIGTERM: stopping without a checkpoint"
    assert q.on_signal(int(signal.SIGINT)) == "SIGINT after SIGTERM: stopping without a checkpoint"
    off = preempt.Preemption(preempt.settings("off", "USR1", True, None, None))
    assert off.signals == ()


def test_poll_asks_every_replica_and_names_the_ranks_late():
    """Every replica's agent gets one resize_request (those unreachable at first, later);
    after the grace the reason names the ranks without a boundary."""
    p = _preemption()
    sent, refuse = [], {2}

    def send(rank, record):
        if rank in refuse:
            refuse.discard(rank)
            return False
        sent.append((rank, record["kind"]))
        return True

    p.begin(send, 4)
    assert p.poll(lambda: set()) is None                   # no signal: nothing
    p.on_signal(USR1)
    at = p.at
    assert p.poll(lambda: set(), now=at + 24) is None      # within the grace
    for _ in range(100):
        if len(sent) == 4:
            break
        p._over.wait(0.1)
    p.end()
    assert sorted(sent) == [(r, "resize_request") for r in range(4)]
    assert p.poll(lambda: set(), now=at + 26) == \
        "no replica reached a step boundary within 25 s of SIGUSR1: ranks 0, 1, 2, 3 did not"
    assert p.poll(lambda: {0, 2, 3}, now=at + 26) == \
        "rank 1 did not reach a step boundary within 25 s of SIGUSR1 (ranks 0, 2, 3 did)"
    assert p.poll(lambda: {0, 1, 2, 3}, now=at + 26) is None  # all at the boundary: saving


def _scontrol(tmp_path, requeue: str, code: int = 0):
    """A stand-in scontrol that logs its arguments and shows a job with ``Requeue=requeue``."""
    fake, log = tmp_path / "scontrol", tmp_path / "calls"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n"
                    f"[ \"$1 $2\" = 'show job' ] && echo 'JobId=17 Requeue={requeue} Restarts=0'\n"
                    f"[ \"$1\" = requeue ] && {{ echo 'requeue refused' >&2; exit {code}; }}\nexit 0\n")
    fake.chmod(0o755)
    return str(fake), log


def test_finish_requeues_when_allowed(tmp_path, keep_sigterm):
    fake, log = _scontrol(tmp_path, "1")
    p = _preemption(scontrol=fake)
    p.on_signal(USR1)
    assert p.finish() == (128 + USR1, "stopped at a step boundary after SIGUSR1 (checkpoint saved); "
                                      "requeued (scontrol requeue 17)")
    assert log.read_text().splitlines() == ["show job -o 17", "requeue 17"]


@pytest.mark.parametrize("requeue, flag, signum, said, calls", [
    ("0", True, USR1, "not requeued (the job may not be requeued: Requeue=0 (submit it with sbatch --requeue))",
     ["show job -o 17"]),
    ("1", False, USR1, "not requeued (--no-requeue)", []),
    ("1", True, TERM, "not requeued (SIGTERM)", []),
])
def test_finish_without_requeue(tmp_path, keep_sigterm, requeue, flag, signum, said, calls):
    fake, log = _scontrol(tmp_path, requeue)
    p = _preemption(requeue=flag, scontrol=fake)
    p.on_signal(signum)
    code, text = p.finish()
    assert (code, text) == (128 + signum, f"stopped at a step boundary after {signal.Signals(signum).name} "
                                          f"(checkpoint saved); {said}")
    assert (log.read_text().splitlines() if log.exists() else []) == calls


def test_failed_requeue_is_said(tmp_path, keep_sigterm):
    fake, _ = _scontrol(tmp_path, "1", code=1)
    p = _preemption(scontrol=fake)
    p.on_signal(USR1)
    assert p.finish()[1].endswith("not requeued: `scontrol requeue 17` exited with 1: requeue refused")
    assert preempt.requeue_decision(_preemption(job_id=None).settings, True) == "not in a Slurm job"


class _Scripted:
    def __init__(self, *outcomes):
        self.outcomes = list(outcomes)

    def run(self, attempt):
        return self.outcomes.pop(0)


def _stop(rank):
    return {"kind": "resize_stop", "rank": rank, "replica": rank, "host": "h", "pid": 1}


def test_the_loop_ends_a_preempted_job(tmp_path, capsys, keep_sigterm):
    """Replicas that stopped at a boundary after the signal end the job (128 + signal,
    requeued); a failure after the signal is never restarted (--max-restarts)."""
    opts = cli.parse_args(["--max-restarts", "3", "--num-replicas", "2", "prog"])
    fake, _ = _scontrol(tmp_path, "1")
    p = _preemption(scontrol=fake)
    p.on_signal(USR1)
    clean = job.JobResult(returncode=0, stop_signal=USR1)
    loop = attempts.AttemptsLoop(opts, _Scripted(attempts.Outcome(clean, [_stop(0), _stop(1)])),
                                 attempts.FixedPolicy(opts), say=lambda text: None, preemption=p)
    assert loop.run() == 128 + USR1
    err = capsys.readouterr().err
    assert "poprun-lite: job stopped at a step boundary after SIGUSR1 (checkpoint saved); requeued " \
           "(scontrol requeue 17) (exit code 138); attempts:\n  attempt 1: 2 replicas on this host (2); " \
           "stopped at a step boundary after SIGUSR1" in err, err
    assert "resize_stop, but" not in err

    p = _preemption(scontrol=fake)
    p.on_signal(TERM)
    late = job.JobResult(returncode=1, stop_signal=TERM, stop_reason=preempt.grace_expired(25, TERM, 2, set()))
    loop = attempts.AttemptsLoop(opts, _Scripted(attempts.Outcome(late)), attempts.FixedPolicy(opts),
                                 say=lambda text: None, preemption=p)
    assert loop.run() == 128 + TERM
    err = capsys.readouterr().err
    assert "no replica reached a step boundary within 25 s of SIGTERM: ranks 0, 1 did not" in err, err
    assert len(loop.history) == 1 and "restarting" not in err

