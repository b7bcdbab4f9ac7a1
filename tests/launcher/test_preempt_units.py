"""popdist_lite_launcher.slurm.preempt without a cluster: the options (signal names, KillWait,
Requeue= and EndTime read from scontrol's output, --preemption auto inside and outside
an allocation, --preemption-grace), the decisions on each signal (checkpoint, copies of
one signal, a second signal before and after every boundary, a third, grace over,
naming the ranks), signals before the options are read, the requeue decision with a
stand-in scontrol, and what the attempts loop does with a preempted attempt."""

from __future__ import annotations

import os
import signal
import time

import pytest

from popdist_lite_launcher import attempts, cli
from popdist_lite_launcher.core.api import AttemptResult, Outcome
from popdist_lite_launcher.core.options import PreemptionSettings
from popdist_lite_launcher.membership.policies import FixedPolicy
from popdist_lite_launcher.slurm import preempt

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
    assert preempt.settings("on", "USR2", False, 7, None) == PreemptionSettings(
        True, int(signal.SIGUSR2), False, 7, "--grace-period", None)
    assert preempt.settings("on", "USR1", True, None, "17", 600).requeue_grace == 600
    with pytest.raises(ValueError, match="--preemption-grace must be 0 or more"):
        preempt.settings("on", "USR1", True, None, "17", -1)
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
    assert preempt.with_grace(inside, lambda: 5.0).describe() == (
        "preemption on: SIGUSR1 -> checkpoint and requeue (grace until the job's end (EndTime) less 2 s), "
        "SIGTERM -> checkpoint (grace 3 s: Slurm's KillWait 5 s, less 2 s to report)")
    given = preempt.settings("on", "USR1", True, 10, None, 600)
    assert given.describe() == ("preemption on: SIGUSR1 -> checkpoint and no requeue (grace 600 s "
                                "(--preemption-grace)), SIGTERM -> checkpoint (grace 10 s: --grace-period)")


def test_end_time_from_scontrol_output():
    """EndTime is local time as Slurm prints it; Unknown (no time limit), two answers or
    another form: no end."""
    line = "JobId=12 JobName=x StartTime=2026-11-26T08:00:00 EndTime=2026-11-26T08:10:00 Deadline=N/A"
    assert preempt.parse_end_time(line) == time.mktime((2026, 11, 26, 8, 10, 0, 0, 0, -1))
    for bad in ("JobId=12 EndTime=Unknown", "JobId=12 EndTime=2026-11-26T08:10:00 EndTime=2026-11-26T08:11:00",
                "JobId=12 MyEndTime=2026-11-26T08:10:00", "JobId=12 EndTime=2026-13-40T08:10:00", "",
                "JobId=12 EndTime=2026-11-26T08:10:00;reboot"):
        assert preempt.parse_end_time(bad) is None, bad

def test_options(monkeypatch, capsys):
    """Outside Slurm preemption is off unless asked for; inside it is on; parsing never
    runs scontrol (the grace is read when the job starts)."""
    monkeypatch.setattr(preempt, "kill_wait", lambda scontrol=None: pytest.fail("scontrol run while parsing"))
    assert not cli.parse_args(["prog"]).preempt.enabled
    opts = cli.parse_args(["--preemption", "on", "--requeue-signal", "SIGUSR2", "--no-requeue",
                           "--grace-period", "25", "--preemption-grace", "600", "prog"])
    assert opts.preempt == PreemptionSettings(True, int(signal.SIGUSR2), False, 25.0, "--grace-period", None, 600.0)
    monkeypatch.setenv("SLURM_JOB_ID", "17")
    opts = cli.parse_args(["-H", "h1", "prog"])  # inside a job, even with hosts of one's own
    assert (opts.preempt.enabled, opts.preempt.job_id, opts.preempt.grace) == (True, "17", None)
    assert not cli.parse_args(["-H", "h1", "--preemption", "off", "prog"]).preempt.enabled
    for bad, said in ((["--requeue-signal", "TERM"], "SIGTERM cannot be the requeue signal"),
                      (["--grace-period", "-1"], "must be 0 or more"),
                      (["--preemption-grace", "-1"], "must be 0 or more"),
                      (["--preemption", "yes"], "invalid choice: 'yes'")):
        with pytest.raises(SystemExit) as exc:
            cli.parse_args([*bad, "-H", "h1", "prog"])
        assert exc.value.code == 2 and said in capsys.readouterr().err


