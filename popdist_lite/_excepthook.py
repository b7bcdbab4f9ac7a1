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

The traceback it prints and records is the user's (:func:`format_exception`): when the
exception passed through the user's code, popdist_lite's own frames are left out, so a
collective's error reads as raised from the user's call, as numpy's do (JAX filters its
tracebacks the same way), and a note at the end says how many were left out. The
exception itself is untouched: ``__traceback__`` keeps every frame for a debugger
(``pdb.post_mortem``), and ``POPDIST_LITE_FULL_TRACEBACK=1`` prints and records the
full traceback. The filter is here, where the library prints tracebacks, rather than
at every public entry point re-raising with a trimmed ``__traceback__``: it covers every
error of every module (present and future) with no wrapper on the collectives' hot
path, and loses no frame a debugger needs.
"""

from __future__ import annotations

import os
import socket
import sys
import sysconfig
import threading
import traceback

from . import records

#: Seconds the hook waits for its agent to pass the error record on before aborting.
RECORD_TIMEOUT_SECONDS = 5.0
#: ``POPDIST_LITE_FULL_TRACEBACK=1``: print and record tracebacks with the library's frames.
FULL_TRACEBACK_ENV = "POPDIST_LITE_FULL_TRACEBACK"

_LIBRARY = os.path.dirname(os.path.realpath(__file__)) + os.sep
_STDLIB = tuple({os.path.realpath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")})

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


def _library_frame(filename: str) -> bool:
    """Whether ``filename`` is a module of popdist_lite."""
    return os.path.realpath(filename).startswith(_LIBRARY)


def _user_frame(filename: str) -> bool:
    """Whether ``filename`` is neither popdist_lite's nor Python's own (``<frozen ...>``,
    the standard library): the user's script (``<string>`` for ``python -c``), or a
    package it calls."""
    if filename.startswith("<"):
        return not filename.startswith("<frozen ")
    path = os.path.realpath(filename)
    return not path.startswith(_LIBRARY) and not path.startswith(_STDLIB)


def _chain(te: traceback.TracebackException):
    """``te`` and every exception chained to it (cause, context, an exception group's members)."""
    seen, todo = set(), [te]
    while todo:
        item = todo.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        todo += [item.__cause__, item.__context__, *(getattr(item, "exceptions", None) or ())]


def format_exception(exc_type, exc_value, exc_tb, full: bool | None = None) -> str:
    """The text of a traceback as the user should see it: ``traceback.format_exception``
    without popdist_lite's frames, followed by a one-line note of how many were left out.

    Frames are left out only when the exception passed through the user's code (a frame
    that is neither popdist_lite's nor the standard library's, e.g. the script's call of
    a collective); then every popdist_lite frame of the exception and of the exceptions
    chained to it goes, so the innermost frame shown is the user's call into the library
    (or the user's own code it called back, a dataset's for example). An error with no
    user frame (in a thread of the library) keeps all its frames.

    Args:
        exc_type, exc_value, exc_tb: as for ``sys.excepthook``.
        full: keep every frame; default: whether ``POPDIST_LITE_FULL_TRACEBACK`` is set to
            anything but ``0``.
    """
    if full is None:
        full = os.environ.get(FULL_TRACEBACK_ENV, "") not in ("", "0")
    te = traceback.TracebackException(exc_type, exc_value, exc_tb, compact=True)
    if not full and any(_user_frame(f.filename) for f in te.stack):
        hidden = 0
        for item in _chain(te):
            kept = [f for f in item.stack if not _library_frame(f.filename)]
            hidden += len(item.stack) - len(kept)
            item.stack = traceback.StackSummary.from_list(kept)
        if hidden:
            return "".join(te.format()) + (f"({hidden} frame{'s' if hidden > 1 else ''} of popdist_lite "
                                           f"not shown; {FULL_TRACEBACK_ENV}=1 shows them)\n")
    return "".join(te.format())


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
    text = format_exception(exc_type, exc_value, exc_tb)
    rank_text = "" if rank is None else f", rank {rank}"
    try:
        sys.stderr.write(f"popdist-lite: uncaught exception in {_who()} "
                         f"({socket.gethostname()}{rank_text}{where}):\n"
                         f"{text}")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - stderr may be closed
        pass
    timeline = sys.modules.get("popdist_lite.timeline")
    if timeline is not None:  # under poprun-lite: the events so far reach the launcher's timeline
        timeline.flush()
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
