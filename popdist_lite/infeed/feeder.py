"""The feeder side: run the dataset and stream its batches to the replica.

A feeder answers its replica's control messages (:mod:`.protocol`): on ``START`` it
calls ``make_dataset(shard_index, num_shards)`` and sends the batch structure; on each
``CREDIT`` it sends one batch (or ``END`` once the data has run out) with non-blocking
buffer sends and computes the next batch while they progress, so at most one batch is
computed ahead of the credits; ``STOP`` ends a session, ``SHUTDOWN`` the process.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Iterable, NoReturn

import numpy as np
from mpi4py import MPI

from .. import _excepthook
from . import protocol
from .position import feeder_skip, open_dataset
from .structure import check_same, encode_shapes, flatten

_END = object()


class _Shutdown(Exception):
    """The replica asked this feeder to exit."""


def _receive_control(comm, pending: list | None = None) -> tuple[int, int, int]:
    """The next control message, waited for politely (:func:`protocol.wait_until`: a
    short spin, then sleeps), testing the ``pending`` sends meanwhile so MPI can move
    them along and their buffers are freed. Not a busy wait: a spinning feeder takes a core
    from its replica whenever feeders outnumber free cores."""
    message = np.empty(protocol.CONTROL_WORDS, dtype=np.int64)
    request = comm.Irecv(message, source=0, tag=protocol.CONTROL)

    def arrived() -> bool:
        if pending:
            pending[:] = [p for p in pending if not MPI.Request.Testall(p[0])]
        return request.Test()

    protocol.wait_until(arrived)
    return int(message[0]), int(message[1]), int(message[2])


def _session(make_dataset: Callable[[int, int], Iterable[Any]], comm, shard_index: int,
             num_shards: int, name: str, first_step: int = 0, offset: int | None = None) -> None:
    """One feed session from the replica's step ``first_step`` (or, for a dataset with an
    ``offset`` parameter, from global position ``offset``); returns on ``STOP``, raises
    :class:`_Shutdown` on ``SHUTDOWN``."""
    skip = feeder_skip(first_step, comm.Get_size() - 1, comm.Get_rank() - 1)
    batches = open_dataset(make_dataset, shard_index, num_shards, skip, offset)
    batch = next(batches, _END)
    structure, arrays = (None, None) if batch is _END else flatten(batch)
    comm.send(structure, dest=0, tag=protocol.STRUCTURE)  # small: kind, keys, dtypes, ndims
    sent = 0
    pending: list[tuple[list, np.ndarray, list]] = []  # requests and the buffers they use
    try:
        while True:
            code, slot, _ = _receive_control(comm, pending)
            if code == protocol.STOP:
                return
            if code == protocol.SHUTDOWN:
                raise _Shutdown
            if code != protocol.CREDIT:
                raise RuntimeError(f"infeed: {name} got control code {code} during a session")
            if arrays is None:
                comm.Send(np.array([protocol.END, slot], dtype=np.int64), dest=0, tag=protocol.HEADER)
                continue
            header = np.array([protocol.BATCH, slot, *encode_shapes(arrays)], dtype=np.int64)
            requests = [comm.Isend(header, dest=0, tag=protocol.HEADER)]
            requests += [comm.Isend([a, MPI.BYTE], dest=0, tag=protocol.DATA) for a in arrays]
            pending.append((requests, header, arrays))
            sent += 1
            # the next batch is computed while the sends above progress
            batch = next(batches, _END)
            if batch is _END:
                arrays = None
            else:
                got, arrays = flatten(batch)
                check_same(structure, got, f"batch {sent} of {name} (shard {shard_index} of {num_shards})")
            pending[:] = [p for p in pending if not MPI.Request.Testall(p[0])]
    finally:
        for requests, _, _ in pending:
            protocol.wait_all(requests)


def serve(make_dataset: Callable[[int, int], Iterable[Any]], comm, shard_index: int,
          num_shards: int, name: str) -> NoReturn:
    """Serve feed sessions to rank 0 of ``comm`` until it shuts down, then finalize MPI
    and end the process with exit code 0 (``os._exit``: the training code after the
    ``infeed`` call never runs on a feeder). Anything ``make_dataset`` raises, any
    ``BaseException`` (``SystemExit`` and ``KeyboardInterrupt`` included: a feeder that
    ended quietly would leave its replica waiting for batches), aborts the job through
    the failure hook, which names this feeder (``feeder K of replica N``) to the launcher.
    """
    try:
        while True:
            code, first_step, offset = _receive_control(comm)
            if code == protocol.SHUTDOWN:
                break
            if code != protocol.START:
                raise RuntimeError(f"infeed: {name} expected START or SHUTDOWN, got control code {code}")
            _session(make_dataset, comm, shard_index, num_shards, name, max(first_step, 0),
                     offset if offset >= 0 else None)
    except _Shutdown:
        pass
    except BaseException as exc:  # noqa: BLE001 - see the docstring
        _excepthook.report_and_abort(exc)
        os._exit(1)  # only reached if MPI could not abort
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not turn exit 0 into a failure
            pass
    MPI.Finalize()
    os._exit(0)
