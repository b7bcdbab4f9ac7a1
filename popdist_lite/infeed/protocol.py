"""The messages between a replica (rank 0 of its feed communicator) and its feeders
(rank ``1 + k``), and a polite way to wait for them.

Replica -> feeder, tag ``CONTROL``, ``int64[3] = [code, slot, offset]``:

* ``START``: a new feed session (a call of :func:`popdist_lite.infeed` on the replica)
  from the replica's step ``slot`` (0, or where :meth:`Infeed.seek` put it), and for a
  dataset with an ``offset`` parameter from global position ``offset`` (-1: none;
  :mod:`.position`); the feeder calls ``make_dataset``, skips its batches of earlier
  steps and answers with its ``STRUCTURE``;
* ``CREDIT``: the replica has posted the receive for step ``slot``; the feeder answers
  with exactly one ``HEADER`` (a batch, or the end of its data);
* ``STOP``: the session is over (every credit has been answered); wait for the next;
* ``SHUTDOWN``: the replica is exiting; the feeder finalizes MPI and exits 0.

Feeder -> replica:

* tag ``STRUCTURE``: the batch structure (:mod:`.structure`, a small pickled tuple), or
  ``None`` when the dataset is empty;
* tag ``HEADER``: ``int64[2 + shape words] = [BATCH | END, slot, shapes...]``;
* tag ``DATA``: after a ``BATCH`` header, each array of the batch as raw bytes, in field
  order (MPI keeps messages of one sender, tag and communicator in order).
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

CONTROL, STRUCTURE, HEADER, DATA = 11, 12, 13, 14
START, CREDIT, STOP, SHUTDOWN = 1, 2, 3, 4
END, BATCH = 0, 1
HEADER_WORDS = 2  # [code, slot] before the shapes

#: Busy-poll this long before sleeping between tests (seconds).
SPIN_SECONDS = 2e-4
#: Longest sleep between tests while waiting (seconds).
MAX_SLEEP_SECONDS = 1e-3


CONTROL_WORDS = 3  # [code, slot, offset]


def control(code: int, slot: int = -1, offset: int | None = None) -> np.ndarray:
    """A control message buffer (``offset`` None is sent as -1)."""
    return np.array([code, slot, -1 if offset is None else offset], dtype=np.int64)


def wait(request) -> None:
    """Wait for one MPI request without burning a core for long (:func:`wait_until`)."""
    wait_until(request.Test)


def wait_until(test: Callable[[], bool]) -> None:
    """Call ``test`` (an MPI test: ``Request.Test``, ``Comm.Iprobe``) until it is true.

    MPI's blocking waits busy-poll; a feeder waiting for credit while its replica
    computes (or a replica waiting for a slow feeder) would take a core from the
    process doing useful work (the 2-core case). So: poll for ``SPIN_SECONDS``, then
    test with sleeps growing to ``MAX_SLEEP_SECONDS``.
    """
    if test():
        return
    deadline = time.perf_counter() + SPIN_SECONDS
    while time.perf_counter() < deadline:
        if test():
            return
    pause = 2e-5
    while not test():
        time.sleep(pause)
        pause = min(pause * 2, MAX_SLEEP_SECONDS)


def wait_all(requests) -> None:
    """:func:`wait` for each request of a list."""
    for request in requests:
        wait(request)
