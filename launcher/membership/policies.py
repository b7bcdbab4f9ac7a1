"""The membership policies of the attempts loop (:mod:`popdist_lite_launcher.attempts`):
:class:`FixedPolicy` (``--num-replicas`` on ``-H``/``--hostfile`` or this machine, every
attempt) and :class:`ElasticPolicy` (the usable discovered hosts, waiting for
``--min-replicas``; :mod:`popdist_lite_launcher.membership.elastic`). The Slurm backend's
policies (:mod:`popdist_lite_launcher.slurm.nodes`) build on them."""

from __future__ import annotations

from typing import Callable

from .elastic import Cluster, Survey, wait_for_membership
from .resize import ResizeMonitor
from ..core.api import LauncherError, Membership, Send, Wait, Watcher
from ..core.options import Options
from ..core.plan import placement


class FixedPolicy:
    """A job of ``--num-replicas`` on ``-H``/``--hostfile`` (divided evenly) or this
    machine, the same for every attempt; its hosts are checked by the launcher."""

    elastic = False

    def __init__(self, opts: Options):
        self.opts = opts
        self.membership = Membership(placement(opts))

    def start(self) -> None:
        """Nothing to find out before the first attempt."""

    def next(self, deadline: float | None, say) -> Membership:
        return self.membership

    def watch(self, membership: Membership, say) -> None:
        return None

    def lost(self, membership: Membership, say, unreachable: dict[str, str]) -> list[str]:
        return []


class ElasticPolicy:
    """An elastic job's memberships (:mod:`popdist_lite_launcher.membership.elastic`): the usable
    discovered hosts (probed by the policy), waiting for ``--min-replicas``; a resize
    monitor in every attempt; hosts lost after a failure."""

    elastic = True

    def __init__(self, opts: Options, cluster: Cluster | None = None):
        self.opts = opts
        self.cluster = cluster or Cluster(opts)
        self._survey: Survey | None = None

    def start(self) -> None:
        """The first look at the hosts.

        Raises:
            LauncherError: discovery failed (the job stops with exit code 2).
        """
        self._survey = self.cluster.survey()

    def next(self, deadline: float | None, say) -> Membership | Wait:
        """The next attempt's membership (at least ``--min-replicas``), or how waiting
        for one ended."""
        first, self._survey = self._survey, None
        return wait_for_membership(self.cluster, deadline, first, say)

    def watch(self, membership: Membership, say) -> Callable[[Send], Watcher]:
        return lambda send: ResizeMonitor(self.cluster, membership, send, self.opts.discovery_interval, say)

    def lost(self, membership: Membership, say, unreachable: dict[str, str]) -> list[str]:
        """After a failed attempt on ``membership``: its hosts that are gone now (and the
        survey kept for the next attempt, in which the hosts of ``unreachable``, from
        :attr:`Outcome.unreachable <popdist_lite_launcher.core.api.Outcome>`, fail without a probe); [] when discovery fails."""
        try:
            self._survey = self.cluster.survey(unreachable=unreachable)
        except LauncherError as exc:
            say(f"host discovery failed after the attempt: {exc}")
            return []
        lost = self._survey.lost(membership)
        for host in lost:
            if self._survey.problems.get(host):
                say(self._survey.problems[host])
        return lost