def _preemption(grace=25.0, requeue=True, job_id="17", scontrol=None, requeue_grace=None, said=None):
    settings = PreemptionSettings(True, USR1, requeue, grace, "--grace-period", job_id, requeue_grace)
    return preempt.Preemption(settings, say=(said.append if said is not None else lambda text: None),
                              scontrol=scontrol)


def _signalled(rank, name="SIGUSR1"):
    return {"kind": "signalled", "rank": rank, "replica": rank, "host": "h", "pid": 1, "signal": name,
            "sender": 99}


def test_signals_during_an_attempt():
    """The first signal asks; a second before every replica announced its boundary stops
    the job, after it waits for the save; a third stops it."""
    p = _preemption()
    assert p.signals == (USR1, TERM) and not p.asked
    assert p.on_signal(int(signal.SIGINT)) == ""          # Ctrl-C first: stops as without preemption
    assert p.on_signal(USR1) is None and p.asked           # asks for the checkpoint
    assert p.on_signal(USR1) == "second SIGUSR1: stopping without a checkpoint"
    q = _preemption()
    assert q.on_signal(TERM) is None
    assert q.on_signal(int(signal.SIGINT)) == "SIGINT after SIGTERM: stopping without a checkpoint"
    said = []
    w = _preemption(said=said)
    w.begin(lambda rank, record: True, 2)
    assert w.on_signal(USR1) is None
    w.poll(lambda: {0, 1})                                 # every replica announced its boundary
    w.end()
    assert w.on_signal(TERM) is None                       # the time limit's SIGTERM: the save goes on
    assert said[-1] == "SIGTERM: every replica is saving its checkpoint; waiting for it (a third signal " \
                       "stops the job without it)"
    assert w.on_signal(USR1) == "third signal (SIGUSR1) while the replicas saved their checkpoint: stopping " \
                                "without waiting for it"
    off = preempt.Preemption(preempt.settings("off", "USR1", True, None, None))
    assert off.signals == ()


def test_copies_of_one_signal_are_one_event():
    """Slurm signals every process: poprun-lite's own copy and each agent's are one
    event, in any order; a second copy to one process is a second signal. A signal the
    job does not hold is ignored."""
    said = []
    p = _preemption(said=said)
    p.begin(lambda rank, record: True, 2)
    p.on_signalled(_signalled(1))
    assert p.asked and said == ["SIGUSR1 reached rank 1 on h from pid 99 (as Slurm signals the job's steps)"]
    p.on_signalled(_signalled(0))
    assert p.on_signal(USR1) is None                       # the same signal reaching poprun-lite
    assert p.poll(set) is None
    p.on_signalled(_signalled(0))                          # rank 0's agent got it twice: a second signal
    assert p.poll(set) == "second SIGUSR1: stopping without a checkpoint"
    p.end()
    q = _preemption()
    q.on_signalled(_signalled(0, "SIGHUP"))                # not held: nothing
    q.on_signalled({**_signalled(0), "signal": "NOSUCH"})
    assert not q.asked
    assert q.on_signal(TERM) is None and q.signum == TERM
    q.on_signalled(_signalled(0, "SIGTERM"))
    q.on_signalled(_signalled(1, "SIGTERM"))
    assert q.poll(set) is None or "second" not in q.poll(set)


