"""Asking the replicas to stop at their next step boundary: a ``resize_request`` record to
every replica's agent, sent again every :data:`RESEND_SECONDS` to those it did not reach,
until every one has it (:class:`StopRequest`). On every replica
:func:`popdist_lite.should_checkpoint` then becomes True at the same step. An elastic
job's resize (:mod:`popdist_lite_launcher.membership.resize`) and the scheduler's signals
(:mod:`popdist_lite_launcher.slurm.preempt`) both ask this way."""

from __future__ import annotations

import threading

from popdist_lite import records

from ..core.api import Send

#: Seconds between two sends of the request to agents that did not get it yet.
RESEND_SECONDS = 0.5


class StopRequest:
    """The request for ``replicas`` replicas (the size asked for) to the agents of replica
    ranks 0 to ``ranks`` - 1 through ``send``; :attr:`sent` holds the ranks it reached."""

    def __init__(self, send: Send, ranks: int, replicas: int):
        self.send, self.ranks = send, ranks
        self.record = records.make("resize_request", replicas=replicas)
        self.sent: set[int] = set()

    def send_round(self) -> bool:
        """Send it to every rank it has not reached; whether every rank has it now."""
        for rank in range(self.ranks):
            if rank not in self.sent and self.send(rank, self.record):
                self.sent.add(rank)
        return len(self.sent) == self.ranks

    def send_until(self, over: threading.Event) -> None:
        """Rounds :data:`RESEND_SECONDS` apart until every rank has it or ``over`` is set."""
        while not over.is_set():
            if self.send_round():
                return
            over.wait(RESEND_SECONDS)
