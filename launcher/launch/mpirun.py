"""Running the mpirun command: signals, timeout, lost ranks, hard kill, failure records.

:func:`run_job` starts mpirun in a new session (first removing the session
directories killed mpiruns left: :mod:`~popdist_lite_launcher.launch.session_dirs`), passes its
stdout and stderr through (keeping stderr's last lines, and ending a line the job left
unfinished), forwards SIGINT/SIGTERM to it, enforces ``--timeout``, stops the job when the collector has lost a rank's agent (a host went down: mpirun may wait
for it for minutes) or when mpirun is still running
``FAILED_JOB_STOP_DELAY_SECONDS`` after a rank failed, and if the job is not gone
``SESSION_KILL_DELAY_SECONDS`` after being told to stop, SIGKILLs every process of
mpirun's session (mpirun gives each rank its own process group, so killing one group
is not enough). The failures come from the collector's records. Whatever goes wrong in
the launcher itself, the session is killed in a ``finally`` (here, and in ``main`` for
anything outside :func:`run_job`: :func:`kill_sessions`), so a job is never left
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
from ..supervise import report

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
        fields = stat_fields(int(entry)) if entry.isdigit() else None
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
    """SIGKILL what is left of every session :func:`run_job` started and has not seen
    end (the launcher's last resort, in ``main``'s ``finally``)."""
    for sid in list(_sessions):
        kill_session(sid)
        _sessions.discard(sid)


_sessions: set[int] = set()  # mpirun sessions started by run_job and not yet over


def run_job(cmd: list[str], collector, *, timeout: float | None = None,
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
    result = AttemptResult(returncode=0)
    state = {"proc": None, "stop_at": None}

    def stop(signum):
        if preemption is not None and signum == signal.SIGTERM:
            signum = hold_signals.STOP_SIGNAL  # mpirun holds SIGTERM
        if state["stop_at"] is None:
            state["stop_at"] = time.monotonic()
            collector.stopping()
        if state["proc"] is not None:
            try:
                state["proc"].send_signal(signum)
            except OSError:
                pass

    def interrupt(signum, _frame=None):
        if preemption is not None and result.stop_signal is None:
            why = preemption.on_signal(signum)
            if why is None:
                return  # the replicas are asked for a checkpoint (preemption.poll)
            if why:  # a second signal: stop now, with the first's exit code
                result.stop_reason, result.stop_signal = why, preemption.signum
                stop(signal.SIGTERM)
                return
        if result.stop_signal is None:
            result.stop_signal = signum
            if result.stop_reason is None:
                result.stop_reason = f"job interrupted by {signal.Signals(signum).name}"
        stop(signum)

    # handlers first: a Ctrl-C while starting must not orphan mpirun (its own session)
    handled = dict.fromkeys((signal.SIGINT, signal.SIGTERM, *(preemption.signals if preemption else ())))
    previous = {s: signal.signal(s, interrupt) for s in handled}
    try:
        session_dirs.remove_stale(env)
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, env=env,
                                preexec_fn=child_preexec((lambda: hold_signals.block(preemption.signals))
                                                         if preemption is not None else None))
    except BaseException:
        _restore(previous)
        raise
    _sessions.add(proc.pid)
    tail = out = None
    try:
        state["proc"] = proc
        if result.stop_signal is not None:
            stop(result.stop_signal)
        out = Tee(os.dup(proc.stdout.fileno()), _fileno(sys.stdout, 1), 0)
        proc.stdout.close()
        tail = Tee(os.dup(proc.stderr.fileno()), _fileno(sys.stderr, 2), MPIRUN_TAIL_LINES, drop=b"\0")
        proc.stderr.close()
        _supervise(proc, collector, timeout, inspector, result, state, stop, preemption)
    except Exception as exc:  # noqa: BLE001 - reported; the finally below ends the job
        result.internal_error = describe_exception(exc)
    finally:
        _restore(previous)
        if preemption is not None and preemption.signum is not None and result.stop_signal is None:
            result.stop_signal = preemption.signum
        if result.internal_error or state["stop_at"] is not None or proc.poll() is None:
            kill_session(proc.pid)  # leftovers that ignored the stop request, or no supervisor
        _sessions.discard(proc.pid)
    try:
        result.returncode = proc.wait(timeout=SESSION_KILL_DELAY_SECONDS)
        session_dirs.remove(proc.pid, env)
        for copy in (out, tail):
            if copy is not None:
                copy.end_line(timeout=2.0)  # a job ended mid-line: the next output starts a line
        result.mpirun_tail = tail.text(timeout=2.0) if tail is not None else ""
        collector.wait_closed(2.0)
        collector.finish()
        result.failures = report.merge_records(collector.failure_records())
        result.saved = {r.get("rank") for r in collector.records("checkpoint_saved") if r.get("role") == "replica"}
    except Exception as exc:  # noqa: BLE001 - report what is known
        result.internal_error = result.internal_error or describe_exception(exc)
    return result


def _supervise(proc, collector, timeout, inspector, result: AttemptResult, state: dict, stop,
               preemption=None) -> None:
    """The loop of :func:`run_job`, until mpirun has ended."""
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
        if timeout and state["stop_at"] is None and now - start > timeout:
            result.timed_out = True
            result.stop_reason = f"job timed out after {timeout:g} s"
            stop(signal.SIGTERM)
        if failed_at is None and collector.has_failure():
            failed_at = now
        if failed_at is not None and state["stop_at"] is None and (
                collector.lost_cause() or now - failed_at > FAILED_JOB_STOP_DELAY_SECONDS):
            stop(signal.SIGTERM)
        if inspector is not None and state["stop_at"] is None:
            block = inspector.poll()
            if block is not None:
                result.stall = block
                result.stop_reason = "job stalled"
                stop(signal.SIGTERM)
        if preemption is not None and state["stop_at"] is None:
            why = preemption.poll(lambda: {r.get("rank") for r in collector.records("resize_stop")})
            if why:
                result.stop_reason, result.stop_signal = why, preemption.signum
                stop(signal.SIGTERM)
        if state["stop_at"] is not None and not killed \
                and now - state["stop_at"] > SESSION_KILL_DELAY_SECONDS:
            kill_session(proc.pid)
            killed = True


def _fileno(stream, default: int) -> int:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return default


def _restore(handlers: dict) -> None:
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