def test_signals_before_the_options_are_read():
    """catch_early notes SIGUSR1 while poprun-lite starts; an enabled Preemption takes it
    over (the job then ends before any replica starts) and the handlers are put back."""
    before = {s: signal.getsignal(s) for s in preempt.EARLY_SIGNALS}
    early = preempt.catch_early()
    os.kill(os.getpid(), signal.SIGUSR1)
    p = _preemption()
    p.install(early)
    early.release(p.signals)
    assert p.asked and p.signum == USR1
    assert signal.getsignal(signal.SIGUSR2) == before[signal.SIGUSR2]
    p.uninstall()
    assert {s: signal.getsignal(s) for s in preempt.EARLY_SIGNALS} == before


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
    p.on_signal(TERM)
    at = p.at
    assert p.poll(lambda: set(), now=at + 24) is None      # within the grace
    for _ in range(100):
        if len(sent) == 4:
            break
        p._over.wait(0.1)
    p.end()
    assert sorted(sent) == [(r, "resize_request") for r in range(4)]
    assert p.poll(lambda: set(), now=at + 26) == \
        "no replica reached a step boundary within 25 s of SIGTERM: ranks 0, 1, 2, 3 did not"
    assert p.poll(lambda: {0, 2, 3}, now=at + 26) == \
        "rank 1 did not reach a step boundary within 25 s of SIGTERM (ranks 0, 2, 3 did)"
    assert p.poll(lambda: {0, 1, 2, 3}, now=at + 26) is None  # all at the boundary: saving


def _grace_of(p, send=lambda rank, record: True):
    p.begin(send, 1)
    p.poll(set)
    p._sender.join(30)
    p.end()
    return p.deadline - p.at if p.deadline is not None else None


def test_usr1_grace(tmp_path):
    """SIGUSR1's grace: the job's EndTime (read when it comes) less 2 s, not SIGTERM's;
    --preemption-grace instead; no limit without an end or outside Slurm."""
    said = []
    fake, _ = _scontrol(tmp_path, "1", end="+1 hour")
    p = _preemption(grace=3, scontrol=fake, said=said)
    p.on_signal(USR1)
    assert 3590 < _grace_of(p) <= 3598, said
    assert said[0].startswith("SIGUSR1: asking the replicas to checkpoint at their next step boundary (within 35")
    assert said[0].endswith(" less 2 s)"), said
    q = _preemption(grace=3, scontrol=fake, requeue_grace=7, said=said)
    q.on_signal(USR1)
    assert _grace_of(q) == 7 and said[-1].endswith("(within 7 s (--preemption-grace))")
    unknown, _ = _scontrol(tmp_path, "1", end=None)
    r = _preemption(grace=3, scontrol=unknown, said=said)
    r.on_signal(USR1)
    assert _grace_of(r) is None and said[-1].endswith("(no time limit: Slurm shows no end time for the job)")
    assert r.poll(set, now=r.at + 1e6) is None
    t = _preemption(grace=3, scontrol=fake)
    t.on_signal(TERM)
    assert _grace_of(t) == 3


def _scontrol(tmp_path, requeue: str, code: int = 0, end: str | None = None):
    """A stand-in scontrol that logs its arguments and shows a job with ``Requeue=requeue``
    (and ``EndTime`` ``end`` from now, in ``date -d`` words; Unknown when None)."""
    fake, log = tmp_path / f"scontrol-{requeue}-{code}-{end}".replace(" ", ""), tmp_path / "calls"
    when = f"$(date -d '{end}' +%Y-%m-%dT%H:%M:%S)" if end else "Unknown"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n"
                    f"[ \"$1 $2\" = 'show job' ] && echo \"JobId=17 Requeue={requeue} Restarts=0 EndTime={when}\"\n"
                    f"[ \"$1\" = requeue ] && {{ echo 'requeue refused' >&2; exit {code}; }}\nexit 0\n")
    fake.chmod(0o755)
    return str(fake), log


