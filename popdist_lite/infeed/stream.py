"""The training loop's view of a feed: :class:`Infeed`, one session of batches.

Every step each replica gets its next batch (from its feeders or its thread) and the
replicas agree whether all of them have one: a one-integer ``MIN`` all-reduce on the
replica communicator (:func:`popdist_lite.calls.numbered_all_reduce`: numbered for the
stall inspector and counted as ``infeed``). If any replica's data has run out, every replica stops at that
step (the batches others already hold are dropped), so all replicas run the same
number of steps and none is left waiting in a collective. Then the feeders are told
to stop.

A feed told to prefetch table rows (:meth:`Infeed.prefetch_rows`) takes batches from
its source up to ``prefetch_depth`` steps ahead of the one it hands out, and after each
step's agreement calls :meth:`popdist_lite.HostEmbedding.prefetch` for the batch
``prefetch_depth`` steps ahead (at the session's first step, for each of the
``prefetch_depth`` batches ahead): the same calls on every replica, a replica whose
data has run out passing no IDs. Closing the session lets the tables drop the
prefetches of batches that will not come.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from .. import topology
from ..calls import numbered_all_reduce
from .position import session_start

_NO_IDS = np.zeros(0, np.int64)

_active: "Infeed | None" = None  # the open session of this replica, if any


class Infeed:
    """Iterator over this replica's batches (returned by :func:`popdist_lite.infeed`).

    The session starts at the first ``next()`` (or :meth:`start`), so a script can
    create it before reading its data or building its model. Iterating ends
    (``StopIteration``) on every replica at the same step. Use as a context manager or
    call :meth:`close` to end it early on every replica (e.g. after a fixed number of
    steps); starting another feed (a new epoch) or exiting the process closes it too.

    Attributes:
        steps: batches this replica has taken (plus the step :meth:`seek` started at).
        prefetch_depth: most batches in flight (sent and not yet released; a batch is
            released when the loop asks for the next one).
        exact: whether ``make_dataset`` has an ``offset`` parameter, so that a session
            can start at any global position (:mod:`popdist_lite.infeed.position`).
    """

    def __init__(self, source, prefetch_depth: int, exact: bool = False):
        self._source = source
        self.prefetch_depth = prefetch_depth
        self.exact = exact
        self.steps = 0
        self._seeked = 0      # the value seek() gave steps
        self._start = 0       # global position of the session's first batch
        self._first_step = 0  # the sources' first step (their round robin over feeders)
        self._offset = 0 if exact else None  # what an exact dataset is opened at
        self._started = False
        self._closed = False
        self._prefetch: list = []  # (table, key) pairs of prefetch_rows
        self._ahead: collections.deque = collections.deque()  # batches taken from the source, not yet handed out
        self._source_ended = False
        comm = topology.replica_comm()
        self._replicas = comm if comm.Get_size() > 1 else None  # None: nobody to agree with
        from mpi4py import MPI

        self._minimum = MPI.MIN

    def start(self) -> "Infeed":
        """Start prefetching now (feeders call ``make_dataset``). Idempotent."""
        global _active
        if not self._started and not self._closed:
            if _active is not None and _active is not self:
                _active.close()
            self._started = True
            _active = self
            self._source.start(self._first_step, self._offset)
        return self

    def prefetch_rows(self, table, key=None) -> "Infeed":
        """Have ``table`` (a :class:`popdist_lite.HostEmbedding` on disk storage) fetch
        the rows of ``batch[key]`` of the batches ahead into its cache while the current
        step computes (``docs/offload.md``, "Prefetch"). The feed then takes batches
        :attr:`prefetch_depth` steps ahead of the one it hands out and, after each
        step's agreement, calls ``table.prefetch(batch[key], ahead=j)`` (collective) for
        the batch ``j = prefetch_depth`` steps ahead (at the first step, for ``j = 1 ..
        prefetch_depth``). Each batch's rows stay in the cache until its update, so the
        cache must hold ``prefetch_depth + 1`` batches' distinct rows per replica (else
        a ``ValueError`` on every replica naming the bytes needed). Batches and results
        are unchanged. Call before the first batch; may be called once per table and key.

        Args:
            table: the table (an in-memory table is accepted and does nothing).
            key: which part of a batch holds the table's IDs: a ``str`` key of a dict
                batch, an ``int`` index of a tuple batch, or ``None`` for a batch that is
                one array. A batch without it is a ``KeyError`` on every replica at that step.

        Returns:
            the feed (calls chain).

        Raises:
            ValueError: the session has started.
            TypeError: ``table`` has no ``prefetch`` method, or ``key`` is not a str, int or None.
        """
        if self._started:
            raise ValueError("Infeed.prefetch_rows: the session has started; call it before the first batch")
        if not callable(getattr(table, "_prefetch", None)) or not callable(getattr(table, "drop_prefetches", None)):
            raise TypeError(f"Infeed.prefetch_rows: argument table: expected a HostEmbedding, got {table!r}")
        if key is not None and (isinstance(key, bool) or not isinstance(key, (str, int))):
            raise TypeError(f"Infeed.prefetch_rows: argument key: expected a str, an int or None, got {key!r}")
        self._prefetch.append((table, key))
        return self

    @property
    def started(self) -> bool:
        """Whether the session has started (the first batch was asked for, or :meth:`start`)."""
        return self._started

    def seek(self, step: int | None = None, *, position: int | None = None) -> None:
        """Start the session after the batches already taken instead of at the beginning
        (resuming from a checkpoint). No communication. Give one of:

        ``step``: batch ``step`` of this replica's sequence (:attr:`steps` becomes
        ``step``). The batches before are skipped where they are made (on the feeders,
        or in the thread): ``make_dataset(shard_index, num_shards, start=k)`` is called
        when it has a ``start`` parameter (``k`` = batches of that shard to skip),
        otherwise the first ``k`` batches are computed and dropped. With feeders, step
        ``s`` still comes from feeder ``s % F``, so the batches equal those of an
        uninterrupted run.

        ``position``: after ``position`` global batches (taken by all replicas together,
        :attr:`position`), at any replica count: exactly there when ``make_dataset`` has
        an ``offset`` parameter (:attr:`exact`), else at step ``ceil(position / R)``
        (docs/checkpoint.md, "Feed position").

        Raises:
            ValueError: the session has started, or not exactly one of ``step`` and
                ``position`` is given as an integer >= 0.
        """
        if self._started:
            raise ValueError("Infeed.seek: the session has started; seek before the first batch")
        if (step is None) == (position is None):
            raise ValueError("Infeed.seek: give exactly one of step and position")
        name, value = ("step", step) if position is None else ("position", position)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"Infeed.seek: argument {name}: expected an integer >= 0, got {value!r}")
        replicas = topology.num_replicas()
        target = int(position) if position is not None else int(step) * replicas
        self._first_step, self._offset = session_start(target, replicas, self.exact)
        self._start = target if self.exact else self._first_step * replicas
        self.steps = self._seeked = int(step) if step is not None else \
            target // replicas if self.exact else self._first_step

    @property
    def position(self) -> int:
        """Global batches taken so far by all replicas together (the same on every
        replica): where the session started plus R per step since."""
        return self._start + (self.steps - self._seeked) * topology.num_replicas()

    def __iter__(self) -> "Infeed":
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        self.start()
        batch = self._take() if self._prefetch else self._source.fetch()
        have = batch is not None
        if self._replicas is not None:  # every replica has a batch, or all stop here
            flag = numbered_all_reduce(np.array([have], dtype=np.int32), self._minimum, self._replicas, "infeed")
            have = bool(flag[0])
        if not have:
            self.close()
            raise StopIteration
        first = self.steps == self._seeked
        self.steps += 1
        if self._prefetch:
            for j in range(1 if first else self.prefetch_depth, self.prefetch_depth + 1):
                self._prefetch_batch(j)
        return batch

    def _take(self) -> Any | None:
        """The next batch from the batches ahead, after taking from the source until
        :attr:`prefetch_depth` more are ahead of it (or the source ended). Local."""
        while len(self._ahead) <= self.prefetch_depth and not self._source_ended:
            batch = self._source.fetch()
            if batch is None:
                self._source_ended = True
            else:
                self._ahead.append(batch)
        return self._ahead.popleft() if self._ahead else None

    def _prefetch_batch(self, j: int) -> None:
        """Every table's prefetch of the batch ``j`` steps ahead of the one handed out
        (no IDs when this replica has none). Collective."""
        from ..collectives import Problem  # not at import: importing popdist_lite starts no MPI

        batch = self._ahead[j - 1] if len(self._ahead) >= j else None
        for table, key in self._prefetch:
            ids, problem = _NO_IDS, None
            if batch is not None:
                try:
                    ids = batch if key is None else batch[key]
                except (KeyError, IndexError, TypeError):
                    problem = Problem(KeyError, f"infeed: prefetch_rows: the batch {j} step(s) ahead has no {key!r}")
            table._prefetch(ids, j, problem)

    def close(self) -> None:
        """End the session (no collective): wait for batches already granted, stop the
        feeders or the thread. Idempotent."""
        global _active
        if self._closed:
            return
        self._closed = True
        self._ahead.clear()
        for table, _ in self._prefetch:
            table.drop_prefetches()  # their batches will not come
        if self._started:
            self._source.finish()
        if _active is self:
            _active = None

    # -- checkpoints (the Stateful protocol of popdist_lite.checkpoint) -----------------
    def state_dict(self) -> dict:
        """The feed position: ``{"position": global batches taken, "steps": position // R,
        "replicas": R, "feeders": F}`` (``steps`` for readers of the older form, which had
        no ``position``)."""
        replicas = topology.num_replicas()
        return {"position": self.position, "steps": self.position // replicas, "replicas": replicas,
                "feeders": topology.feeders_per_replica()}

    def validate_state_dict(self, state_dict: dict, saved) -> None:
        """Refuse a position that is not one (non-negative counts), or a load into a feed
        that has started.

        Raises:
            ValueError: naming the state and the field.
        """
        if self._started:
            raise ValueError(f"state {saved.name!r}: the Infeed has started; load the checkpoint before taking "
                             f"its first batch")
        optional = ("position",) if "position" in state_dict else ()
        for field, low in (("steps", 0), ("replicas", 1), ("feeders", 0), *((name, 0) for name in optional)):
            value = state_dict.get(field)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"state {saved.name!r}: {field} must be an integer >= {low}, got {value!r}")

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume after the batches already taken: :meth:`seek` to the saved ``position``
        (a checkpoint of the older form, without it: ``steps * replicas``). At the same
        replica count the session continues at the same step; at another, exactly after
        the position when ``make_dataset`` has an ``offset`` parameter, else at the first
        step whose batches follow every batch already taken, ``ceil(position / R')`` (no
        batch repeated, fewer than ``R'`` skipped; docs/checkpoint.md)."""
        position = state_dict.get("position", state_dict["steps"] * state_dict["replicas"])
        self.seek(position=position)

    def __enter__(self) -> "Infeed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
