"""Elastic jobs: ``poprun-lite --min-replicas N`` (``--num-replicas`` is the most), hosts
from ``--host-discovery-script`` (or ``-H``/``--hostfile``), a membership per attempt.
The attempts themselves run in :mod:`popdist_lite_launcher.attempts` (its
:class:`~popdist_lite_launcher.membership.policies.ElasticPolicy` uses what is here).

Every attempt runs on a **membership**
(:class:`~popdist_lite_launcher.core.api.Membership`): the usable hosts' slots,
taken in discovery order, up to ``--num-replicas`` replicas (a replica and its feeders
on one host, so a host of S slots holds ``S // (1 + F)`` replicas; a host listed without
slots holds one). Usable means the host is discovered and passes the probe
(:func:`popdist_lite_launcher.launch.remote.probe_hosts`); hosts are probed in discovery order,
only as many as fill the replicas (:meth:`Cluster.usable`). Below ``--min-replicas`` the
launcher waits (:func:`wait_for_membership`), polling every ``--discovery-interval``
seconds and saying what it waits for, at most ``--elastic-timeout`` seconds (and within
``--timeout``).

During an attempt the
:class:`~popdist_lite_launcher.membership.resize.ResizeMonitor` looks at the hosts every
``--discovery-interval`` seconds and, when discovery finds more usable slots than the
attempt uses (up to ``--num-replicas``) or stops listing a host the attempt uses, asks
every replica's agent for a resize (``resize_request``): the replicas agree at a step
boundary (:func:`popdist_lite.should_checkpoint`), save a checkpoint, send
``resize_stop`` and exit 0. After a failed attempt, a host it used that is no longer
discovered or fails its probe is lost (:meth:`Survey.lost`): a change of membership, not
a failure. Discovery errors: at the job's start they stop it (exit code 2); later,
during a run the current membership is kept and the error printed, and between attempts
the launcher retries, waiting as for hosts.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

from . import discovery
from ..core.api import LauncherError, Membership, Wait
from ..core.hosts import is_local_host
from ..core.options import Options
from ..core.plan import capacity, fill
from ..core.text import host_names, hosts_text, listed, say
from ..launch.address import NodeAddress, launcher_address
from ..launch import remote

#: Default of ``--discovery-interval``: seconds between two checks of the hosts.
DISCOVERY_INTERVAL_SECONDS = 2.0
#: Default of ``--elastic-timeout``: seconds an elastic job waits for enough hosts
#: (Horovod's ``--elastic-timeout`` default).
ELASTIC_TIMEOUT_SECONDS = 600.0


def size_attempt(available: list[tuple[str, int | None]], max_replicas: int, feeders: int) -> Membership:
    """The membership of an attempt on the ``available`` hosts, ``(host, slots)`` in
    discovery order: each host's :func:`~popdist_lite_launcher.core.plan.capacity`, in that
    order, up to ``max_replicas`` (:func:`~popdist_lite_launcher.core.plan.fill`)."""
    return Membership(tuple(fill(((host, capacity(slots, feeders)) for host, slots in available), max_replicas)))


def change(before: Membership, after: Membership) -> str:
    """How ``after`` differs from ``before``, in words: ``host b lost``, ``host c added``,
    ``more replicas on a``; "" when nothing changed."""
    old, new = dict(before.hosts), dict(after.hosts)
    parts = []
    lost = [h for h in old if h not in new]
    added = [h for h in new if h not in old]
    if lost:
        parts.append(hosts_text(lost) + " lost")
    if added:
        parts.append(hosts_text(added) + " added")
    more = [h for h in new if h in old and new[h] > old[h]]
    fewer = [h for h in new if h in old and new[h] < old[h]]
    if more:
        parts.append("more replicas on " + listed(host_names(more)))
    if fewer:
        parts.append("fewer replicas on " + listed(host_names(fewer)))
    return "; ".join(parts)


def resize_reason(current: Membership, target: Membership,
                  available: list[tuple[str, int | None]], feeders: int) -> str | None:
    """Why the running attempt on ``current`` should stop for a resize, or None: the
    ``target`` membership (from the usable discovered hosts) has more replicas (a grow),
    or a host of ``current`` is no longer discovered or now holds fewer replicas."""
    slots = dict(available)
    gone = [h for h in current.names() if h not in slots]
    if gone:
        return hosts_text(gone) + " no longer discovered"
    smaller = [h for h, count in current.hosts if h is not None and capacity(slots[h], feeders) < count]
    if smaller:
        return hosts_text(smaller) + " now with fewer slots"
    if target.replicas > current.replicas:
        return change(current, target) or f"{target.replicas} replicas usable"
    return None


# ------------------------------------------------------------------ hosts

@dataclass(frozen=True)
class Survey:
    """What one look at the hosts found: the ``membership`` an attempt would get, the
    ``available`` hosts (discovered, in order), the ``usable`` ones among them (those
    probed or trusted, up to where the membership was filled), and for each host that
    failed its probe, why (``problems``)."""

    membership: Membership
    available: list[tuple[str, int | None]]
    usable: list[tuple[str, int | None]]
    problems: dict[str, str]

    def lost(self, previous: Membership) -> list[str]:
        """The hosts of ``previous`` that are gone now: not discovered, or their probe failed."""
        listed = {host for host, _ in self.available}
        return [host for host in previous.names() if host not in listed or host in self.problems]


class Cluster:
    """The hosts of an elastic job, as discovery and the probes see them now;
    ``node_address`` finds a host whose name does not resolve here
    (:func:`~popdist_lite_launcher.launch.address.launcher_address`)."""

    def __init__(self, opts: Options, node_address: NodeAddress | None = None):
        self.opts, self.node_address = opts, node_address

    def discover(self) -> list[tuple[str, int | None]]:
        """``(host, slots)`` available now: the discovery script's, else ``-H`` /
        ``--hostfile`` (a host without slots holds an even share of ``--num-replicas``),
        else this machine with room for every replica.

        Raises:
            DiscoveryError: the script failed, hung or printed garbage.
        """
        opts = self.opts
        per_replica = 1 + opts.feeders_per_replica
        if opts.host_discovery_script:
            return discovery.discover(opts.host_discovery_script)
        if opts.hosts:
            share = math.ceil(opts.num_replicas / len(opts.hosts)) * per_replica
            return [(host, opts.slots.get(host, share)) for host in opts.hosts]
        return [("localhost", opts.num_replicas * per_replica)]

    def usable(self, available: list[tuple[str, int | None]], trusted=(),
               unreachable: dict[str, str] | None = None) -> tuple[list[tuple[str, int | None]], dict[str, str]]:
        """The ``available`` hosts, in order, that can hold a replica and are usable, up to
        the first ``--num-replicas`` replicas' worth, and why each host that failed its
        probe failed. Hosts are probed in discovery order, each batch just large enough
        to fill what is still missing (all at once), until the replicas are filled or
        the list ends: a long list costs only the probes the job needs. Hosts in
        ``trusted``, this machine, and every host with ``--no-host-check`` count
        without a probe; a host of ``unreachable`` (the launch agent did not reach it
        just now: ``{host: why}``) fails without one."""
        opts = self.opts
        feeders, need = opts.feeders_per_replica, opts.num_replicas
        good: set[str] = set()
        problems: dict[str, str] = {}
        unreachable = unreachable or {}
        batch: list[tuple[str, int]] = []

        def probe() -> None:
            nonlocal need
            failed = self._probe([host for host, _ in batch])
            problems.update(failed)
            for host, room in batch:
                if host not in failed:
                    good.add(host)
                    need -= room
            batch.clear()

        for host, slots in available:
            if need - sum(room for _, room in batch) <= 0:
                probe()
                if need <= 0:
                    break
            room = capacity(slots, feeders)
            if room == 0:
                continue  # no room for a replica (and its feeders): never used
            if host in unreachable:
                problems[host] = unreachable[host]
            elif is_local_host(host) or host in trusted or not opts.host_check:
                good.add(host)
                need -= room
            else:
                batch.append((host, room))
        if batch:
            probe()
        return [(host, slots) for host, slots in available if host in good], problems

    def _probe(self, hosts: list[str]) -> dict[str, str]:
        """For each host of ``hosts`` that fails the probe, why."""
        if not hosts:
            return {}
        try:
            address = self.address(hosts)
        except LauncherError as exc:
            return {host: str(exc) for host in hosts}
        return {h: p for h, p in remote.probe_hosts(self.opts.launch_agent, hosts, address).items() if p}

    def address(self, hosts: list[str]) -> str:
        """The launcher's address on the job's network, seen from the ``hosts`` (the
        route to the first of them that has one, without ``--network-interface``).

        Raises:
            LauncherError: no address for any of them.
        """
        error = None
        for host in hosts if not self.opts.network_interface else hosts[:1]:
            try:
                return launcher_address(self.opts.network_interface, [host], self.node_address)
            except LauncherError as exc:
                error = error or exc
        raise error

    def survey(self, trusted=(), unreachable: dict[str, str] | None = None) -> Survey:
        """Discovery, the probes and the membership, now (see :meth:`discover`,
        :meth:`usable`, :meth:`size`).

        Raises:
            DiscoveryError: as :meth:`discover`.
        """
        available = self.discover()
        usable, problems = self.usable(available, trusted, unreachable)
        return Survey(self.size(usable), available, usable, problems)

    def size(self, usable: list[tuple[str, int | None]]) -> Membership:
        """:func:`size_attempt` for this job; on this machine alone the membership's host
        is None (no ``-H`` for mpirun)."""
        target = size_attempt(usable, self.opts.num_replicas, self.opts.feeders_per_replica)
        if all(is_local_host(host) for host in target.names()):
            target = Membership(tuple((None, count) for _, count in target.hosts))
        return target


def waiting_note(membership: Membership | None, minimum: int, problems: dict[str, str],
                 error: str | None = None) -> str:
    """What the launcher waits for, in words."""
    have = membership.describe() if membership is not None and membership.replicas else "no replicas"
    lines = [f"waiting for hosts: {have} usable, --min-replicas {minimum}"]
    if error:
        lines.append(f"  {error}")
    lines += [f"  {problem}" for problem in problems.values()]
    return "\n".join(lines)


# ------------------------------------------------------------------ waiting for hosts

def wait_for_membership(cluster: Cluster, deadline: float | None, first: Survey | None = None,
                        say: Callable[[str], None] = say) -> "Membership | Wait":
    """A membership of at least ``--min-replicas`` replicas: ``first`` (a survey already
    made) if it has enough, else polling :meth:`Cluster.survey` every ``--discovery-interval`` seconds, saying what it
    waits for whenever that changes; a :class:`Wait` when ``--elastic-timeout`` or the
    job's ``deadline`` (monotonic) passes first."""
    opts = cluster.opts
    until = time.monotonic() + opts.elastic_timeout
    if deadline is not None:
        until = min(until, deadline)
    last = None
    while True:
        error, membership, problems = None, None, {}
        if first is None:
            try:
                first = cluster.survey()
            except LauncherError as exc:
                error = str(exc)
        if first is not None:
            membership, problems, first = first.membership, first.problems, None
        if membership is not None and membership.replicas >= opts.min_replicas:
            return membership
        note = waiting_note(membership, opts.min_replicas, problems, error)
        if note != last:
            say(note)
            last = note
        now = time.monotonic()
        if now >= until:
            if deadline is not None and until >= deadline:
                return Wait(124, f"job timed out after {opts.timeout:g} s waiting for hosts")
            return Wait(1, f"fewer than --min-replicas {opts.min_replicas} replicas usable for "
                            f"--elastic-timeout {opts.elastic_timeout:g} s")
        time.sleep(max(0.0, min(opts.discovery_interval, until - now)))
