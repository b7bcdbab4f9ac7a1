"""Uncaught exceptions in a rank: name the replica, leave a record, abort the job.

:func:`install` replaces ``sys.excepthook`` and ``threading.excepthook``. On an
uncaught exception the hook

1. prints a line naming the replica, then the traceback, to stderr;
2. sends an ``error`` record (:mod:`popdist_lite.records`: the replica, role, feeder
   index, host, pid, time, exception class, message and traceback) to the rank's
   poprun-lite agent, waiting up to :data:`RECORD_TIMEOUT_SECONDS` until the agent has
   passed it on to the launcher (nothing is sent without an agent);
3. calls ``MPI.COMM_WORLD.Abort(1)`` when MPI is initialised and the job has more
   than one rank (as ``python -m mpi4py`` does), so the other ranks stop within
   seconds instead of waiting forever in a collective.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import traceback

from . import records

#: Seconds the hook waits for its agent to pass the error record on before aborting.
RECORD_TIMEOUT_SECONDS = 5.0

_state: dict = {"installed": False, "replica": 0, "role": "replica", "feeder": None}


def _who() -> str:
    """``replica 3``, ``feeder 1 of replica 3`` (or ``feeder 3`` without an index)."""
    if _state["role"] == "feeder" and _state["feeder"] is not None:
        return f"feeder {_state['feeder']} of replica {_state['replica']}"
    return f"{_state['role']} {_state['replica']}"


def _mpi_world():
    """COMM_WORLD if mpi4py is imported and MPI is initialised (never imports MPI)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return None
    try:
        if mpi.Is_initialized() and not mpi.Is_finalized():
            return mpi.COMM_WORLD
    except Exception:  # noqa: BLE001
        pass
    return None


def _rank() -> int | None:
    world = _mpi_world()
    if world is not None:
        return world.Get_rank()
    return records.env_rank()


def _send_record(exc_type, exc_value, text: str, rank) -> None:
    ident = records.identity(rank=rank, replica=_state["replica"], role=_state["role"],
                             feeder=_state["feeder"], pid=os.getpid())
    try:
        records.send(records.make("error", ident,
                                  exception=getattr(exc_type, "__name__", str(exc_type)),
                                  message=str(exc_value), traceback=text),
                     timeout=RECORD_TIMEOUT_SECONDS)
    except Exception:  # noqa: BLE001 - the abort below matters more than the record
        pass


def _handle(exc_type, exc_value, exc_tb, where: str = "") -> None:
    rank = _rank()
    text = "".join(traceback.format_exception(exc_type, exc_value, exc_tb))
    rank_text = "" if rank is None else f", rank {rank}"
    try:
        sys.stderr.write(f"popdist-lite: uncaught exception in {_who()} "
                         f"({socket.gethostname()}{rank_text}{where}):\n"
                         f"{text}")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - stderr may be closed
        pass
    _send_record(exc_type, exc_value, text, rank)
    world = _mpi_world()
    if world is not None and world.Get_size() > 1:
        world.Abort(1)


def report_and_abort(exc: BaseException) -> None:
    """Treat ``exc`` as this process's uncaught exception (print it, send the ``error``
    record, abort the job), for a ``BaseException`` the hooks never see because the
    caller catches it: a feeder's ``SystemExit`` or ``KeyboardInterrupt``, which would
    otherwise end the feeder quietly and leave its replica waiting."""
    _handle(type(exc), exc, exc.__traceback__)


def _excepthook(exc_type, exc_value, exc_tb) -> None:
    _handle(exc_type, exc_value, exc_tb)


def _threading_excepthook(args) -> None:
    if args.exc_type is SystemExit:  # ignored in threads, as by the default hook
        return
    name = f", thread {args.thread.name}" if args.thread is not None else ""
    _handle(args.exc_type, args.exc_value, args.exc_traceback, name)


def install(replica_index: int, role: str = "replica", feeder_index: int | None = None) -> None:
    """Install the hooks for this process, driving replica ``replica_index`` (on a
    feeder: the replica it feeds; ``feeder_index`` is then its index, recorded as
    ``"feeder"``).

    Idempotent: a second call only updates the replica index, role and feeder index.
    """
    _state["replica"] = int(replica_index)
    _state["role"] = role
    _state["feeder"] = None if feeder_index is None else int(feeder_index)
    if _state["installed"]:
        return
    sys.excepthook = _excepthook
    threading.excepthook = _threading_excepthook
    _state["installed"] = True
