"""The job's attempts: one loop (:class:`AttemptsLoop`) for every job, a membership
policy (:class:`~popdist_lite_launcher.core.api.MembershipPolicy`:
:mod:`popdist_lite_launcher.membership.policies`, or the Slurm backend's) deciding each
attempt's hosts, and a :class:`~popdist_lite_launcher.core.api.Launcher` starting each
attempt's processes (:class:`~popdist_lite_launcher.ssh.launcher.SshLauncher` or
:class:`~popdist_lite_launcher.slurm.launcher.SlurmLauncher`: mpirun over the launch agent
or through Slurm). The vocabulary is :mod:`popdist_lite_launcher.core.api`.

One attempt: the policy gives its membership (a fixed job: ``--num-replicas`` over
``-H``/``--hostfile`` or this machine, every time; an elastic job: the usable
discovered hosts, waiting for ``--min-replicas``), the launcher runs it and returns its
:class:`~popdist_lite_launcher.core.api.Outcome`, or raises
:class:`~popdist_lite_launcher.core.api.AttemptError` when it could not start it (hosts
failing their check, no collector, no mpirun). The loop then decides, the same way for
every job:

* **succeeded**: every rank exited 0, and no ``resize_stop`` came unasked. The job is done.
* **stopped for a resize**: every rank exited 0 after the replicas sent ``resize_stop``
  in an attempt whose resize monitor asked for a resize (elastic jobs only). The next
  attempt runs on the new membership; not counted against ``--max-restarts``.
* **lost a host** (elastic jobs): it failed, and a host it used is no longer discovered
  or fails its probe. The next attempt runs on the hosts left; not counted.
* **failed**: anything else, including a ``resize_stop`` no resize was asked for (the
  report names the rank that sent it). Counted: the job ends when failures exceed
  ``--max-restarts``, at once on a signal, ``--timeout``, an internal error or an
  :class:`AttemptError` (exit code 2).

A scheduler's signal (``--preemption``, :mod:`popdist_lite_launcher.slurm.preempt`) ends the
job: during an attempt once the replicas stopped at their boundary (or failed to), and
one noted while no attempt runs before the next one starts (requeued after the requeue
signal: there is nothing to save).

Every failed attempt prints its report; the job's last report ends with the attempts
(``attempts:``, one line each: membership, why it has it, how it ended), and a job that
succeeded after more than one attempt prints them too. An exception anywhere in the loop
(a bug in the launcher) ends the job with exit code 1, printing what is known: the last
attempt's failures, the attempts, the error. Discovery and probe processes are killed at
the end of every attempt (:func:`popdist_lite_launcher.launch.children.kill_all`). Model:
torchrun's elastic agent (one run loop over typed worker-group state).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

from .core.api import (Attempt, AttemptError, AttemptResult, Launcher, LauncherError, Membership, MembershipPolicy,
                       Send, Wait, Watcher)
from .core.text import describe_exception, hosts_text, say
from .core.options import Options
from .core.plan import RESTART_COUNT_ENV
from .launch import children
from .supervise import joblog, report
from .supervise.timeline import TRACE

#: What the report says of a ``resize_stop`` record no resize was asked for, after its sender.
UNASKED = "sent resize_stop, but poprun-lite asked for no resize in this attempt"


# ------------------------------------------------------------------ the history

@dataclass
class AttemptRecord:
    """One attempt in the report: its number (from 1), membership, why it has that
    membership, and how it ended."""

    number: int
    membership: Membership
    why: str = ""
    outcome: str = "running"

    def line(self) -> str:
        why = f", after {self.why}" if self.why else ""
        return f"  attempt {self.number}: {self.membership.describe()}{why}; {self.outcome}"


def format_attempts(history: list[AttemptRecord]) -> str:
    """``attempts:`` and one line per attempt (membership, why, outcome)."""
    return "\n".join(["attempts:", *(record.line() for record in history)])


def sender(record: dict) -> str:
    """``replica 0 (rank 0, host h, pid 12)``: who sent ``record`` (its identity fields)."""
    return report.Failure(rank=record.get("rank"), replica=record.get("replica"),
                          role=record.get("role") or "replica", host=record.get("host"),
                          pid=record.get("pid"), time=0.0, feeder=record.get("feeder")).title()


def exit_code(result: AttemptResult) -> int:
    """The exit code of a failed attempt."""
    if result.internal_error:
        cause = report.root_cause(result.failures)
        return cause.launcher_exit_code() if cause is not None else 1
    if result.timed_out:
        return 124
    if result.stop_signal is not None:
        return 128 + result.stop_signal
    if result.stall is not None:
        return 1
    return report.exit_code_for(result.failures, result.returncode)


# ------------------------------------------------------------------ the loop

class AttemptsLoop:
    """Runs a job's attempts (module docstring) with ``launcher`` under ``policy``;
    :meth:`run` returns the exit code. ``history``, ``last`` (the last attempt's
    :class:`~popdist_lite_launcher.core.api.AttemptResult`), ``refused`` and ``dropped`` (the
    collectors' counts, added up) stay readable afterwards."""

    def __init__(self, opts: Options, launcher: Launcher, policy: MembershipPolicy,
                 say: Callable[[str], None] = say, preemption=None):
        self.opts, self.launcher, self.policy, self.say = opts, launcher, policy, say
        self.preemption = preemption  # slurm.preempt.Preemption: a signal asked for a checkpoint
        self.history: list[AttemptRecord] = []
        self.last: AttemptResult | None = None
        self.refused: dict[str, int] = {}
        self.dropped: dict[str, int] = {}
        self.failures = 0

    def _of(self) -> str:
        """`` of N`` after an attempt's number when the number of attempts is known
        (a fixed job: ``--max-restarts`` + 1)."""
        return "" if self.policy.elastic else f" of {self.opts.max_restarts + 1}"

    def run(self) -> int:
        """Run the attempts; the job's exit code. Never raises for a launcher bug (it is
        printed with what is known, exit code 1)."""
        try:
            return self._run()
        except Exception as exc:  # noqa: BLE001 - a bug in the launcher: report what is known
            if self.history and self.history[-1].outcome == "running":
                self.history[-1].outcome = "ended by an internal error in poprun-lite"
            self._print_internal_error(exc)
            return 1
        finally:
            children.kill_all()

    def _run(self) -> int:
        opts, say = self.opts, self.say
        deadline = time.monotonic() + opts.timeout if opts.timeout else None
        try:
            self.policy.start()
        except LauncherError as exc:
            print(f"poprun-lite: error: {exc}", file=sys.stderr, flush=True)
            return 2
        why = ""
        while True:
            membership = self.policy.next(deadline, say)
            if isinstance(membership, Wait):
                return self._end_before_an_attempt(membership.text, membership.code)
            if self.preemption is not None and self.preemption.asked:  # a signal while no replica ran
                code, text = self.preemption.end_unstarted()
                return self._end_before_an_attempt(f"job {text}", code)
            record = AttemptRecord(len(self.history) + 1, membership, why)
            self.history.append(record)
            if self.policy.elastic or record.number > 1:
                say(f"attempt {record.number}{self._of()}: {membership.describe()}"
                    + (f", after {why} ({RESTART_COUNT_ENV}={record.number - 1})" if why else ""))
            code, why = self._attempt(record, deadline)
            if code is not None:
                return code

    def _end_before_an_attempt(self, text: str, code: int) -> int:
        """The job ends before its next attempt: ``poprun-lite: TEXT (exit code CODE)`` and
        the attempts so far; ``code``."""
        lines = [f"poprun-lite: {text} (exit code {code})"]
        if self.history:
            lines.append(format_attempts(self.history))
        print("\n".join(lines), file=sys.stderr, flush=True)
        return code

    def _attempt(self, record: AttemptRecord, deadline: float | None) -> tuple[int | None, str]:
        """Run the attempt of ``record``, print its report: ``(exit code, "")`` when the
        job ends here, else ``(None, why the next attempt runs)``."""
        say = self.say
        left = None if deadline is None else max(0.001, deadline - time.monotonic())
        watchers: list[Watcher] = []
        watch = self.policy.watch(record.membership, say)

        def make_watcher(send: Send) -> Watcher:
            watchers.append(watch(send))
            return watchers[-1]

        attempt = Attempt(record.number - 1, record.membership, left, hosts_checked=self.policy.elastic,
                          watch=make_watcher if watch is not None else None)
        try:
            outcome = self.launcher.run(attempt)
        except AttemptError as exc:
            record.outcome = f"could not be started: {exc} (exit code 2)"
            print(f"poprun-lite: error: {exc}\n{format_attempts(self.history)}", file=sys.stderr, flush=True)
            return 2, ""
        finally:
            children.kill_all()  # what discovery or a probe of this attempt left
        result = self._noted(outcome.result)
        asked = next((w for w in watchers if w.asked), None)
        clean = result.returncode == 0 and not result.stop_reason and not result.failures \
            and not result.internal_error
        preempted = self.preemption is not None and self.preemption.asked
        unasked = outcome.resize_stops if asked is None and not preempted else []
        if clean and preempted and outcome.resize_stops:  # stopped for the scheduler (preempt.py)
            code, record.outcome = self.preemption.finish(result.saved)
            print(f"poprun-lite: job {record.outcome} (exit code {code}); {format_attempts(self.history)}",
                  file=sys.stderr, flush=True)
            return code, ""
        if clean and outcome.resize_stops and asked is not None:
            record.outcome = f"stopped at a step boundary for a resize ({asked.reason})"
            say(f"attempt {record.number} stopped for a resize ({asked.reason}); starting the next")
            return None, asked.reason or "a resize"
        if clean and not unasked:
            record.outcome = "succeeded"
            self._print_timeline()
            if len(self.history) > 1:
                print(f"poprun-lite: job succeeded on attempt {record.number}{self._of()}; "
                      + format_attempts(self.history), file=sys.stderr, flush=True)
            return 0, ""
        return self._failed(record, result, unasked if clean else [], [] if clean else unasked,
                            outcome.unreachable)

    def _failed(self, record: AttemptRecord, result: AttemptResult, cause_stops: list[dict],
                other_stops: list[dict], unreachable: dict[str, str]) -> tuple[int | None, str]:
        """A failed attempt: its report, and whether the job goes on. ``cause_stops``:
        the ``resize_stop`` records no resize was asked for, when they are what failed
        (the ranks all exited 0); ``other_stops``: such records in an attempt that failed
        anyway (named after its report); ``unreachable``:
        :attr:`Outcome.unreachable <popdist_lite_launcher.core.api.Outcome>`."""
        opts, say = self.opts, self.say
        cause, stop_reason = result.stall, result.stop_reason
        if result.timed_out and opts.timeout:  # the attempt had what was left of --timeout
            stop_reason = f"job timed out after {opts.timeout:g} s"
        if cause_stops:
            code = 1
            cause = f"root cause: {sender(cause_stops[0])} {UNASKED}"
            summary = f"{sender(cause_stops[0])} sent resize_stop unasked"
        else:
            code = exit_code(result)
            summary = report.summary(result.failures, reason=stop_reason, stalled=result.stall is not None)
        final = result.stop_signal is not None or result.timed_out or result.internal_error is not None
        lost = [] if final else self.policy.lost(record.membership, say, unreachable)
        if lost:
            record.outcome = f"{hosts_text(lost)} lost: {summary} (exit code {code})"
        else:
            self.failures += 1
            record.outcome = f"failed: {summary}" + ("" if summary.endswith(f"exit code {code}")
                                                     else f" (exit code {code})")
            final = final or self.failures > opts.max_restarts
        if result.internal_error:
            reason = "job stopped after an internal error in poprun-lite"
        elif final:
            reason = stop_reason or "job failed"
        else:
            reason = f"attempt {record.number}{self._of()} failed"
        text = report.format_report(result.failures, code, reason=reason, mpirun_tail=result.mpirun_tail,
                                    cause=cause)
        text += "".join(f"\n{sender(r)} {UNASKED}" for r in [*cause_stops[1:], *other_stops])
        if result.internal_error:
            text += f"\npoprun-lite: internal error: {result.internal_error}"
        if final:
            text += "\n" + format_attempts(self.history)
            if joblog.LOG.path is not None:
                text += f"\nlog (every failed rank's whole error, MPI's messages): {joblog.LOG.path}"
            if self.opts.timeline:
                partial = "the job stalled" if result.stall is not None else \
                    "the job timed out" if result.timed_out else \
                    "the job was stopped" if result.stop_signal is not None else "the job failed"
                text += "\n" + TRACE.deliver(os.path.abspath(self.opts.timeline), partial)
            print(text, file=sys.stderr, flush=True)
            return code, ""
        print(text, file=sys.stderr, flush=True)
        if lost:
            why = f"{hosts_text(lost)} lost"
            say(f"{why}: restarting on the hosts left (a change of membership, not counted "
                f"against --max-restarts)")
            return None, why
        say(f"restarting the job after failure {self.failures} of at most {opts.max_restarts} "
            f"(--max-restarts)")
        return None, "a failure"

    def _noted(self, result: AttemptResult) -> AttemptResult:
        """``result``, kept as the last one, its collector's counts added up."""
        self.last = result
        for total, counts in ((self.refused, result.refused), (self.dropped, result.dropped)):
            for reason, count in counts.items():
                total[reason] = total.get(reason, 0) + count
        return result

    def _print_timeline(self) -> None:
        """The timeline the replicas sent (:mod:`~popdist_lite_launcher.supervise.timeline`), written."""
        if self.opts.timeline:
            say(TRACE.deliver(os.path.abspath(self.opts.timeline)))

    def _print_internal_error(self, exc: Exception) -> None:
        """What is known when the launcher itself failed outside :func:`~popdist_lite_launcher.launch.mpirun.run_mpirun`:
        the last attempt's failures, the attempts so far, and the error."""
        lines = ["poprun-lite: job ended by an internal error in poprun-lite (exit code 1)"]
        if self.last is not None:
            for failure in self.last.failures:
                try:
                    lines.append(f"  {failure.title()}: {failure.status()}")
                except Exception:  # noqa: BLE001 - print what can be printed
                    lines.append(f"  rank {getattr(failure, 'rank', '?')}: failed")
        if self.history:
            try:
                lines.append(format_attempts(self.history))
            except Exception:  # noqa: BLE001
                pass
        lines.append(f"poprun-lite: internal error: {describe_exception(exc)}")
        print("\n".join(lines), file=sys.stderr, flush=True)
