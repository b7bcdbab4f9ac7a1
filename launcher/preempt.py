"""Preemption and time limits: what poprun-lite does on the scheduler's signals.

With ``--preemption on`` (the default, ``auto``, is on inside a Slurm allocation and off
outside one, where SIGTERM and SIGUSR1 do what they always did):

* **the requeue signal** (``--requeue-signal``, default SIGUSR1, as Lightning's
  ``SLURMEnvironment``; sent before the time limit by ``sbatch --signal=B:USR1@SECONDS``,
  or by ``scancel --signal=USR1 --batch``): poprun-lite asks every replica to stop at its
  next step boundary (the ``resize_request`` record of elastic jobs: on every replica
  :func:`popdist_lite.should_checkpoint` becomes True at the same step), the program
  saves a checkpoint and exits 0, and poprun-lite runs ``scontrol requeue $SLURM_JOB_ID``
  when the job may be requeued (``Requeue=1`` in ``scontrol show job``, i.e. submitted
  with ``--requeue`` or under ``JobRequeue=1``) and ``--no-requeue`` was not given. The
  requeued job resumes from that checkpoint.
* **SIGTERM** (``scancel --batch``, a preemption script): the same checkpoint at the next
  step boundary, then the job ends without a requeue. Slurm's SIGTERM to the job's steps
  (``scancel --signal=TERM``, a preemption's ``GraceTime``, a cancel) is held by the
  job's other processes and reaches poprun-lite as an agent's ``signalled`` record
  (:mod:`popdist_lite_launcher.hold_sigterm`, :meth:`Preemption.on_signalled`).
* the boundary must be reached within ``--grace-period`` seconds (default: Slurm's
  ``KillWait`` from ``scontrol show config`` less :data:`REPORT_SECONDS`, else
  :data:`DEFAULT_GRACE_SECONDS`);
  otherwise the job is stopped at once and the report says so, naming the ranks that
  did not reach it (:func:`grace_expired`). A second signal (SIGINT, SIGTERM or the
  requeue signal) while the replicas work towards the boundary stops the job at once,
  without a checkpoint (:func:`second_signal`).

In every case poprun-lite exits with 128 + the first signal's number (the job did not
finish), after printing how it ended. :class:`Preemption` holds a job's state: the
signal handlers of :func:`popdist_lite_launcher.job.run_job` call
:meth:`Preemption.on_signal`, its supervision loop :meth:`Preemption.poll`, and the
attempts loop :meth:`Preemption.finish` once the replicas stopped at a boundary.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable

from popdist_lite import records

AUTO, ON, OFF = "auto", "on", "off"
MODES = (AUTO, ON, OFF)
#: Default of ``--requeue-signal``.
DEFAULT_SIGNAL = "USR1"
#: Grace when Slurm's KillWait cannot be read (Slurm's own default KillWait).
DEFAULT_GRACE_SECONDS = 30.0
#: Seconds of Slurm's KillWait kept for stopping the job and printing the report
#: (:func:`with_grace`).
REPORT_SECONDS = 2.0
#: Seconds ``scontrol`` may take.
SCONTROL_TIMEOUT_SECONDS = 30.0
#: Seconds between two sends of the stop request to agents that did not get it yet.
RESEND_SECONDS = 0.5
#: Signals that cannot be the requeue signal: caught elsewhere, uncatchable, or not a
#: request (SIGCHLD ...).
REFUSED_SIGNALS = {"SIGTERM", "SIGINT", "SIGKILL", "SIGSTOP", "SIGCHLD", "SIGCONT", "SIGPIPE",
                   "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGTSTP", "SIGTTIN", "SIGTTOU"}
_KILL_WAIT = re.compile(r"^KillWait\s*=\s*([0-9]{1,6}) sec\s*$", re.M)
_REQUEUE = re.compile(r"(?<!\S)Requeue=([01])(?!\S)")
_JOB_ID = re.compile(r"[0-9]{1,20}")


def _say(text: str) -> None:
    print(f"poprun-lite: {text}", file=sys.stderr, flush=True)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def parse_signal(text: str) -> int:
    """The signal of ``--requeue-signal``: a name (``USR1``, ``SIGUSR1``, any case) or a
    number.

    Raises:
        ValueError: not a signal, or one that cannot ask for a checkpoint (SIGTERM and
            SIGINT have their own meaning, SIGKILL and SIGSTOP cannot be caught, ...).
    """
    name = text.strip().upper()
    try:
        sig = signal.Signals(int(name)) if name.isdigit() else \
            signal.Signals[name if name.startswith("SIG") else "SIG" + name]
    except (KeyError, ValueError):
        raise ValueError(f"not a signal name or number: {text!r}") from None
    if sig.name in REFUSED_SIGNALS:
        raise ValueError(f"{sig.name} cannot be the requeue signal (expected e.g. USR1, USR2, HUP)")
    return int(sig)


def parse_kill_wait(output: str) -> float | None:
    """Slurm's KillWait in seconds from ``scontrol show config`` (``KillWait = 30 sec``),
    None when it is not there or not in that form."""
    match = _KILL_WAIT.search(output)
    return float(match[1]) if match else None


def parse_requeue(output: str) -> bool | None:
    """Whether ``scontrol show job -o ID`` says the job may be requeued (``Requeue=1``),
    None when it says neither."""
    found = set(_REQUEUE.findall(output))
    return None if len(found) != 1 else found == {"1"}


def _scontrol(args: list[str], scontrol: str | None = None) -> tuple[int, str]:
    """``scontrol ARGS``: (exit code, stdout or what went wrong); -1 when it cannot run."""
    scontrol = scontrol or shutil.which("scontrol")
    if not scontrol:
        return -1, "`scontrol` is not on PATH"
    try:
        proc = subprocess.run([scontrol, *args], capture_output=True, text=True, errors="replace",
                              stdin=subprocess.DEVNULL, timeout=SCONTROL_TIMEOUT_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return -1, f"cannot run `scontrol {' '.join(args)}`: {exc}"
    if proc.returncode != 0:
        said = (proc.stderr.strip() or proc.stdout.strip())[-300:]
        return proc.returncode, f"`scontrol {' '.join(args)}` exited with {proc.returncode}: {said}"
    return 0, proc.stdout


def kill_wait(scontrol: str | None = None) -> float | None:
    """Slurm's KillWait (seconds) from ``scontrol show config``; None if unknown."""
    code, out = _scontrol(["show", "config"], scontrol)
    return parse_kill_wait(out) if code == 0 else None


