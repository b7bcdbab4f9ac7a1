"""The stall inspector's analysis: from every replica's last collective call to the one
block poprun-lite prints (pure functions on plain values: no processes, no sockets).

Every replica records the collective call it last entered on each of its lanes
(operation, call number and entry time; :mod:`popdist_lite.progress`: the ``main`` lane,
and a lane of its own for a communicator whose calls are issued apart from the main
thread's, such as the JAX binding's ``jax``) and its agent forwards that to the
launcher, which notes when it arrived on its own clock. Times here are on one clock, the
launcher's (``time.monotonic()``).
A job stalls when, on one lane, some replicas have entered call ``#N`` and wait there
while others have not entered it: :func:`find_stall` names the call, the waiting
replicas and the missing ones (each with what it last entered on that lane), in
ascending replica order;
:func:`format_stall` adds the missing replicas' Python stacks. Like
Horovod's stall inspector (which names the ranks that did not submit a tensor after
``HOROVOD_STALL_CHECK_TIME_SECONDS``), with the missing replica's own stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.text import STOPPED, counted, indent

@dataclass(frozen=True)
class Progress:
    """A replica's last collective call: ``call`` number, ``op`` name and ``since``
    (when the launcher learnt that it entered the call, in seconds of the launcher's
    ``time.monotonic()``); where it runs, when known."""

    replica: int
    call: int
    op: str
    since: float
    rank: int | None = None
    host: str | None = None
    pid: int | None = None
    lane: str = "main"


@dataclass
class Stall:
    """Replicas ``waiting`` in call ``call`` (``op``) for ``(replica, seconds)``, and the
    ``missing`` replicas that have not entered it: ``(replica, last Progress or None)``,
    both in ascending replica order. ``waited`` is the longest wait."""

    op: str
    call: int
    waiting: list[tuple[int, float]]
    missing: list[tuple[int, Progress | None]]
    where: dict[int, Progress] = field(default_factory=dict)
    lane: str = "main"

    @property
    def waited(self) -> float:
        return max(seconds for _, seconds in self.waiting)

    @property
    def key(self) -> tuple:
        """What identifies this stall: the lane, the call and who is missing (a new key
        is a new stall)."""
        return self.lane, self.call, tuple(r for r, _ in self.missing)


def find_stall(progress: dict[int, Progress], num_replicas: int, now: float,
               lane: str = "main") -> Stall | None:
    """The stall the replicas' last calls on ``lane`` show at time ``now``, or None.

    Args:
        progress: the last :class:`Progress` on ``lane`` of each replica that has
            entered a collective there. On the ``main`` lane a replica absent from it
            has entered none and is missing; on another lane (a communicator of its
            own, which some replicas may never use: a sub-communicator's) only the
            replicas that have used the lane are compared.
        num_replicas: replicas in the job (0 .. num_replicas - 1).
        now: the time on the clock of the :attr:`Progress.since` values.
        lane: the lane's name, kept in the :class:`Stall`.

    Returns:
        a :class:`Stall` when some replicas have entered a call number that others have
        not reached, or entered it as different operations, else None (every replica is
        in the same call). The waiting replicas are those in the highest call number (the
        largest group of them that entered it as the same operation); whether they have
        waited long enough to report is the caller's threshold on :attr:`Stall.waited`.
    """
    if not progress:
        return None
    top = max(p.call for p in progress.values())
    at_top: dict[str, list[int]] = {}
    for r, p in sorted(progress.items()):
        if p.call == top:
            at_top.setdefault(p.op, []).append(r)
    # replicas that entered call #top as different operations (one skipped or added a
    # collective): the largest group (ties: the one with the lowest replica) waits
    op = max(at_top, key=lambda name: (len(at_top[name]), -at_top[name][0]))
    waiting = sorted((r, max(0.0, now - progress[r].since)) for r in at_top[op])
    inside = set(at_top[op])
    compared = range(num_replicas) if lane == "main" else sorted(progress)
    missing = [(r, progress.get(r)) for r in compared if r not in inside]
    if not missing:
        return None
    return Stall(op=op, call=top, waiting=waiting, missing=missing, where=dict(progress), lane=lane)


def _call(number: int, lane: str) -> str:
    return f"collective call #{number}" + ("" if lane == "main" else f" on the {lane} lane")


def _where(p: Progress | None) -> str:
    if p is None:
        return ""
    details = [f"rank {p.rank}" if p.rank is not None else None,
               f"host {p.host}" if p.host else None,
               f"pid {p.pid}" if p.pid is not None else None]
    details = ", ".join(d for d in details if d)
    return f" ({details})" if details else ""


def format_stall(stall: Stall, now: float, stacks: dict[int, list[tuple[str, str]]] | None = None,
                 title: str = "stall") -> str:
    """The block poprun-lite prints for ``stall`` (no trailing newline).

    ``stacks`` maps a missing replica to ``(who, stack)`` pairs: its own Python stack
    (faulthandler's text, ``who`` = ``"replica 1"``) and its feed processes' (``"feeder 0
    of replica 1"``). A process whose agent found it stopped (:func:`~popdist_lite_launcher.core.text.stopped_text`)
    reads ``stopped (state T)``; a missing replica without any reads ``not available``.
    ``title``
    starts the first line (``stall``, or ``root cause: stall`` in a failure report).
    """
    stacks = stacks or {}
    waiters = [r for r, _ in stall.waiting]
    absent = [r for r, _ in stall.missing]
    lines = [f"{title}: {counted('replica', waiters)} {'have' if len(waiters) > 1 else 'has'} waited "
             f"{stall.waited:.1f} s in {stall.op} ({_call(stall.call, stall.lane)}) for "
             f"{counted('replica', absent)}, which did not enter it"]
    for r, seconds in stall.waiting:
        lines.append(f"  waiting: replica {r}{_where(stall.where.get(r))} for {seconds:.1f} s")
    for r, last in stall.missing:
        if last is None:
            doing = "has not entered any collective"
        elif last.call == stall.call:
            doing = (f"entered {last.op} as {_call(last.call, stall.lane)} instead "
                     f"{max(0.0, now - last.since):.1f} s ago (a replica skipped or added a "
                     f"collective)")
        else:
            doing = (f"last entered {last.op} ({_call(last.call, stall.lane)}) "
                     f"{max(0.0, now - last.since):.1f} s ago")
        lines.append(f"  missing: replica {r}{_where(last)}: {doing}")
    for r, _ in stall.missing:
        found = [(who, text) for who, text in stacks.get(r, ()) if text and text.strip()]
        if not found:
            lines.append(f"  Python stack of replica {r}: not available")
        for who, text in found:
            if STOPPED.fullmatch(text.strip()):
                lines.append(f"  Python stack of {who}: not available, {text.strip()}")
                continue
            lines.append(f"  Python stack of {who}:")
            lines += indent(without_library_threads(text), "    ")
    return "\n".join(lines)


#: The library's own threads, which every rank recording a timeline has and whose stacks
#: say nothing about a stall: a thread's section of the dump holding all these words is
#: left out (popdist_lite.timeline's sender).
LIBRARY_THREADS = (('popdist_lite/timeline.py", line ', " in _stream"),)


def without_library_threads(text: str) -> str:
    """faulthandler's dump ``text`` without the sections (threads, separated by a blank
    line) of the library's own threads (:data:`LIBRARY_THREADS`); the current thread's
    is always kept."""
    sections = text.strip("\n").split("\n\n")
    kept = [s for s in sections if s.lstrip().startswith("Current thread")
            or not any(all(word in s for word in words) for words in LIBRARY_THREADS)]
    return "\n\n".join(kept)
