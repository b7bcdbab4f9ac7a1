"""The replica side of a feed with host feeders: credits, receives posted ahead.

Step ``s`` of a session comes from feeder ``s % F`` (round robin, hence a fixed batch
order for given R, F and data). The replica keeps ``depth`` steps outstanding: for each
it posts the header receive and sends the feeder a credit, so feeders compute up to
``depth`` batches ahead. The data receives of the batch being fetched (and of the next
``DATA_LOOKAHEAD``) are posted once their headers have arrived, into arrays of earlier
batches the training loop has dropped, else new ones (:mod:`.buffers`). A step's slot is
re-granted only when the training loop asks for the next batch, so sent-but-not-released
batches never exceed ``depth``.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI

from . import protocol
from .buffers import shared_pool
from .structure import Structure, describe, empty_arrays, layout, num_shape_words, unflatten

#: Batches beyond the one being fetched whose data receives are posted ahead. Zero: the
#: launcher places feeders on their replica's host, where MPI moves a batch by a copy
#: the receiving process makes inside its own MPI call once the receive matches (CMA or
#: shared-memory fragments), so a receive posted early overlaps nothing; it only adds a
#: buffer to the set rotating through the cache (figures in docs/infeed.md). Credits and
#: headers still run ``depth`` ahead, so feeders still compute ahead of the training loop.
DATA_LOOKAHEAD = 0


@dataclass(slots=True)
class _Slot:
    step: int
    source: int  # rank in the feed communicator: 1 + feeder index
    header: np.ndarray
    header_request: Any
    credit_request: Any
    ended: bool = False
    arrays: list | None = None
    data_requests: list = field(default_factory=list)


_open: "FeederSource | None" = None  # this replica's session in progress, if any


class FeederSource:
    """Batches of one replica's feeders (ranks ``1..F`` of ``comm``), in round-robin order."""

    def __init__(self, comm, depth: int, replica: int):
        self.comm, self.depth, self.replica = comm, depth, replica
        self.num_feeders = comm.Get_size() - 1
        self.slots: collections.deque[_Slot] = collections.deque()
        self.structure: Structure | None = None
        self.next_step = 0
        self.fetched = 0
        self.ended = False

    def start(self, first_step: int = 0, offset: int | None = None) -> None:
        """Start a session at step ``first_step`` (and, for a dataset with an ``offset``
        parameter, at global position ``offset``): feeders call ``make_dataset`` (and skip
        their batches of earlier steps); check their structures agree.

        Raises:
            TypeError: two feeders of this replica yield batches of different structure.
        """
        for k in range(self.num_feeders):
            self.comm.Send(protocol.control(protocol.START, first_step, offset), dest=1 + k,
                           tag=protocol.CONTROL)
        structures = []
        for k in range(self.num_feeders):
            protocol.wait_until(lambda: self.comm.Iprobe(source=1 + k, tag=protocol.STRUCTURE))
            structures.append(self.comm.recv(source=1 + k, tag=protocol.STRUCTURE))
        known = [(k, s) for k, s in enumerate(structures) if s is not None]
        for k, s in known[1:]:
            if s != known[0][1]:
                raise TypeError(
                    f"infeed: the feeders of replica {self.replica} yield batches of different "
                    f"structure: feeder {known[0][0]} {describe(known[0][1])}, feeder {k} "
                    f"{describe(s)}; every feeder's make_dataset must yield the same keys and dtypes")
        self.structure = known[0][1] if known else None
        fields = len(self.structure[1]) if self.structure else 0
        self.pool = shared_pool((self.depth + 2) * fields)
        self.header_words = protocol.HEADER_WORDS + num_shape_words(self.structure)
        self.fields = layout(self.structure) if self.structure else []
        self.next_step = first_step
        global _open
        _open = self
        for _ in range(self.depth):
            self._post()

    def _post(self) -> None:
        step, source = self.next_step, 1 + self.next_step % self.num_feeders
        header = np.empty(self.header_words, dtype=np.int64)
        self.slots.append(_Slot(
            step, source, header,
            self.comm.Irecv(header, source=source, tag=protocol.HEADER),
            self.comm.Isend(protocol.control(protocol.CREDIT, step), dest=source, tag=protocol.CONTROL)))
        self.next_step += 1

    def _on_header(self, slot: _Slot) -> None:
        code, step = int(slot.header[0]), int(slot.header[1])
        if step != slot.step:
            raise RuntimeError(f"infeed: replica {self.replica} expected step {slot.step} from "
                               f"feeder {slot.source - 1}, got {step}")
        if code == protocol.END:
            slot.ended = True
            return
        slot.arrays = empty_arrays(self.fields, slot.header[protocol.HEADER_WORDS:], self.pool.empty)
        slot.data_requests = [self.comm.Irecv([a, MPI.BYTE], source=slot.source, tag=protocol.DATA)
                              for a in slot.arrays]

    def _progress(self) -> None:
        """Post the data receives of the next ``1 + DATA_LOOKAHEAD`` slots whose headers
        have arrived (in step order)."""
        for slot in itertools.islice(self.slots, 1 + DATA_LOOKAHEAD):
            if slot.ended or slot.arrays is not None:
                continue
            if not slot.header_request.Test():
                break
            self._on_header(slot)

    def _complete(self, slot: _Slot) -> None:
        if not (slot.ended or slot.arrays is not None):
            protocol.wait(slot.header_request)
            self._on_header(slot)
        # the header is here and the data right behind it: MPI's own (spinning) wait
        MPI.Request.Waitall(slot.data_requests)
        protocol.wait(slot.credit_request)

    def fetch(self) -> Any | None:
        """The next batch, or None once a feeder's data has run out (its turn came and it
        answered ``END``). Asking for the next batch releases the previous one."""
        if self.ended:
            return None
        if self.fetched:
            self._post()  # the previous batch is released: grant its slot again
        self._progress()
        slot = self.slots[0]
        self._complete(slot)
        if slot.ended:
            self.ended = True
            return None
        self.slots.popleft()
        self.fetched += 1
        return unflatten(self.structure, slot.arrays)

    def finish(self) -> None:
        """End the session: answer-wait every outstanding credit, then ``STOP`` the feeders."""
        global _open
        if _open is self:
            _open = None
        while self.slots:
            self._complete(self.slots.popleft())
        self._stop_feeders()

    def _stop_feeders(self) -> None:
        for k in range(self.num_feeders):
            self.comm.Send(protocol.control(protocol.STOP), dest=1 + k, tag=protocol.CONTROL)


def shutdown_feeders(comm) -> None:
    """At a replica's exit: finish the session in progress, if any (every credit
    answered, ``STOP``), then send ``SHUTDOWN`` to feeders ``1..F`` of its feed
    communicator ``comm``; nothing once MPI is finalized. Registered by
    :func:`popdist_lite.services.start` at exit, before MPI is finalized."""
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    if _open is not None:
        _open.finish()
    for k in range(1, comm.Get_size()):
        comm.Send(protocol.control(protocol.SHUTDOWN), dest=k, tag=protocol.CONTROL)