# ------------------------------------------------------------------ settings

@dataclass(frozen=True)
class Settings:
    """The preemption options after :func:`settings`: ``enabled`` (``--preemption``
    resolved), the requeue signal's number, whether to requeue, the grace in seconds and
    where it came from, and the Slurm job id (None outside an allocation)."""

    enabled: bool
    requeue_signal: int
    requeue: bool
    grace: float | None      # None: Slurm's KillWait, not read yet (with_grace)
    grace_source: str
    job_id: str | None

    def describe(self) -> str:
        """One line for ``--print-topology``."""
        if not self.enabled:
            return "preemption off: SIGTERM stops the job at once"
        requeue = "requeue" if self.requeue and self.job_id else "no requeue"
        return (f"preemption on: {signal_name(self.requeue_signal)} -> checkpoint and {requeue}, "
                f"SIGTERM -> checkpoint; grace {self.grace:g} s ({self.grace_source})")


def settings(mode: str, signal_text: str, requeue: bool, grace: float | None,
             job_id: str | None) -> Settings:
    """The :class:`Settings` of ``--preemption mode``, ``--requeue-signal signal_text``,
    ``--no-requeue`` (``requeue`` False) and ``--grace-period grace`` (None: not given)
    for a job in Slurm job ``job_id`` (None: outside Slurm). ``auto`` is on inside an
    allocation. Without ``--grace-period`` the grace of an enabled job in an allocation
    stays None (Slurm's KillWait, read by :func:`with_grace` when the job starts), else
    it is :data:`DEFAULT_GRACE_SECONDS`.

    Raises:
        ValueError: an unknown mode, a bad signal (:func:`parse_signal`), a negative grace.
    """
    if mode not in MODES:
        raise ValueError(f"--preemption {mode!r}: expected one of {', '.join(MODES)}")
    signum = parse_signal(signal_text)
    if grace is not None and grace < 0:
        raise ValueError(f"--grace-period must be 0 or more, got {grace:g}")
    enabled = mode == ON or (mode == AUTO and job_id is not None)
    if grace is not None:
        return Settings(enabled, signum, requeue, grace, "--grace-period", job_id)
    if enabled and job_id is not None:
        return Settings(enabled, signum, requeue, None, "Slurm's KillWait", job_id)
    return Settings(enabled, signum, requeue, DEFAULT_GRACE_SECONDS, "default", job_id)


