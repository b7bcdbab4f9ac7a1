"""The stall timeout under plain ``mpirun``: ``POPDIST_LITE_STALL_TIMEOUT=S``.

Under ``poprun-lite`` the launcher sees every replica's progress and ends a stalled job
itself (``--stall-timeout``, naming the missing replicas and showing their stacks).
Under plain ``mpirun`` nothing sees all replicas, so each replica watches itself: a
daemon thread checks once a second whether this replica has been inside the same
popdist-lite collective call (its main thread blocked in a function of
``popdist_lite.collectives`` or ``popdist_lite.embedding``, the call number unchanged)
for ``S`` seconds; if so it prints the replica, the operation, the call number and
this replica's Python stack (every thread) to stderr, then ends the job with
``MPI.COMM_WORLD.Abort(1)``, as an uncaught exception does.

What it cannot do: name the replicas that did not enter the call (they are the ones
*not* waiting, and only the launcher sees them), see a stall inside MPI calls the
program makes itself, or end the job when the MPI library cannot abort from a second
thread (mpi4py asks for ``MPI_THREAD_MULTIPLE`` by default, which Open MPI and MPICH
provide).
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import threading
import time

from . import progress

ENV = "POPDIST_LITE_STALL_TIMEOUT"
_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_WAIT_DIRS = tuple(os.path.join(_PACKAGE, d) + os.sep for d in ("collectives", "embedding"))
_state: dict = {"thread": None}


def in_collective(thread_id: int) -> bool:
    """True when the innermost Python frame of thread ``thread_id`` is popdist-lite
    collective or embedding code (where a replica waits for the others)."""
    frame = sys._current_frames().get(thread_id)
    return frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_WAIT_DIRS)


def start(timeout: float, replica: int, abort) -> None:
    """Watch this replica (see the module docstring); ``abort()`` ends the job. Turns on
    the progress recorder in this process's memory if nothing else did. Idempotent."""
    if _state["thread"] is not None:
        return
    progress.enable(None)
    main = threading.main_thread().ident

    def watch():
        seen, stuck_since = None, None
        while True:
            time.sleep(min(1.0, timeout / 4))
            last = progress.last_call()
            if last is None or not in_collective(main):
                seen = stuck_since = None
                continue
            if last[:3] != seen:
                seen, stuck_since = last[:3], time.time()
            waited = time.time() - max(last[2], stuck_since)
            if waited >= timeout:
                break
        call, op, _ = seen
        waited = time.time() - seen[2]
        try:
            sys.stderr.write(
                f"popdist-lite: stall timeout: replica {replica} ({socket.gethostname()}, pid "
                f"{os.getpid()}) has waited {waited:.1f} s in {op} (collective call #{call}), "
                f"which another replica has not entered ({ENV}={timeout:g}). Under plain mpirun "
                f"the missing replicas cannot be named: poprun-lite --stall-timeout names them "
                f"and shows their stacks. Python stack of replica {replica}:\n")
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - stderr may be closed; end the job anyway
            pass
        abort()

    _state["thread"] = threading.Thread(target=watch, name="popdist-lite stall watchdog", daemon=True)
    _state["thread"].start()


def start_from_env(replica: int, abort, environ=None) -> None:
    """Start the watchdog when ``POPDIST_LITE_STALL_TIMEOUT`` is a positive number and the
    rank has no poprun-lite agent watching it (no ``POPDIST_LITE_PROGRESS_FILE``).

    Raises:
        ValueError: the variable is set but not a number.
    """
    environ = os.environ if environ is None else environ
    text = environ.get(ENV, "").strip()
    if not text or environ.get(progress.PROGRESS_ENV):
        return
    try:
        timeout = float(text)
    except ValueError:
        raise ValueError(f"{ENV}: expected a number of seconds, got {text!r}") from None
    if timeout > 0:
        start(timeout, replica, abort)
