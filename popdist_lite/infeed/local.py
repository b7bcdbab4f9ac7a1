"""The feed without feeders (F = 0): the dataset runs in a background thread of the
replica, with the same prefetch bound as feeders (credits are a semaphore here).

The thread computes a batch, takes a credit, hands it over, and computes the next;
asking for the next batch returns the previous batch's credit. Anything the dataset
raises is handed to the training loop by :meth:`ThreadSource.fetch`: an ``Exception``
as it is, any other ``BaseException`` (``SystemExit``, ``KeyboardInterrupt``) as the
cause of a ``RuntimeError``, so that it reaches the failure hook like a feeder's
(which aborts the job naming the replica) instead of ending this replica quietly
while the others wait for it in a collective.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterable

from .position import open_dataset
from .structure import check_same, flatten

_END = object()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class ThreadSource:
    """Batches of ``make_dataset(shard_index, num_shards)`` from a daemon thread."""

    def __init__(self, make_dataset: Callable[[int, int], Iterable[Any]], shard_index: int,
                 num_shards: int, depth: int, replica: int):
        self.make_dataset, self.shard_index, self.num_shards = make_dataset, shard_index, num_shards
        self.depth, self.replica = depth, replica
        self.credits = threading.Semaphore(depth)
        self.batches: queue.SimpleQueue = queue.SimpleQueue()
        self.stopping = threading.Event()
        self.fetched = 0
        self.first_step = 0
        self.offset: int | None = None
        self.ended = False
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"popdist-lite-infeed-{replica}")

    def start(self, first_step: int = 0, offset: int | None = None) -> None:
        """Start the thread at step ``first_step`` of this replica's sequence, or (an
        exact dataset) at global position ``offset`` (:mod:`.position`)."""
        self.first_step, self.offset = first_step, offset
        self.thread.start()

    def _run(self) -> None:
        try:
            structure = None
            batches = open_dataset(self.make_dataset, self.shard_index, self.num_shards, self.first_step,
                                   self.offset)
            for count, batch in enumerate(batches, start=self.first_step):
                got, _ = flatten(batch)
                if structure is None:
                    structure = got
                check_same(structure, got, f"batch {count} of replica {self.replica}'s dataset")
                while not self.credits.acquire(timeout=0.1):
                    if self.stopping.is_set():
                        return
                if self.stopping.is_set():
                    return
                self.batches.put(batch)
            self.batches.put(_END)
        except BaseException as error:  # noqa: BLE001 - handed to the training loop
            self.batches.put(_Failed(error))

    def fetch(self) -> Any | None:
        """The next batch, or None at the end of the data.

        Raises:
            Exception: whatever the dataset raised, with its traceback.
            RuntimeError: the dataset raised a ``BaseException`` that is not an
                ``Exception`` (e.g. ``SystemExit`` from ``sys.exit()``), its cause.
        """
        if self.ended:
            return None
        if self.fetched:
            self.credits.release()
        item = self.batches.get()
        if item is _END:
            self.ended = True
            return None
        if isinstance(item, _Failed):
            self.ended = True
            if isinstance(item.error, Exception):
                raise item.error
            raise RuntimeError(f"infeed: the dataset of replica {self.replica} raised "
                               f"{item.error!r} in its feed thread") from item.error
        self.fetched += 1
        return item

    def finish(self) -> None:
        """Stop the thread (it exits at its next credit wait; it is a daemon thread)."""
        self.stopping.set()
        self.credits.release(self.depth)