def with_grace(settings: Settings, read_kill_wait: Callable[[], float | None] = kill_wait) -> Settings:
    """``settings`` with its grace known when it was left to Slurm: its KillWait
    (``read_kill_wait()``) less :data:`REPORT_SECONDS` (at most half of it), so that a
    job that misses its boundary after a cancel, whose processes Slurm SIGKILLs
    ``KillWait`` seconds after its SIGTERM, is stopped and reported before that;
    :data:`DEFAULT_GRACE_SECONDS` when KillWait cannot be read."""
    if settings.grace is not None:
        return settings
    found = read_kill_wait()
    if found is None:
        return replace(settings, grace=DEFAULT_GRACE_SECONDS,
                       grace_source="default; Slurm's KillWait unknown")
    grace = max(found - REPORT_SECONDS, found / 2)
    return replace(settings, grace=grace,
                   grace_source=f"Slurm's KillWait {found:g} s, less {found - grace:g} s to report")


# ------------------------------------------------------------------ reports

def second_signal(signum: int, first: int) -> str:
    """The stop reason of a signal while the replicas work towards a boundary."""
    if signum == first:
        return f"second {signal_name(signum)}: stopping without a checkpoint"
    return f"{signal_name(signum)} after {signal_name(first)}: stopping without a checkpoint"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def grace_expired(grace: float, signum: int, replicas: int, stopped: set[int]) -> str:
    """The stop reason when ``grace`` seconds after ``signum`` not every replica rank
    (0 to ``replicas`` - 1) reached a boundary (``stopped``: those that did)."""
    missing = [rank for rank in range(replicas) if rank not in stopped]
    if len(missing) == replicas:
        return (f"no replica reached a step boundary within {grace:g} s of {signal_name(signum)}: "
                f"{_ranks(missing)} did not")
    return (f"{_ranks(missing)} did not reach a step boundary within {grace:g} s of "
            f"{signal_name(signum)} ({_ranks(sorted(stopped))} did)")


# ------------------------------------------------------------------ the job's state

