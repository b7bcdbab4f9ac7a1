"""The launch interface: the typed vocabulary the attempts loop, the membership policies
and the launchers speak (as torch elastic's ``agent/server/api.py`` holds its
``WorkerSpec``, ``WorkerState`` and ``RunResult``).

One attempt: a :class:`MembershipPolicy` gives its :class:`Membership` (or a
:class:`Wait` when there is none), a :class:`Launcher` runs the :class:`Attempt` and
returns its :class:`Outcome` (how its processes ended: an :class:`AttemptResult`), or
raises :class:`AttemptError` when it could not start it. A launcher for a new scheduler
implements :class:`Launcher` (usually as a subclass of
:class:`popdist_lite_launcher.launch.base.MpirunLauncher`, beside ``ssh/`` and ``slurm/``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol


class LauncherError(Exception):
    """A problem with the launcher's configuration (no mpirun, bad hosts, ...)."""


#: ``send(rank, record)``: a record to rank ``rank``'s agent; True if it was sent.
Send = Callable[[int, dict], bool]


@dataclass(frozen=True)
class Membership:
    """An attempt's hosts: ``(host, replicas on it)`` in rank order (host None: this
    machine, no ``-H``)."""

    hosts: tuple[tuple[str | None, int], ...]

    @property
    def replicas(self) -> int:
        return sum(count for _, count in self.hosts)

    def names(self) -> list[str]:
        return [host for host, _ in self.hosts if host is not None]

    def describe(self) -> str:
        """``4 replicas on pdlh1 (2), pdlh2 (2)``."""
        where = ", ".join(f"{host or 'this host'} ({count})" for host, count in self.hosts)
        return f"{self.replicas} replica{'s' if self.replicas != 1 else ''}" + (f" on {where}" if where else "")


@dataclass
class Wait:
    """How waiting for hosts ended without a membership: the exit code and the line."""
    code: int
    text: str


class Watcher(Protocol):
    """Watches the hosts while an attempt runs (:class:`~popdist_lite_launcher.membership.resize.ResizeMonitor`)."""

    asked: bool          # whether it asked the replicas for a resize
    reason: str | None   # why

    def start(self) -> "Watcher": ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class Attempt:
    """What a :class:`Launcher` runs: attempt ``index`` (from 0, the ranks'
    ``POPDIST_LITE_RESTART_COUNT``) on ``membership``, within ``timeout`` seconds (None:
    no limit). ``hosts_checked``: the policy probed its hosts already. ``watch(send)``
    makes the attempt's watcher once records can be sent to the replicas' agents; the
    launcher starts it then and stops it when the job has ended."""

    index: int
    membership: Membership
    timeout: float | None
    hosts_checked: bool = False
    watch: Callable[[Send], Watcher] | None = None


@dataclass
class AttemptResult:
    """How one attempt's processes ended (one mpirun run)."""

    returncode: int                      # mpirun's exit status (negative: signal)
    stop_reason: str | None = None       # e.g. "job interrupted by SIGINT"
    stop_signal: int | None = None       # the signal the launcher received, if any
    timed_out: bool = False
    stall: str | None = None             # the stall inspector's block when it ended the job
    mpirun_tail: str = ""
    failures: list = field(default_factory=list)
    internal_error: str | None = None    # a bug in the launcher that ended the job
    refused: dict = field(default_factory=dict)  # connections the collector refused, by reason
    dropped: dict = field(default_factory=dict)  # lines it dropped, by reason
    resize_stops: int = 0                # resize_stop records: the replicas stopped for a resize
    saved: set = field(default_factory=set)  # replica ranks that sent checkpoint_saved (slurm/preempt.py)


@dataclass
class Outcome:
    """What a :class:`Launcher` returns: the attempt's result, the ``resize_stop`` records
    it got (identity fields: who sent each), and the hosts its launch agent did not reach
    when it cleaned up after the attempt, each with a sentence naming it and what failed.
    A policy leaves those out of the next attempt as if they had failed a probe, without
    probing them again: on a dead node each contact costs the agent's own time-out
    (Slurm's ``MessageTimeout``, ssh's ``ConnectTimeout``)."""

    result: AttemptResult
    resize_stops: list[dict] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)


class AttemptError(Exception):
    """The attempt could not be started (its hosts failed their check, its collector or
    mpirun could not start); the message says why. Nothing of it is left running."""


class Launcher(Protocol):
    """Starts an attempt's processes on its hosts and supervises them to the end."""

    def run(self, attempt: Attempt) -> Outcome:
        """Run ``attempt`` to its end; whatever is left of it is killed on every host
        before this returns.

        Raises:
            AttemptError: it could not be started.
        """


class MembershipPolicy(Protocol):
    """Decides each attempt's hosts (:mod:`popdist_lite_launcher.membership.policies`).
    ``say(text)`` prints a line of the launcher's."""

    elastic: bool  # memberships change (an elastic job): --max-restarts counts failures only

    def start(self) -> None:
        """Before the first attempt.

        Raises:
            LauncherError: the job cannot start (exit code 2).
        """

    def next(self, deadline: float | None, say: Callable[[str], None]) -> Membership | Wait:
        """The next attempt's membership, or how waiting for one ended."""

    def watch(self, membership: Membership, say: Callable[[str], None]) -> Callable[[Send], Watcher] | None:
        """What watches the hosts during an attempt on ``membership`` (None: nothing)."""

    def lost(self, membership: Membership, say: Callable[[str], None], unreachable: dict[str, str]) -> list[str]:
        """After a failed attempt on ``membership``: its hosts that are gone now (a change
        of membership, not a failure); ``unreachable``: :attr:`Outcome.unreachable`."""
