"""The failure report printed by poprun-lite after a failed job (torchrun style).

Inputs are the records the launcher's collector received from the ranks' agents
(format: :mod:`popdist_lite.records`):

* ``exit`` from the agent when its program ended (those of programs that succeeded
  are left out): exit code or signal, stderr tail, ``terminated``;
* ``error`` from ``popdist_lite._excepthook`` on an uncaught exception: exception
  class, message, traceback;
* ``lost`` from the collector when an agent vanished (killed, or its host down).

Records of host feed processes have ``role == "feeder"``, ``replica`` = the replica
they feed and ``feeder`` = their index; they are titled ``feeder K of replica N``.

The root cause is the earliest failure that is not a consequence of the job being
stopped; failures within a second of it count as simultaneous, and among those an
exception, then a signal, then a lost agent wins over a plain exit code (the same error
on several replicas: the lowest replica's). "Earliest" is
by the launcher's own clock: the ``received`` stamp the collector puts on every record
(:mod:`popdist_lite_launcher.supervise.collector`), never the ``time`` a rank's host wrote, which
may be seconds off on another host. Pure functions on plain dicts: no MPI, no processes.
"""

from __future__ import annotations

import signal as _signal
from dataclasses import dataclass

from ..core.text import indent

#: Lines of a rank's stderr tail shown in the report.
SHOWN_TAIL_LINES = 40


@dataclass
class Failure:
    """What is known about one failed rank (merged exit and error records)."""

    rank: int | None
    replica: int | None
    role: str
    host: str | None
    pid: int | None
    time: float  # the launcher's stamp (``received``); see merge_records
    exitcode: int | None = None
    signal: str | None = None
    terminated: bool = False
    exception: str | None = None
    message: str | None = None
    traceback: str | None = None
    stderr_tail: str = ""
    has_exit_record: bool = False
    feeder: int | None = None  # index of a feeder among its replica's feeders
    lost: str | None = None    # why the launcher lost contact with the rank's agent

    @property
    def raised(self) -> bool:
        """Did the rank raise an uncaught exception of its own (not KeyboardInterrupt)?"""
        return bool(self.exception) and self.exception != "KeyboardInterrupt"

    @property
    def is_candidate(self) -> bool:
        """Can this failure be the root cause? Not when the rank was told to stop,
        unless it had raised an exception of its own (other than KeyboardInterrupt)."""
        return self.raised or not self.terminated

    def status(self) -> str:
        """``signal SIGX`` or ``exit code N``.

        The failure hook always aborts with code 1, so an exception reads ``exit code 1``:
        without an exit record (the agent was killed by the abort first), and when the
        rank was then stopped by a signal (mpirun's SIGTERM after the abort it asked for,
        a consequence, not the cause)."""
        if self.raised:
            return "exit code 1"
        if self.lost and not self.has_exit_record:
            return f"lost: {self.lost}"
        if self.signal:
            return f"signal {self.signal}"
        if self.exitcode is not None:
            return f"exit code {self.exitcode}"
        return "exit code 1" if self.exception else "failed"

    def launcher_exit_code(self) -> int:
        """The exit code the launcher should use for this failure (1 to 255: a process
        exit status keeps only 8 bits, and 256 would read as success)."""
        if self.raised:
            return 1
        if self.signal:
            try:
                return 128 + int(_signal.Signals[self.signal])
            except KeyError:
                return 1
        return self.exitcode if self.exitcode and self.exitcode < 256 else 1

    def name(self) -> str:
        """``replica 1``, ``feeder 0 of replica 1``."""
        if self.role == "replica":
            return f"replica {self.replica}"
        if self.feeder is not None:
            return f"{self.role} {self.feeder} of replica {self.replica}"
        return f"{self.role} of replica {self.replica}"

    def title(self) -> str:
        """``replica 1 (rank 1, host h, pid 123)``, naming the role if not a replica
        (``feeder 0 of replica 1 (...)``)."""
        name = self.name()
        details = [f"rank {self.rank}" if self.rank is not None else None,
                   f"host {self.host}" if self.host else None,
                   f"pid {self.pid}" if self.pid is not None else None]
        details = ", ".join(d for d in details if d)
        return f"{name} ({details})" if details else name