class Preemption:
    """A job's preemption state (module docstring) under ``settings`` (its grace read
    from Slurm now when left to Slurm: :func:`with_grace`); ``scontrol`` is the command
    run for ``show config``, ``show job`` and ``requeue`` (default: from PATH)."""

    def __init__(self, settings: Settings, say: Callable[[str], None] = _say, scontrol: str | None = None):
        self.settings = with_grace(settings, lambda: kill_wait(scontrol))
        self.say, self.scontrol = say, scontrol
        self.signum: int | None = None     # the first signal
        self.at: float | None = None       # when it came (monotonic)
        self._relayed = False              # the first came from an agent (on_signalled)
        self._send: Callable[[int, dict], bool] | None = None
        self._replicas = 0
        self._sent: set[int] = set()
        self._sender: threading.Thread | None = None
        self._over = threading.Event()
        self._previous = None

    @property
    def signals(self) -> tuple[int, ...]:
        """The signals that ask for a checkpoint (none when disabled)."""
        if not self.settings.enabled:
            return ()
        return (self.settings.requeue_signal, signal.SIGTERM)

    @property
    def asked(self) -> bool:
        """Whether a signal asked the replicas for a checkpoint."""
        return self.signum is not None

    def install(self) -> None:
        """Between attempts (and before the first), note the requeue signal instead of
        dying of it (SIGUSR1's default action); the next attempt asks for the checkpoint
        at once. Call from the main thread."""
        if self.settings.enabled:
            self._previous = signal.signal(self.settings.requeue_signal, self._noted)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(self.settings.requeue_signal, self._previous)
            self._previous = None

    def _noted(self, signum, _frame=None) -> None:
        if self.signum is None:
            self.signum, self.at = signum, time.monotonic()

    def on_signal(self, signum: int) -> str | None:
        """A signal during an attempt: None when it asks the replicas for a checkpoint
        (the first of :attr:`signals`), else the reason to stop at once ("" for a signal
        that stops the job as without preemption)."""
        if self.signum is not None:
            if self._relayed and signum == self.signum:  # the same cancel reached poprun-lite
                self._relayed = False
                return None
            return second_signal(signum, self.signum)
        if signum not in self.signals:
            return ""
        self.signum, self.at = signum, time.monotonic()
        return None

    def on_signalled(self, record: dict) -> None:
        """A ``signalled`` record (a collector callback): an agent got SIGTERM from Slurm,
        which signalled the job's steps (:mod:`popdist_lite_launcher.hold_sigterm`). The
        first asks the replicas for a checkpoint as poprun-lite's own SIGTERM does; the
        next SIGTERM poprun-lite itself gets is taken for the same signal (a cancel
        signals the batch step too), the one after it stops the job."""
        if self.signum is not None or not self.settings.enabled or record.get("signal") != "SIGTERM":
            return
        self.signum, self.at, self._relayed = signal.SIGTERM, time.monotonic(), True
        self.say(f"SIGTERM reached rank {record.get('rank')} on {record.get('host')} "
                 f"(Slurm signalled the job's steps)")

    # per attempt -------------------------------------------------------------

    def begin(self, send: Callable[[int, dict], bool], replicas: int) -> None:
        """An attempt of ``replicas`` replicas starts; ``send(rank, record)`` reaches the
        agent of replica rank ``rank``."""
        self._send, self._replicas, self._sent = send, replicas, set()
        self._over.clear()
        self._sender = None

    def end(self) -> None:
        """The attempt is over: stop sending."""
        self._over.set()
        if self._sender is not None:
            self._sender.join(5.0)
            self._sender = None

    def poll(self, stopped: Callable[[], set[int]], now: float | None = None) -> str | None:
        """Called by the supervision loop: starts sending the stop request once a signal
        came; the stop reason once the grace is over and a replica rank is not in
        ``stopped()`` (the ranks that reached a boundary), else None."""
        if self.signum is None:
            return None
        if self._sender is None and self._send is not None:
            self.say(f"{signal_name(self.signum)}: asking the replicas to checkpoint at their next "
                     f"step boundary (within {self.settings.grace:g} s)")
            self._sender = threading.Thread(target=self._send_requests, daemon=True,
                                            name="poprun-lite preemption")
            self._sender.start()
        now = time.monotonic() if now is None else now
        if now - self.at <= self.settings.grace:
            return None
        done = stopped()
        if all(rank in done for rank in range(self._replicas)):
            return None
        return grace_expired(self.settings.grace, self.signum, self._replicas, done)

    def _send_requests(self) -> None:
        request = records.make("resize_request", replicas=self._replicas)
        while not self._over.is_set():
            for rank in range(self._replicas):
                if rank not in self._sent and self._send(rank, request):
                    self._sent.add(rank)
            if len(self._sent) == self._replicas:
                return
            self._over.wait(RESEND_SECONDS)

    # the end ----------------------------------------------------------------

    def finish(self) -> tuple[int, str]:
        """The replicas stopped at a boundary after :attr:`signum`: requeue the job when
        asked to and allowed (:func:`requeue_decision`); the exit code (128 + signal)
        and what happened, for the report."""
        name = signal_name(self.signum)
        text = f"stopped at a step boundary after {name} (checkpoint saved)"
        if self.signum != self.settings.requeue_signal:
            return 128 + self.signum, text + "; not requeued (SIGTERM)"
        return 128 + self.signum, text + "; " + self._requeue()

    def _requeue(self) -> str:
        job = self.settings.job_id
        why = requeue_decision(self.settings, self._requeueable())
        if why:
            return f"not requeued ({why})"
        # Slurm ends the running job it requeues (SIGTERM first): the job is over, so
        # poprun-lite lets that SIGTERM pass and finishes its report
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        code, out = _scontrol(["requeue", job], self.scontrol)
        if code != 0:
            return f"not requeued: {out}"
        return f"requeued (scontrol requeue {job})"

    def _requeueable(self) -> bool | str:
        if not self.settings.requeue or self.settings.job_id is None:
            return True  # not asked: requeue_decision says why
        code, out = _scontrol(["show", "job", "-o", self.settings.job_id], self.scontrol)
        if code != 0:
            return out
        return parse_requeue(out) if parse_requeue(out) is not None else \
            "`scontrol show job` shows no Requeue= field"


def requeue_decision(settings: Settings, requeueable: bool | str) -> str:
    """Why the job is not requeued ("" when it is): ``--no-requeue``, outside Slurm, the
    job may not be requeued (``requeueable`` False: ``Requeue=0``), or what went wrong
    finding out (``requeueable`` a text)."""
    if not settings.requeue:
        return "--no-requeue"
    if settings.job_id is None or not _JOB_ID.fullmatch(settings.job_id):
        return "not in a Slurm job"
    if isinstance(requeueable, str):
        return requeueable
    if not requeueable:
        return "the job may not be requeued: Requeue=0 (submit it with sbatch --requeue)"
    return ""
