"""Preemption and time limits: what poprun-lite does on the scheduler's signals.

With ``--preemption on`` (the default, ``auto``, is on inside a Slurm allocation and off
outside one, where SIGTERM and SIGUSR1 do what they always did):

* **the requeue signal** (``--requeue-signal``, default SIGUSR1, as Lightning's
  ``SLURMEnvironment`` and submitit): poprun-lite asks every replica to stop at its next
  step boundary (the ``resize_request`` record of elastic jobs: on every replica
  :func:`popdist_lite.should_checkpoint` becomes True at the same step), the program
  saves a checkpoint and exits 0, and poprun-lite runs ``scontrol requeue $SLURM_JOB_ID``
  when the job may be requeued (``Requeue=1`` in ``scontrol show job``, i.e. submitted
  with ``--requeue`` or under ``JobRequeue=1``) and ``--no-requeue`` was not given. The
  requeued job resumes from that checkpoint. It is the early warning (``sbatch
  --signal=[B:]USR1@SECONDS``, sent that long before the time limit), so the replicas
  have until the job's end to reach the boundary: ``EndTime`` in ``scontrol show job``,
  read when the signal comes, less :data:`END_MARGIN_SECONDS`
  (``--preemption-grace SECONDS`` instead; no limit when the job has no end or runs
  outside Slurm).
* **SIGTERM** (``scancel --batch``, a cancel, a time limit, a preemption): the same
  checkpoint at the next step boundary, then the job ends without a requeue; the
  boundary must be reached within ``--grace-period`` seconds (default: Slurm's
  ``KillWait`` from ``scontrol show config`` less :data:`REPORT_SECONDS`, the time
  Slurm leaves before its SIGKILL, else :data:`DEFAULT_GRACE_SECONDS`).

Slurm signals every process of a job's steps (``scancel --signal=SIG JOB``, ``sbatch
--signal=SIG@N`` without ``B:``), or of the whole job (``scancel --full``, a cancel, a
time limit): the job's other processes hold SIGTERM and the requeue signal
(:mod:`popdist_lite_launcher.node.hold_signals`), and an agent that gets one tells
poprun-lite with a ``signalled`` record (:meth:`Preemption.on_signalled`); so does
poprun-lite's watch step on its own node (:meth:`Preemption.watch_steps`), where Open
MPI's ranks run outside any step. One signal
reaches many processes, so poprun-lite counts **signal events**, not copies: for each
signal, the most copies any one process (poprun-lite, or one agent) got
(:meth:`Preemption.on_signal`). The first event asks for the checkpoint; a second one
(another signal, or the same one again) stops the job at once without a checkpoint
(:func:`second_signal`), unless every replica has already announced its boundary: then
it waits for their save, and only a third event (or Slurm's SIGKILL) cuts it
(:func:`third_signal`). A replica that misses its boundary within the grace stops the
job, and the report names the ranks that did not reach it (:func:`grace_expired`).

A signal that comes while no replica runs (while poprun-lite starts, reads Slurm's
settings or starts mpirun: :func:`catch_early`, :meth:`Preemption.install`; between two
attempts) is remembered: before an attempt starts it ends the job at once, with a
requeue for the requeue signal (nothing to save: :meth:`Preemption.end_unstarted`); once
mpirun runs, the replicas are asked as usual.

In every case poprun-lite exits with 128 + the first signal's number (the job did not
finish), after printing how it ended; its report says "(checkpoint saved)" only when
every replica reported its save (``checkpoint_saved`` records, sent by
:func:`popdist_lite.save_checkpoint` for a save begun after ``should_checkpoint()``
answered True). :class:`Preemption` holds a job's state: the signal handlers of
:func:`popdist_lite_launcher.launch.mpirun.run_mpirun` call :meth:`Preemption.on_signal`, its
supervision loop :meth:`Preemption.poll`, and the attempts loop
:meth:`Preemption.finish` once the replicas stopped at a boundary.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from typing import Callable

from . import scontrol
from ..core.api import LauncherError
from ..core.options import END_MARGIN_SECONDS, PreemptionSettings
from ..core.text import counted, say, signal_name
from ..node import hold_signals
from ..node.hold_signals import child_preexec
from ..supervise.stop_request import StopRequest

AUTO, ON, OFF = "auto", "on", "off"
MODES = (AUTO, ON, OFF)
#: Default of ``--requeue-signal``.
DEFAULT_SIGNAL = "USR1"
#: SIGTERM's grace when Slurm's KillWait cannot be read (Slurm's own default KillWait).
DEFAULT_GRACE_SECONDS = 30.0
#: Seconds of Slurm's KillWait kept for stopping the job and printing the report
#: (:func:`with_grace`).
REPORT_SECONDS = 2.0
#: Signals that cannot be the requeue signal: caught elsewhere, uncatchable, or not a
#: request (SIGCHLD ...).
REFUSED_SIGNALS = {"SIGTERM", "SIGINT", "SIGKILL", "SIGSTOP", "SIGCHLD", "SIGCONT", "SIGPIPE",
                   "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGTSTP", "SIGTTIN", "SIGTTOU"}
#: What :func:`catch_early` notes before the options are read: SIGTERM and the likely
#: requeue signals.
EARLY_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
#: The source of a signal poprun-lite itself got (an agent's is its rank).
LAUNCHER = "poprun-lite"
#: The source of a signal the watch step printed (:meth:`Preemption.watch_steps`).
WATCH = "watch step"
#: Seconds the watch step has to end after its standard input closed, before SIGKILL.
WATCH_STOP_SECONDS = 2.0
_KILL_WAIT = re.compile(r"^KillWait\s*=\s*([0-9]{1,6}) sec\s*$", re.M)
_REQUEUE = re.compile(r"(?<!\S)Requeue=([01])(?!\S)")
_END_TIME = re.compile(r"(?<!\S)EndTime=(\S*)")
_TIMESTAMP = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}")


def parse_signal(text: str) -> int:
    """The signal of ``--requeue-signal``: a name (``USR1``, ``SIGUSR1``, any case) or a
    number.

    Raises:
        ValueError: not a signal, or one that cannot ask for a checkpoint (SIGTERM and
            SIGINT have their own meaning, SIGKILL and SIGSTOP cannot be caught, ...).
    """
    name = text.strip().upper()
    try:
        sig = signal.Signals(int(name)) if name.isdecimal() else \
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


def parse_end_time(output: str) -> float | None:
    """The job's end (seconds since the epoch) from ``scontrol show job -o ID``
    (``EndTime=2026-11-26T08:10:00``, this machine's local time, as Slurm prints it);
    None when it has none (``EndTime=Unknown``: no time limit), says it twice, or not in
    that form."""
    found = set(_END_TIME.findall(output))
    if len(found) != 1:
        return None
    text = found.pop()
    if not _TIMESTAMP.fullmatch(text):
        return None
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except (ValueError, OverflowError):
        return None


def kill_wait(command: str | None = None) -> float | None:
    """Slurm's KillWait (seconds) from ``scontrol show config`` (``command``: the scontrol
    to run); None if unknown."""
    try:
        return parse_kill_wait(scontrol.run(["show", "config"], command=command))
    except LauncherError:
        return None


def job_end(job_id: str, command: str | None = None) -> float | None:
    """The job's end (seconds since the epoch) from ``scontrol show job``; None if it has
    none or it is unknown."""
    try:
        return parse_end_time(scontrol.run(["show", "job", "-o", job_id], command=command))
    except LauncherError:
        return None


# ------------------------------------------------------------------ settings

def settings(mode: str, signal_text: str, requeue: bool, grace: float | None,
             job_id: str | None, requeue_grace: float | None = None) -> PreemptionSettings:
    """The :class:`PreemptionSettings` of ``--preemption mode``, ``--requeue-signal signal_text``,
    ``--no-requeue`` (``requeue`` False), ``--grace-period grace`` and
    ``--preemption-grace requeue_grace`` (None: not given) for a job in Slurm job
    ``job_id`` (None: outside Slurm). ``auto`` is on inside an allocation. Without
    ``--grace-period`` the grace of an enabled job in an allocation stays None (Slurm's
    KillWait, read by :func:`with_grace` when the job starts), else it is
    :data:`DEFAULT_GRACE_SECONDS`.

    Raises:
        ValueError: an unknown mode, a bad signal (:func:`parse_signal`), a negative grace.
    """
    if mode not in MODES:
        raise ValueError(f"--preemption {mode!r}: expected one of {', '.join(MODES)}")
    signum = parse_signal(signal_text)
    if grace is not None and grace < 0:
        raise ValueError(f"--grace-period must be 0 or more, got {grace:g}")
    if requeue_grace is not None and requeue_grace < 0:
        raise ValueError(f"--preemption-grace must be 0 or more, got {requeue_grace:g}")
    enabled = mode == ON or (mode == AUTO and job_id is not None)
    if grace is not None:
        return PreemptionSettings(enabled, signum, requeue, grace, "--grace-period", job_id, requeue_grace)
    if enabled and job_id is not None:
        return PreemptionSettings(enabled, signum, requeue, None, "Slurm's KillWait", job_id, requeue_grace)
    return PreemptionSettings(enabled, signum, requeue, DEFAULT_GRACE_SECONDS, "default", job_id, requeue_grace)


def with_grace(settings: PreemptionSettings, read_kill_wait: Callable[[], float | None] = kill_wait) -> PreemptionSettings:
    """``settings`` with SIGTERM's grace known when it was left to Slurm: its KillWait
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
    """The stop reason of a second signal before every replica reached its boundary."""
    if signum == first:
        return f"second {signal_name(signum)}: stopping without a checkpoint"
    return f"{signal_name(signum)} after {signal_name(first)}: stopping without a checkpoint"