def merge_records(records: list[dict]) -> list[Failure]:
    """Merge the ``exit``, ``error`` and ``lost`` records of each rank into one
    :class:`Failure`, sorted by time; ranks that only exited with code 0 are left out.

    A failure's :attr:`Failure.time` is the launcher's stamp of its error record (the
    exception), else of its exit or lost record (when its agent was last heard from):
    the record's ``received`` field, the launcher's ``time.monotonic()``. Records without
    one (not from a collector) use their own ``time``; the two are never mixed in one
    report by the launcher.
    """
    by_rank: dict = {}
    for record in records:
        if record.get("kind") not in ("exit", "error", "lost"):
            continue
        key = record.get("rank")
        if key is None:
            key = ("pid", record.get("pid"))
        by_rank.setdefault(key, {})[record["kind"]] = record
    failures = []
    for parts in by_rank.values():
        exit_rec, error_rec, lost_rec = parts.get("exit"), parts.get("error"), parts.get("lost")
        if exit_rec and not error_rec and not exit_rec.get("exitcode") \
                and not exit_rec.get("signal"):
            continue  # succeeded
        base = exit_rec or error_rec or lost_rec
        if base is None:
            continue
        failure = Failure(rank=base.get("rank"), replica=base.get("replica"),
                          role=base.get("role") or "replica", host=base.get("host"),
                          pid=base.get("pid"), time=_stamp(base),
                          feeder=base.get("feeder", (error_rec or {}).get("feeder")))
        if exit_rec:
            failure.has_exit_record = True
            failure.exitcode = exit_rec.get("exitcode")
            failure.signal = exit_rec.get("signal")
            failure.terminated = bool(exit_rec.get("terminated"))
            failure.stderr_tail = exit_rec.get("stderr_tail") or ""
        if error_rec:
            failure.time = _stamp(error_rec)
            failure.exception = error_rec.get("exception")
            failure.message = error_rec.get("message")
            failure.traceback = error_rec.get("traceback")
        if lost_rec:
            failure.lost = lost_rec.get("reason") or "lost contact"
            if not exit_rec:
                failure.terminated = bool(lost_rec.get("terminated"))
        failures.append(failure)
    failures.sort(key=lambda f: (f.time, f.rank if f.rank is not None else -1))
    return failures


def _stamp(record: dict) -> float:
    """When ``record`` arrived at the launcher (``received``), else its own ``time``."""
    stamp = record.get("received", record.get("time"))
    return float(stamp) if isinstance(stamp, (int, float)) else 0.0


#: Failures this close to the earliest candidate count as simultaneous (seconds).
SIMULTANEOUS_SECONDS = 1.0


def _primacy(failure: Failure) -> int:
    """How surely a failure is a cause of its own: an exception the rank raised (0), a
    signal it did not get from us (1), a lost agent (2), an exit code (3) - the MPI
    library's exit when a peer vanished comes milliseconds after the peer's death."""
    if failure.raised:
        return 0
    if failure.signal:
        return 1
    if failure.lost and not failure.has_exit_record:
        return 2
    return 3


def root_cause(failures: list[Failure]) -> Failure | None:
    """The root cause, or None: among the candidates within :data:`SIMULTANEOUS_SECONDS`
    of the earliest one, the one of the most primary kind (:func:`_primacy`), earliest
    first."""
    candidates = sorted((f for f in failures if f.is_candidate), key=lambda f: f.time)
    if not candidates:
        return None
    first = candidates[0].time
    close = [f for f in candidates if f.time - first <= SIMULTANEOUS_SECONDS]
    cause = min(close, key=lambda f: (_primacy(f), f.time))
    # the same error on several replicas at once (a collective's check raises it on every
    # one): the lowest names it, whichever record came first
    return min((f for f in close if f is cause or same_error(f, cause)),
               key=lambda f: (f.rank if f.rank is not None else -1, f.time))


def format_report(failures: list[Failure], exit_code: int, *, reason: str | None = None,
                  mpirun_tail: str = "", cause: str | None = None) -> str:
    """Format the report (no trailing newline).

    The root cause's error is told once (:func:`_error_lines`); another failure with
    the same error reads ``the same error`` (:func:`same_error`), and the ranks stopped
    because of the root cause are named in one line (``stopped after it:``; how each
    ended is in the job's log). ``reason`` replaces "job failed" in the first line (e.g. "job interrupted by
    SIGINT"); ``mpirun_tail`` is shown when there are no records at all. ``cause`` is a
    root cause found by the launcher itself (the stall inspector's block, starting with
    ``root cause:``): it is shown instead of one taken from the records, which then all
    read as stopped ranks.
    """
    lines = [f"poprun-lite: {reason or 'job failed'} (exit code {exit_code})"]
    if cause is not None:
        lines.append(cause)
        if failures:  # every rank was stopped because of it: how each ended is in the job's log
            lines.append(f"stopped after it: {', '.join(sorted((f.name() for f in failures), key=_natural))}")
        return "\n".join(lines)
    if not failures:
        if reason:  # stopped on purpose: nothing failed on its own
            return "\n".join(lines)
        lines.append("no failure records from the ranks; last lines of mpirun's output:"
                     if mpirun_tail.strip() else "no failure records from the ranks")
        lines += indent(mpirun_tail, max_lines=SHOWN_TAIL_LINES)
        return "\n".join(lines)
    cause = root_cause(failures)
    if cause is not None:
        lines.append(f"root cause: {cause.title()}: {cause.status()}")
        lines += _error_lines(cause)
    others = [f for f in failures if f is not cause]
    stopped = [f for f in others if cause is not None and not f.is_candidate]
    others = [f for f in others if f not in stopped]
    if others:
        lines.append("other failures:" if cause is not None else "stopped ranks:")
        for failure in others:
            if cause is not None and same_error(failure, cause):
                lines.append(f"  {failure.title()}: the same error")
                continue
            text = f"  {failure.title()}: {failure.status()}"
            if failure.exception:
                text += f": {failure.exception}: {failure.message}"
            if failure.terminated and not failure.is_candidate:  # no cause: stopped on purpose
                text += " (terminated)"
            lines.append(text)
            if failure.is_candidate:  # an independent failure: show its error too
                if failure.traceback:
                    lines += indent(failure.traceback, "    ", 15)
                elif failure.stderr_tail.strip():
                    lines += indent(failure.stderr_tail, "    ", 15)
    if stopped:  # consequences: how each ended is in the job's log
        lines.append(f"stopped after it: {', '.join(sorted((f.name() for f in stopped), key=_natural))}")
    return "\n".join(lines)


