"""The resize monitor of an elastic job's attempt (:class:`ResizeMonitor`): it looks at the
hosts every ``--discovery-interval`` seconds and, when discovery finds more usable slots
than the attempt uses (up to ``--num-replicas``) or stops listing a host the attempt
uses, asks every replica's agent for a resize (``resize_request``): the replicas agree
at a step boundary (:func:`popdist_lite.should_checkpoint`), save a checkpoint, send
``resize_stop`` and exit 0 (:mod:`popdist_lite_launcher.membership.elastic`)."""

from __future__ import annotations

import threading
import time
from typing import Callable

from .elastic import DISCOVERY_INTERVAL_SECONDS, Cluster, resize_reason
from ..core.api import LauncherError, Membership
from ..core.text import say
from ..launch import children
from ..supervise.stop_request import RESEND_SECONDS, StopRequest

#: Most seconds :meth:`ResizeMonitor.stop` waits for the monitor's thread.
STOP_SECONDS = 30.0


class ResizeMonitor:
    """During an attempt on ``membership``: every ``interval`` seconds, discovery and the
    probe of the hosts the attempt does not use (:meth:`Cluster.discover`,
    :meth:`Cluster.usable`); when :func:`resize_reason` finds one, the
    :class:`~popdist_lite_launcher.supervise.stop_request.StopRequest` for the new size to
    every replica's agent (``send(rank, record)``, ``rank`` 0 to R-1), again every
    :data:`~popdist_lite_launcher.supervise.stop_request.RESEND_SECONDS` to those not
    reached yet, until :meth:`stop`. A discovery error is printed once per distinct
    message and changes nothing."""

    def __init__(self, cluster: Cluster, membership: Membership, send: Callable[[int, dict], bool],
                 interval: float = DISCOVERY_INTERVAL_SECONDS, say: Callable[[str], None] = say):
        self.cluster, self.membership, self.send = cluster, membership, send
        self.interval, self.say = interval, say
        self.reason: str | None = None   # why a resize was asked for
        self.target: Membership | None = None
        self.request: StopRequest | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="poprun-lite resize monitor", daemon=True)
        self._last_error: str | None = None

    def start(self) -> "ResizeMonitor":
        self._thread.start()
        return self

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        """End the monitor: its discovery script or probes still running are killed
        (:func:`children.kill_all <popdist_lite_launcher.launch.children.kill_all>`, again until
        its thread has ended, at most ``timeout`` seconds), so nothing it started
        outlives the attempt."""
        self._stop.set()
        until = time.monotonic() + timeout
        while self._thread.is_alive() and time.monotonic() < until:
            children.kill_all()
            self._thread.join(0.1)

    @property
    def asked(self) -> bool:
        """Whether a resize request reached a replica's agent in this attempt."""
        return self.request is not None and bool(self.request.sent)

    def check(self) -> None:
        """One round: discovery, probes, the decision (and the first requests)."""
        if self.reason is None:
            try:
                available = self.cluster.discover()
                usable, _ = self.cluster.usable(available, trusted=self.membership.names())
            except LauncherError as exc:
                if self._stop.is_set():  # killed by stop(): the attempt is over
                    return
                if str(exc) != self._last_error:
                    self._last_error = str(exc)
                    self.say(f"host discovery failed during the attempt (membership kept): {exc}")
                return
            target = self.cluster.size(usable)
            reason = resize_reason(self.membership, target, available, self.cluster.opts.feeders_per_replica)
            if reason is None or self._stop.is_set():  # nothing new, or the attempt is over
                return
            self.reason, self.target = reason, target
            self.request = StopRequest(self.send, self.membership.replicas, target.replicas)
            self.say(f"asking the replicas to checkpoint and stop for a resize to {target.describe()} "
                     f"({reason})")
        self.request.send_round()

    def _run(self) -> None:
        while not self._stop.wait(self.interval if self.reason is None else RESEND_SECONDS):
            try:
                self.check()
            except Exception as exc:  # noqa: BLE001 - a bug here must not end the job
                self.say(f"resize monitor error: {type(exc).__name__}: {exc}")