def test_finish_requeues_when_allowed(tmp_path, keep_sigterm):
    fake, log = _scontrol(tmp_path, "1")
    p = _preemption(scontrol=fake)
    p.begin(lambda rank, record: True, 2)
    p.on_signal(USR1)
    assert p.finish({0, 1}) == (128 + USR1, "stopped at a step boundary after SIGUSR1 (checkpoint saved); "
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
    code, text = p.finish(set())
    assert (code, text) == (128 + signum, f"stopped at a step boundary after {signal.Signals(signum).name} "
                                          f"(checkpoint saved); {said}")
    assert (log.read_text().splitlines() if log.exists() else []) == calls


def test_failed_requeue_is_said(tmp_path, keep_sigterm):
    fake, _ = _scontrol(tmp_path, "1", code=1)
    p = _preemption(scontrol=fake)
    p.on_signal(USR1)
    assert p.finish(set())[1].endswith("not requeued: `scontrol requeue 17` exited with 1: requeue refused")
    assert preempt.requeue_decision(_preemption(job_id=None).settings, True) == "not in a Slurm job"


class _Scripted:
    """A launcher whose attempts end as scripted; ``during(attempt)`` runs in each."""

    def __init__(self, *outcomes, during=None):
        self.outcomes, self.during = list(outcomes), during

    def run(self, attempt):
        if self.during is not None:
            self.during(attempt)
        return self.outcomes.pop(0)


def _stop(rank):
    return {"kind": "resize_stop", "rank": rank, "replica": rank, "host": "h", "pid": 1}


def test_the_loop_ends_a_preempted_job(tmp_path, capsys, keep_sigterm):
    """Replicas that stopped at a boundary after the signal end the job (128 + signal,
    requeued), the report saying whether every replica saved its checkpoint; a failure
    after the signal is never restarted (--max-restarts); a signal before the attempt
    ends the job before it starts."""
    opts = cli.parse_args(["--max-restarts", "3", "--num-replicas", "2", "prog"])
    fake, log = _scontrol(tmp_path, "1")
    for saved, said in (({0, 1}, " (checkpoint saved)"), ({1}, ", but rank 0 reported no checkpoint saved")):
        p = _preemption(scontrol=fake)
        clean = AttemptResult(returncode=0, stop_signal=USR1, saved=saved)
        loop = attempts.AttemptsLoop(
            opts, _Scripted(Outcome(clean, [_stop(0), _stop(1)]),
                            during=lambda attempt: (p.begin(lambda r, record: True, 2), p.on_signal(USR1))),
            FixedPolicy(opts), say=lambda text: None, preemption=p)
        assert loop.run() == 128 + USR1
        err = capsys.readouterr().err
        assert f"poprun-lite: job stopped at a step boundary after SIGUSR1{said}; requeued " \
               f"(scontrol requeue 17) (exit code 138); attempts:\n  attempt 1: 2 replicas on this host (2); " \
               f"stopped at a step boundary after SIGUSR1" in err, err
        assert "resize_stop, but" not in err

    p = _preemption(scontrol=fake)
    late = AttemptResult(returncode=1, stop_signal=TERM, stop_reason=preempt.grace_expired(25, TERM, 2, set()))
    loop = attempts.AttemptsLoop(opts, _Scripted(Outcome(late), during=lambda a: p.on_signal(TERM)),
                                 FixedPolicy(opts), say=lambda text: None, preemption=p)
    assert loop.run() == 128 + TERM
    err = capsys.readouterr().err
    assert "no replica reached a step boundary within 25 s of SIGTERM: ranks 0, 1 did not" in err, err
    assert len(loop.history) == 1 and "restarting" not in err

    log.unlink()
    p = _preemption(scontrol=fake)
    p.on_signal(USR1)                                      # before the first attempt
    loop = attempts.AttemptsLoop(opts, _Scripted(), FixedPolicy(opts), say=lambda text: None,
                                 preemption=p)
    assert loop.run() == 128 + USR1 and loop.history == []
    assert "poprun-lite: job SIGUSR1 came while no replica was running: nothing to save; requeued " \
           "(scontrol requeue 17) (exit code 138)" in capsys.readouterr().err
    assert log.read_text().splitlines() == ["show job -o 17", "requeue 17"]


def test_held_signals_named_in_the_environment():
    """POPRUN_LITE_HOLD_SIGNALS names the held signals; SIGTERM is always held, SIGKILL and
    SIGSTOP never, names that are not signals are left out, and nothing named means the
    default (SIGTERM, SIGUSR1)."""
    from popdist_lite import records
    from popdist_lite_launcher.node import hold_signals

    assert hold_signals.ENV == records.HOLD_ENV
    assert hold_signals.env_value((USR1, TERM)) == "SIGUSR1,SIGTERM"
    for text, want in (("SIGTERM,SIGUSR2", (TERM, int(signal.SIGUSR2))), ("SIGUSR1", (TERM, USR1)),
                       ("SIGKILL,SIGSTOP,NOSUCH,1", (TERM, USR1)), ("", (TERM, USR1))):
        assert hold_signals.held({hold_signals.ENV: text}) == want, text