def _natural(name: str) -> list:
    """``replica 10`` after ``replica 2``; a word and a number compare (numbers first), so
    any two names sort, whatever the records called their ranks."""
    return [(0, int(part), "") if part.isdecimal() else (1, 0, part) for part in name.split()]


def _error_lines(cause: Failure) -> list[str]:
    """The root cause's error, indented, told once: its traceback (which ends with the
    exception's line; that line first only when the traceback lacks it), else the end
    of its stderr."""
    if cause.traceback:
        said = f"{cause.exception}: {cause.message}" if cause.message else f"{cause.exception}"
        head = [] if said in cause.traceback else [f"  {said}"]
        return head + indent(cause.traceback)
    if cause.stderr_tail.strip():
        return indent(cause.stderr_tail, max_lines=SHOWN_TAIL_LINES)
    return ["  (no output on stderr)"] if cause.has_exit_record else []


def same_error(failure: Failure, cause: Failure) -> bool:
    """Whether ``failure`` tells what ``cause`` already told: the same exception and
    message (a collective's error, raised on every replica), or, without exceptions, the
    same status and end of stderr (every replica's import error)."""
    if failure.exception or cause.exception:
        return failure.raised and cause.raised and \
            (failure.exception, failure.message) == (cause.exception, cause.message)
    if failure.signal or failure.status() != cause.status():
        return False
    return bool(cause.stderr_tail.strip()) and failure.stderr_tail.strip() == cause.stderr_tail.strip()


def log_failure(log, failure: Failure) -> None:
    """Write ``failure``'s whole error to ``log`` (a :class:`~.joblog.JobLog`): the end
    of its stderr (:data:`SHOWN_TAIL_LINES` of which the report shows, once), and its
    traceback when the tail lacks it."""
    tail, traceback = failure.stderr_tail or "", failure.traceback or ""
    parts = [traceback] if traceback.strip() and traceback.strip() not in tail else []
    parts.append(tail if tail.strip() else "(no output on stderr)")
    log.section(f"{failure.title()}: {failure.status()}", "\n".join(p.rstrip("\n") for p in parts))


def summary(failures: list[Failure], *, reason: str | None = None, stalled: bool = False) -> str:
    """One line naming what ended a failed attempt: the root cause's title and status,
    ``stall`` when the stall inspector ended it, else ``reason`` or ``failed``."""
    if stalled:
        return "stall (the stall inspector ended the job)"
    cause = root_cause(failures)
    if cause is not None:
        return f"{cause.title()}: {cause.status()}"
    return reason or "failed"


def exit_code_for(failures: list[Failure], mpirun_code: int) -> int:
    """The launcher's exit code: the root cause's code (128+signal for signals),
    else mpirun's own code; 1 to 255, never 0 for a failed job."""
    cause = root_cause(failures)
    if cause is not None:
        return cause.launcher_exit_code()
    code = 128 - mpirun_code if mpirun_code < 0 else mpirun_code
    return code if 0 < code < 256 else 1


def format_ignored(refused: dict[str, int], dropped: dict[str, int]) -> str | None:
    """One line counting what the collector did not believe, by reason (never the
    content): ``refused`` unauthenticated connections and ``dropped`` malformed lines
    of authenticated ones. None when both are empty."""
    refused = {reason: n for reason, n in refused.items() if n}
    dropped = {reason: n for reason, n in dropped.items() if n}

    def counted(counts: dict[str, int], what: str) -> str:
        reasons = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
        details = ", ".join(f"{count} {reason}" for reason, count in reasons)
        return f"{sum(counts.values())} {what} ({details})"

    parts = []
    if refused:
        parts.append(counted(refused, "unauthenticated connection(s) to the collector"))
    if dropped:
        parts.append(counted(dropped, "malformed line(s) from the agents"))
    return f"poprun-lite: ignored {' and '.join(parts)}" if parts else None
