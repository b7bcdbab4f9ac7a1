"""The stall inspector in the launcher: progress records in, one block out.

:class:`StallInspector` keeps every replica's last ``progress`` record on each lane (the
collective call it entered, from its agent; at most :data:`MAX_LANES` lanes in a job),
and :meth:`StallInspector.poll`, called every tenth of a second by the job loop, looks
for a stall lane by lane (:func:`popdist_lite_launcher.supervise.stall.find_stall`) and follows
the one that has waited longest.
When the longest wait reaches ``warning`` seconds it asks the agents of the missing
replicas (and of their feed processes) for their Python stacks, and prints the block
(:func:`popdist_lite_launcher.supervise.stall.format_stall`) once the stacks are in, or
:data:`STACK_WAIT_SECONDS` later without the ones that did not come. When the wait
reaches ``timeout`` seconds it asks again and returns the block: the job loop then
stops the job and reports that block as the root cause (a warning block not yet printed
for that stall is printed first, so it always precedes the end, unless the warning comes
no earlier than the timeout: the report then tells the block once). A stall that changes (another
call, other replicas missing) is a new stall; one that ends re-arms the warning.

Waits are measured on the launcher's ``time.monotonic()``: from the collector's
``received`` stamp of the progress record (when the launcher learnt that the replica
entered the call; its agent looks every 0.2 s) to the poll. The ``since`` a rank's host
wrote is not used: a host whose clock is minutes behind would otherwise read as having
waited minutes, and a step of any wall clock would end a healthy job.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time

from popdist_lite.progress import MAIN, MAX_LANES

from .stall import Progress, find_stall, format_stall

#: Seconds to wait for the stacks the inspector asked for.
STACK_WAIT_SECONDS = 3.0


class StallInspector:
    """Stall inspector for one attempt of a job.

    Args:
        num_replicas: replicas in the job.
        processes: for each replica, ``(who, rank)`` of its processes: the replica's
            own rank first (``"replica 1"``), then its feeders' (``"feeder 0 of
            replica 1"``).
        ask_stack: ``ask_stack(rank, request_id)`` asks that rank's agent for a stack
            (the answer comes back through :meth:`on_stack`); False if it could not.
        warning: seconds of waiting before the block is printed (None: never).
        timeout: seconds of waiting before the job is ended (None: never).
        out: where the warning block goes (default stderr).
    """

    def __init__(self, num_replicas: int, processes: dict[int, list[tuple[str, int]]], ask_stack, *,
                 warning: float | None = 60.0, timeout: float | None = None, out=None):
        self.num_replicas = num_replicas
        self.processes = processes
        self.ask_stack = ask_stack
        self.warning = warning or None
        self.timeout = timeout or None
        self.out = out
        self._lock = threading.Lock()
        self._progress: dict[str, dict[int, Progress]] = {MAIN: {}}  # lane -> replica -> last
        self._stacks: dict[int, tuple[int, str]] = {}  # rank -> (request id, text)
        self._ids = itertools.count(1)
        self._asked: dict | None = None  # the current round of stack requests
        self._warned = None  # key of the stall already printed

    # ------------------------------------------------------------ records in

    def on_progress(self, record: dict) -> None:
        """A ``progress`` record from a replica's agent as the collector passes it on
        (``replica``, ``lane``, ``call``, ``op``, identity fields, and ``received``: the
        launcher's ``time.monotonic()`` on its arrival). A record of a replica outside
        the job, or of a lane beyond the first :data:`MAX_LANES` the job used, is
        dropped. Thread-safe."""
        if record.get("role", "replica") != "replica":
            return
        p = Progress(replica=int(record["replica"]), call=int(record["call"]), op=str(record["op"]),
                     since=float(record["received"]), rank=record.get("rank"),
                     host=record.get("host"), pid=record.get("pid"), lane=str(record.get("lane", MAIN)))
        if not 0 <= p.replica < self.num_replicas:
            return
        with self._lock:
            lane = self._progress.get(p.lane)
            if lane is None:
                if len(self._progress) >= MAX_LANES:
                    return
                lane = self._progress[p.lane] = {}
            old = lane.get(p.replica)
            if old is None or p.call >= old.call:
                lane[p.replica] = p

    def on_stack(self, record: dict) -> None:
        """A ``stack`` record (``rank``, ``request``, ``text``) answering a request. Thread-safe."""
        with self._lock:
            self._stacks[record.get("rank")] = (record.get("request"), record.get("text") or "")

    # ------------------------------------------------------------ the check

    def poll(self, now: float | None = None) -> str | None:
        """Check once at ``now`` (default ``time.monotonic()``); print a warning block when
        due. Returns the block to report as the root cause when the stall timeout is
        reached, else None."""
        now = time.monotonic() if now is None else now
        with self._lock:
            stalls = [find_stall(progress, self.num_replicas, now, lane) for lane, progress in self._progress.items()]
        stall = max((s for s in stalls if s is not None), key=lambda s: s.waited, default=None)
        thresholds = [t for t in (self.warning, self.timeout) if t is not None]
        if stall is None or not thresholds or stall.waited < min(thresholds):
            self._asked = None
            if stall is None:
                self._warned = None
            return None
        phase = "timeout" if self.timeout is not None and stall.waited >= self.timeout else "warning"
        asked = self._asked
        if asked is None or asked["key"] != stall.key or asked["phase"] != phase:
            asked = self._asked = self._ask(stall, phase, now)
        if not self._answered(asked) and now - asked["at"] < STACK_WAIT_SECONDS:
            return None
        stacks = self._collect(asked)
        if self._warned != stall.key and self.warning is not None and \
                (self.timeout is None or self.warning < self.timeout):
            # printed once per stall, also when the timeout came first (its stacks were
            # still on their way, or the poll was late): the warning always precedes the
            # end; not when it is not due before the timeout (the report tells the block)
            self._warned = stall.key
            print(f"poprun-lite: {format_stall(stall, now, stacks)}", file=self.out or sys.stderr,
                  flush=True)
        if phase == "timeout":
            return format_stall(stall, now, stacks, title="root cause: stall")
        return None

    def _ask(self, stall, phase: str, now: float) -> dict:
        requests = {}
        for replica, _ in stall.missing:
            for who, rank in self.processes.get(replica, ()):
                request = next(self._ids)
                if self.ask_stack(rank, request):
                    requests[rank] = (replica, who, request)
        return {"key": stall.key, "phase": phase, "at": now, "requests": requests}

    def _answered(self, asked: dict) -> bool:
        with self._lock:
            return all(self._stacks.get(rank, (None,))[0] == request
                       for rank, (_, _, request) in asked["requests"].items())

    def _collect(self, asked: dict) -> dict[int, list[tuple[str, str]]]:
        stacks: dict[int, list[tuple[str, str]]] = {}
        with self._lock:
            for rank, (replica, who, request) in asked["requests"].items():
                got = self._stacks.get(rank)
                if got is not None and got[0] == request:
                    stacks.setdefault(replica, []).append((who, got[1]))
        return stacks
