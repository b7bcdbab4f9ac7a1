"""Running the mpirun command: signals, timeout, lost ranks, hard kill, failure records.

:func:`run_mpirun` starts mpirun in a new session (first removing the session
directories killed mpiruns left: :mod:`~popdist_lite_launcher.launch.session_dirs`), passes its
stdout and stderr through (keeping stderr's last lines, and ending a line the job left
unfinished; the MPI library's messages about the job's end go to the job's log instead,
:mod:`~popdist_lite_launcher.supervise.mpi_messages`, with every failed rank's whole error), forwards SIGINT/SIGTERM to it, enforces ``--timeout``, stops the job when the collector has lost a rank's agent (a host went down: mpirun may wait
for it for minutes) or when mpirun is still running
``FAILED_JOB_STOP_DELAY_SECONDS`` after a rank failed, and if the job is not gone
``SESSION_KILL_DELAY_SECONDS`` after being told to stop, SIGKILLs every process of
mpirun's session (mpirun gives each rank its own process group, so killing one group
is not enough). The failures come from the collector's records. Whatever goes wrong in
the launcher itself, the session is killed in a ``finally`` (here, and in ``main`` for
anything outside :func:`run_mpirun`: :func:`kill_sessions`), so a job is never left
running without its supervisor. If the launcher itself is killed (SIGKILL: no
``finally``), mpirun gets SIGKILL from the kernel (``PR_SET_PDEATHSIG``) and every agent,
on every host, sees its connection to the launcher end and SIGKILLs its program
(:mod:`popdist_lite_launcher.node.agent`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from . import session_dirs
from ..core.api import AttemptResult
from ..core.text import describe_exception
from ..node import hold_signals
from ..node.hold_signals import child_preexec
from ..node.procfs import stat_fields
from ..node.tee import Tee
from ..supervise import joblog, report
from ..supervise.mpi_messages import EndMessages
from ..supervise.timeline import TRACE

#: Seconds between asking mpirun to stop and SIGKILLing every process of its session.
SESSION_KILL_DELAY_SECONDS = 8.0
#: Seconds mpirun gets to end the job by itself after a rank failed.
FAILED_JOB_STOP_DELAY_SECONDS = 10.0
MPIRUN_TAIL_LINES = 50


def session_pids(sid: int) -> list[int]:
    """PIDs of the live processes in session ``sid`` (Linux /proc; [] elsewhere)."""
    pids = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return pids
    for entry in entries:
        fields = stat_fields(int(entry)) if entry.isdecimal() else None
        if fields and len(fields) > 3 and fields[3] == str(sid):  # state ppid pgrp session ...
            pids.append(int(entry))
    return pids


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (mpirun's, as it leads it)."""
    for pid in session_pids(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(sid, signal.SIGKILL)
    except OSError:
        pass


def kill_sessions() -> None:
    """SIGKILL what is left of every session :func:`run_mpirun` started and has not seen
    end (the launcher's last resort, in ``main``'s ``finally``)."""
    for sid in list(_sessions):
        kill_session(sid)
        _sessions.discard(sid)


_sessions: set[int] = set()  # mpirun sessions started by run_mpirun and not yet over


def run_mpirun(cmd: list[str], collector, *, timeout: float | None = None,
               env: dict[str, str] | None = None, inspector=None, preemption=None) -> AttemptResult:
    """Run ``cmd`` (an mpirun command) to completion; failures come from ``collector``
    (a :class:`~popdist_lite_launcher.supervise.collector.Collector` whose address the ranks got).

    SIGINT/SIGTERM received meanwhile are forwarded to mpirun; ``timeout`` seconds
    (None/0: no limit) after the start mpirun gets SIGTERM, and so it does when the
    collector reports a failure and mpirun is still running
    ``FAILED_JOB_STOP_DELAY_SECONDS`` later (at once for a lost agent). ``inspector``
    (a :class:`~popdist_lite_launcher.supervise.inspector.StallInspector`) is polled every 0.1 s;
    when it returns a block (stall timeout) the job is stopped too and the block is kept
    in :attr:`AttemptResult.stall`. ``preemption`` (a
    :class:`~popdist_lite_launcher.slurm.preempt.Preemption` bound to this attempt, or None):
    its signals ask the replicas for a checkpoint instead of stopping mpirun, and it is
    polled every 0.1 s too: when it returns a reason (grace over, a second signal) the
    job is stopped with that reason; its first signal is :attr:`AttemptResult.stop_signal`.
    With ``preemption``, mpirun starts with its signals (SIGTERM, the requeue signal)
    blocked and every stop sends it SIGINT instead
    (:mod:`popdist_lite_launcher.node.hold_signals`); the replica ranks that reported their
    checkpoint saved are :attr:`AttemptResult.saved`.
    In every case the whole session is SIGKILLed if still
    alive ``SESSION_KILL_DELAY_SECONDS`` later. An exception while supervising (a bug
    in the launcher) SIGKILLs the session at once (in a ``finally``: the job is never
    left running unsupervised) and is returned in :attr:`AttemptResult.internal_error`,
    with the failures recorded so far.
    Must be called from the main thread (it installs signal handlers).

    Raises:
        OSError: mpirun cannot be started.
    """
    return _Supervision(cmd, collector, timeout, env, inspector, preemption).run()


class _Supervision:
    """One call of :func:`run_mpirun` (its arguments, module docstring): mpirun's process,
    the copies of its output, when it was told to stop, and the result so far."""

    def __init__(self, cmd: list[str], collector, timeout: float | None, env: dict[str, str] | None,
                 inspector, preemption):
        self.cmd, self.collector, self.timeout, self.env = cmd, collector, timeout, env
        self.inspector, self.preemption = inspector, preemption
        self.result = AttemptResult(returncode=0)
        self.proc: subprocess.Popen | None = None
        self.stop_at: float | None = None  # monotonic: when mpirun was told to stop
        self.out: Tee | None = None        # mpirun's stdout, copied
        self.tail: Tee | None = None       # its stderr, copied, the last lines kept

    def run(self) -> AttemptResult:
        preemption = self.preemption
        self.collector.subscribe("timeline", TRACE.on_record)  # the ranks' events, kept for the job's end
        # handlers first: a Ctrl-C while starting must not orphan mpirun (its own session)
        handled = dict.fromkeys((signal.SIGINT, signal.SIGTERM, *(preemption.signals if preemption else ())))
        previous = {s: signal.signal(s, self.interrupt) for s in handled}
        try:
            session_dirs.remove_stale(self.env)
            proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True, env=self.env,
                                    preexec_fn=child_preexec((lambda: hold_signals.block(preemption.signals))
                                                             if preemption is not None else None))
        except BaseException:
            _restore(previous)
            raise
        _sessions.add(proc.pid)
        try:
            self.proc = proc
            if self.result.stop_signal is not None:
                self.stop(self.result.stop_signal)
            self.out = Tee(os.dup(proc.stdout.fileno()), _fileno(sys.stdout, 1), 0)
            proc.stdout.close()
            self.tail = Tee(os.dup(proc.stderr.fileno()), _fileno(sys.stderr, 2), MPIRUN_TAIL_LINES, drop=b"\0",
                            filter=EndMessages(lambda text: joblog.LOG.section("mpirun's message", text)))
            proc.stderr.close()
            self.supervise()
        except Exception as exc:  # noqa: BLE001 - reported; the finally below ends the job
            self.result.internal_error = describe_exception(exc)
        finally:
            _restore(previous)
            if preemption is not None and preemption.signum is not None and self.result.stop_signal is None:
                self.result.stop_signal = preemption.signum
            if self.result.internal_error or self.stop_at is not None or proc.poll() is None:
                kill_session(proc.pid)  # leftovers that ignored the stop request, or no supervisor
            _sessions.discard(proc.pid)
        self.collect()
        return self.result

    def stop(self, signum: int) -> None:
        """Tell mpirun to stop (once noted: the collector counts what follows as
        consequences); SIGINT instead of SIGTERM when it holds the signals."""
        if self.preemption is not None and signum == signal.SIGTERM:
            signum = hold_signals.STOP_SIGNAL  # mpirun holds SIGTERM
        if self.stop_at is None:
            self.stop_at = time.monotonic()
            self.collector.stopping()
        if self.proc is not None:
            try:
                self.proc.send_signal(signum)
            except OSError:
                pass

    def interrupt(self, signum, _frame=None) -> None:
        """The handler of SIGINT, SIGTERM and the preemption's signals."""
        result, preemption = self.result, self.preemption
        if preemption is not None and result.stop_signal is None:
            why = preemption.on_signal(signum)
            if why is None:
                return  # the replicas are asked for a checkpoint (preemption.poll)
            if why:  # a second signal: stop now, with the first's exit code
                result.stop_reason, result.stop_signal = why, preemption.signum
                self.stop(signal.SIGTERM)
                return
        if result.stop_signal is None:
            result.stop_signal = signum
            if result.stop_reason is None:
                result.stop_reason = f"job interrupted by {signal.Signals(signum).name}"
        self.stop(signum)

    def supervise(self) -> None:
        """The loop, every 0.1 s until mpirun has ended: the timeout, the collector's
        failures, the stall inspector, the preemption, the session's SIGKILL."""
        proc, collector, result = self.proc, self.collector, self.result
        start = time.monotonic()
        failed_at = None
        killed = False
        while True:
            try:
                result.returncode = proc.wait(timeout=0.1)
                return
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if self.timeout and self.stop_at is None and now - start > self.timeout:
                result.timed_out = True
                result.stop_reason = f"job timed out after {self.timeout:g} s"
                self.stop(signal.SIGTERM)
            if failed_at is None and collector.has_failure():
                failed_at = now
            if failed_at is not None and self.stop_at is None and (
                    collector.lost_cause() or now - failed_at > FAILED_JOB_STOP_DELAY_SECONDS):
                self.stop(signal.SIGTERM)
            self.poll_watchers()
            if self.stop_at is not None and not killed and now - self.stop_at > SESSION_KILL_DELAY_SECONDS:
                kill_session(proc.pid)
                killed = True

    def poll_watchers(self) -> None:
        """The stall inspector and the preemption, while mpirun has not been told to stop:
        either may stop it."""
        result, collector = self.result, self.collector
        if self.inspector is not None and self.stop_at is None:
            block = self.inspector.poll()
            if block is not None:
                result.stall = block
                result.stop_reason = "job stalled"
                self.stop(signal.SIGTERM)
        if self.preemption is not None and self.stop_at is None:
            why = self.preemption.poll(lambda: {r.get("rank") for r in collector.records("resize_stop")})
            if why:
                result.stop_reason, result.stop_signal = why, self.preemption.signum
                self.stop(signal.SIGTERM)

    def collect(self) -> None:
        """After mpirun's end: its exit status, the end of its output, the failures and
        saved checkpoints the collector recorded."""
        proc, collector, result = self.proc, self.collector, self.result
        try:
            result.returncode = proc.wait(timeout=SESSION_KILL_DELAY_SECONDS)
            session_dirs.remove(proc.pid, self.env)
            if self.tail is not None:
                self.tail.finish(failed=False)  # a box that never closed is written as it came
            for copy in (self.out, self.tail):
                if copy is not None:
                    copy.end_line(timeout=2.0)  # a job ended mid-line: the next output starts a line
            result.mpirun_tail = self.tail.text(timeout=2.0) if self.tail is not None else ""
            collector.wait_closed(2.0)
            collector.finish()
            result.failures = report.merge_records(collector.failure_records())
            for failure in result.failures:
                report.log_failure(joblog.LOG, failure)
            result.saved = {r.get("rank") for r in collector.records("checkpoint_saved")
                            if r.get("role") == "replica"}
        except Exception as exc:  # noqa: BLE001 - report what is known
            result.internal_error = result.internal_error or describe_exception(exc)


def _fileno(stream, default: int) -> int:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return default


def _restore(handlers: dict) -> None:
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