def third_signal(signum: int) -> str:
    """The stop reason of a third signal while the replicas save their checkpoint."""
    return (f"third signal ({signal_name(signum)}) while the replicas saved their checkpoint: stopping "
            f"without waiting for it")


def grace_expired(grace: float, signum: int, replicas: int, stopped: set[int]) -> str:
    """The stop reason when ``grace`` seconds after ``signum`` not every replica rank
    (0 to ``replicas`` - 1) reached a boundary (``stopped``: those that did)."""
    missing = [rank for rank in range(replicas) if rank not in stopped]
    if len(missing) == replicas:
        return (f"no replica reached a step boundary within {grace:g} s of {signal_name(signum)}: "
                f"{counted('rank', missing)} did not")
    return (f"{counted('rank', missing)} did not reach a step boundary within {grace:g} s of "
            f"{signal_name(signum)} ({counted('rank', sorted(stopped))} did)")


# ------------------------------------------------------------------ start-up

class EarlySignals:
    """The signals :func:`catch_early` noted (signal numbers, in order) and the handlers
    it replaced."""

    def __init__(self):
        self.noted: list[int] = []
        self.previous: dict[int, object] = {}

    def _note(self, signum, _frame=None) -> None:
        self.noted.append(signum)

    def release(self, kept=()) -> None:
        """Put the previous handlers back but for the signals of ``kept`` (a
        :class:`Preemption` took them over: :meth:`Preemption.install`); every other
        noted signal is delivered again, now with its previous disposition (by default it
        ends poprun-lite, as it would have without the catch)."""
        for signum, handler in self.previous.items():
            if signum not in kept:
                signal.signal(signum, handler)
        self.previous = {}
        for signum in dict.fromkeys(s for s in self.noted if s not in kept):
            os.kill(os.getpid(), signum)


def catch_early() -> EarlySignals:
    """Note :data:`EARLY_SIGNALS` from now on (call first in ``main``, from the main
    thread): while poprun-lite reads its options and Slurm's settings (``scontrol show
    hostnames``, ``mpirun --version``, up to 30 s each), before it knows whether
    preemption is on; :meth:`EarlySignals.release` decides what they meant."""
    early = EarlySignals()
    for signum in EARLY_SIGNALS:
        early.previous[signum] = signal.signal(signum, early._note)
    return early


# ------------------------------------------------------------------ the job's state

class Preemption:
    """A job's preemption state (module docstring) under ``settings`` (SIGTERM's grace
    read from Slurm now when left to Slurm: :func:`with_grace`); ``scontrol`` is the
    command run for ``show config``, ``show job`` and ``requeue`` (default: from PATH)."""

    def __init__(self, settings: PreemptionSettings, say: Callable[[str], None] = say, scontrol: str | None = None):
        self.settings = with_grace(settings, lambda: kill_wait(scontrol))
        self.say, self.scontrol = say, scontrol
        self.signum: int | None = None     # the first signal
        self.at: float | None = None       # when it came (monotonic)
        self.deadline: float | None = None  # when its grace ends (monotonic); None: no limit (yet)
        self._lock = threading.RLock()     # signal handlers (main thread) and the collector's thread
        self._copies: dict[int, dict[object, int]] = {}  # signal -> source -> copies
        self._events = 0
        self._stop: str | None = None      # a stop decided off the main thread, for poll()
        self._saving = False               # a second signal came after every replica's boundary
        self._told_boundary = False
        self._send: Callable[[int, dict], bool] | None = None
        self._replicas = 0
        self._announced: set[int] = set()  # replica ranks at their boundary, as the last poll saw
        self._sender: threading.Thread | None = None
        self._over = threading.Event()
        self._previous: dict[int, object] = {}
        self._watch: subprocess.Popen | None = None

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

    def install(self, early: EarlySignals | None = None) -> None:
        """Outside an attempt (before the first, between two), note the signals instead
        of dying of them (:meth:`end_unstarted`, or the next attempt asks at once), taking
        over those ``early`` noted (:func:`catch_early`; then release it with
        :attr:`signals` kept). Call from the main thread."""
        for signum in self.signals:
            previous = signal.signal(signum, self._noted)
            self._previous[signum] = early.previous.get(signum, previous) if early is not None else previous
        for signum in list(early.noted if early is not None else ()):
            if signum in self.signals:
                self.on_signal(signum)

    def uninstall(self) -> None:
        """Put the handlers back; end the watch step (:meth:`watch_steps`)."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        proc, self._watch = self._watch, None
        if proc is not None:
            try:
                proc.stdin.close()  # the task reads the end of its input and exits
                proc.wait(WATCH_STOP_SECONDS)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()

    def _noted(self, signum, _frame=None) -> None:
        self.on_signal(signum)

    # the signals ---------------------------------------------------------------

    def _event(self, signum: int, source) -> tuple[bool, int]:
        """Count one copy of ``signum`` from ``source``: (whether it is a new event, the
        number of events so far)."""
        with self._lock:
            copies = self._copies.setdefault(signum, {})
            copies[source] = copies.get(source, 0) + 1
            events = sum(max(per.values()) for per in self._copies.values())
            new, self._events = events > self._events, events
            return new, events

    def _decide(self, signum: int, events: int) -> str | None:
        """What a new event means: None (asks for the checkpoint, or waits for the save),
        "" (a first signal that is not one of :attr:`signals`: stop as without
        preemption), else the stop reason."""
        if self.signum is None:
            if events == 1 and signum in self.signals:
                self.signum, self.at = signum, time.monotonic()
                return None
            return ""
        if events == 2 and self._all_announced():
            self._saving = True
            self.say(f"{signal_name(signum)}: every replica is saving its checkpoint; waiting for it "
                     f"(a third signal stops the job without it)")
            return None
        if self._saving:
            return third_signal(signum)
        return second_signal(signum, self.signum)

    def on_signal(self, signum: int) -> str | None:
        """A signal poprun-lite got (a handler's call): None when it asks the replicas for
        a checkpoint (the first of :attr:`signals`), waits for their save, or is another
        copy of a signal an agent reported; else the reason to stop at once ("" for a
        signal that stops the job as without preemption)."""
        with self._lock:
            if self.signum is None and signum not in self.signals:
                return ""  # e.g. Ctrl-C: not counted, the job stops as without preemption
            new, events = self._event(signum, LAUNCHER)
            return self._decide(signum, events) if new else None

    def on_signalled(self, record: dict) -> None:
        """A ``signalled`` record (a collector callback): Slurm signalled an agent (its
        process of the job's steps, :mod:`popdist_lite_launcher.node.hold_signals`). A new
        event is decided as poprun-lite's own signal is; a stop it decides is returned by
        the next :meth:`poll`. Signals that are not :attr:`signals` are ignored."""
        sender = record.get("sender")
        self._relayed(record.get("signal"), ("rank", record.get("rank")),
                      f"rank {record.get('rank')} on {record.get('host')}" + (f" from pid {sender}" if sender else ""))

    def _relayed(self, name, source, where: str) -> None:
        """Signal ``name`` reported by another process (``source``, ``where`` in words)."""
        try:
            signum = int(signal.Signals[name])
        except KeyError:
            return
        if signum not in self.signals:
            return
        with self._lock:
            first = self.signum is None
            new, events = self._event(signum, source)
            if not new:
                return
            why = self._decide(signum, events)
            if why:
                self._stop = self._stop or why
        if first and self.signum is not None:
            self.say(f"{signal_name(signum)} reached {where} (as Slurm signals the job's steps)")

    def watch_steps(self, node: str | None = None, srun: str | None = None) -> bool:
        """Inside a Slurm job, run poprun-lite's watch step on this node (``node``, default
        ``$SLURMD_NODENAME``): ``srun --overlap`` of one task that holds :attr:`signals`
        and prints each that comes (``hold_signals.py --watch``), read by a thread here as
        one more process's copies: a signal Slurm sends the job's steps then reaches
        poprun-lite even where no rank runs in a step on this node. srun starts with the
        signals blocked, so that it forwards none of its own copies. Stopped by
        :meth:`uninstall`. Whether it started."""
        node = node or os.environ.get("SLURMD_NODENAME")
        srun = srun or shutil.which("srun")
        if not self.signals or self.settings.job_id is None or not node or not srun or self._watch is not None:
            return False

        command = [srun, "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--mpi=none", "--quiet",
                   "--job-name=poprun-lite-signals", sys.executable, "-S", hold_signals.__file__, "--watch"]
        try:
            self._watch = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                env={**os.environ, hold_signals.ENV: hold_signals.env_value(self.signals)},
                start_new_session=True, preexec_fn=child_preexec(lambda: hold_signals.block(self.signals)))
        except OSError as exc:
            self.say(f"no watch step for the job's steps' signals on this node: {exc}")
            return False
        threading.Thread(target=self._read_watch, args=(self._watch, node), daemon=True,
                         name="poprun-lite watch step").start()
        return True

    def _read_watch(self, proc, node: str) -> None:
        for line in proc.stdout:
            self._relayed(line.decode("ascii", "replace").strip()[:16], WATCH, f"the watch step on {node}")

    def _all_announced(self) -> bool:
        """Whether every replica announced its boundary, as the last :meth:`poll` saw (a
        signal handler must not wait for the collector's lock the main thread may hold)."""
        done = self._announced
        return self._replicas > 0 and all(rank in done for rank in range(self._replicas))

    # per attempt -------------------------------------------------------------

    def begin(self, send: Callable[[int, dict], bool], replicas: int) -> None:
        """An attempt of ``replicas`` replicas starts; ``send(rank, record)`` reaches the
        agent of replica rank ``rank``."""
        self._send, self._replicas = send, replicas
        self._announced = set()
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
        came; the stop reason when one was decided (:meth:`on_signalled`), or once the
        grace is over and a replica rank is not in ``stopped()`` (the ranks that reached
        a boundary: announced it with ``resize_stop``), else None."""
        self._announced = set(stopped())
        if self._stop:
            return self._stop
        if self.signum is None:
            return None
        if self._sender is None and self._send is not None:
            self._sender = threading.Thread(target=self._send_requests, daemon=True,
                                            name="poprun-lite preemption")
            self._sender.start()
        if self._all_announced():
            if not self._told_boundary:
                self._told_boundary = True
                self.say("every replica reached its step boundary; waiting for their checkpoint")
            return None
        now = time.monotonic() if now is None else now
        if self.deadline is None or now <= self.deadline:
            return None
        return grace_expired(round(self.deadline - self.at, 1), self.signum, self._replicas, self._announced)

    def _grace(self) -> tuple[float | None, str]:
        """The first signal's grace in seconds (None: no limit) and the words for it."""
        if self.signum != self.settings.requeue_signal:
            return self.settings.grace, f"within {self.settings.grace:g} s"
        if self.settings.requeue_grace is not None:
            return self.settings.requeue_grace, f"within {self.settings.requeue_grace:g} s (--preemption-grace)"
        if self.settings.job_id is None:
            return None, "no time limit: not in a Slurm job"
        end = job_end(self.settings.job_id, self.scontrol)
        if end is None:
            return None, "no time limit: Slurm shows no end time for the job"
        grace = max(0.0, end - END_MARGIN_SECONDS - (time.time() - (time.monotonic() - self.at)))
        return grace, (f"within {grace:.0f} s: until the job's end at {time.strftime('%H:%M:%S', time.localtime(end))} "
                       f"less {END_MARGIN_SECONDS:g} s")

    def _send_requests(self) -> None:
        if self.deadline is None:
            grace, words = self._grace()
            if grace is not None:
                self.deadline = self.at + grace
            self.say(f"{signal_name(self.signum)}: asking the replicas to checkpoint at their next step "
                     f"boundary ({words})")
        StopRequest(self._send, self._replicas, self._replicas).send_until(self._over)

    # the end ----------------------------------------------------------------

    def finish(self, saved: set[int] = frozenset()) -> tuple[int, str]:
        """The replicas stopped at a boundary after :attr:`signum` (``saved``: the replica
        ranks that reported their checkpoint saved): requeue the job when asked to and
        allowed (:func:`requeue_decision`); the exit code (128 + signal) and what
        happened, for the report."""
        name = signal_name(self.signum)
        missing = [rank for rank in range(self._replicas) if rank not in saved]
        if missing:
            text = f"stopped at a step boundary after {name}, but {counted('rank', missing)} reported no checkpoint saved"
        else:
            text = f"stopped at a step boundary after {name} (checkpoint saved)"
        return self._ended(text)

    def end_unstarted(self) -> tuple[int, str]:
        """:attr:`signum` came while no replica ran (start-up, between attempts): the job
        ends at once, requeued after the requeue signal (the requeued job resumes from
        the newest checkpoint); the exit code and what happened."""
        return self._ended(f"{signal_name(self.signum)} came while no replica was running: nothing to save")

    def _ended(self, text: str) -> tuple[int, str]:
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
        try:
            scontrol.run(["requeue", job], command=self.scontrol)
        except LauncherError as exc:
            return f"not requeued: {exc}"
        return f"requeued (scontrol requeue {job})"

    def _requeueable(self) -> bool | str:
        if not self.settings.requeue or self.settings.job_id is None:
            return True  # not asked: requeue_decision says why
        try:
            out = scontrol.run(["show", "job", "-o", self.settings.job_id], command=self.scontrol)
        except LauncherError as exc:
            return str(exc)
        return parse_requeue(out) if parse_requeue(out) is not None else \
            "`scontrol show job` shows no Requeue= field"


def requeue_decision(settings: PreemptionSettings, requeueable: bool | str) -> str:
    """Why the job is not requeued ("" when it is): ``--no-requeue``, outside Slurm, the
    job may not be requeued (``requeueable`` False: ``Requeue=0``), or what went wrong
    finding out (``requeueable`` a text)."""
    if not settings.requeue:
        return "--no-requeue"
    if settings.job_id is None or not scontrol.JOB_ID.fullmatch(settings.job_id):
        return "not in a Slurm job"
    if isinstance(requeueable, str):
        return requeueable
    if not requeueable:
        return "the job may not be requeued: Requeue=0 (submit it with sbatch --requeue)"
    return ""
