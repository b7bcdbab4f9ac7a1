"""Call numbers: every collective call the library makes, counted per communicator and
recorded for poprun-lite's stall inspector; state kept on a communicator.

A leaf module (it imports only :mod:`popdist_lite.progress` and
:mod:`popdist_lite.counters`, and mpi4py inside functions), so that any part of the
library can number its calls without importing the collectives package:

- :func:`next_call_number`: this replica's number for its next call on a communicator;
- :func:`comm_cache`: a dict that lives on the MPI communicator itself;
- :func:`numbered_all_reduce`: a small unchecked all-reduce, numbered and counted (the
  feed's per-step end-of-data agreement, ``should_checkpoint``);
- :func:`numbered`: any other MPI call on a communicator (a checkpoint's ``bcast`` and
  ``gather``, the timeline's ``Gather``, a ``Dup``), numbered and counted;
- :func:`set_lane`: the stall inspector's lane of a communicator whose calls are
  issued independently of the main thread's (:mod:`popdist_lite.progress`).

The checked collectives (:mod:`popdist_lite.collectives`) take their numbers here too.
"""

from __future__ import annotations

import threading
import weakref
from time import perf_counter

from . import counters, progress

_CALLS = "call numbers"  # comm_cache(comm)[_CALLS]: the next call number on comm
_LANE = "progress lane"  # comm_cache(comm)[_LANE]: its progress lane's index (absent: 0, main)
_MAIN_THREAD = threading.main_thread()


def next_call_number(comm, op: str) -> int:
    """This replica's number for its next collective call ``op`` on ``comm`` (0, 1, 2, ...).

    The only place where call numbers are counted: every checked collective
    (:func:`popdist_lite.collectives.agree`) takes its number here, so replicas that
    issue different sequences of collectives are told apart by the number in their
    signatures. Unchecked calls (``set_collective_checks(False)``,
    :func:`numbered_all_reduce`, the non-blocking all-reduce) take one too, so the
    numbers stay in step on every replica and the stall inspector sees every collective:
    each call is recorded with :func:`popdist_lite.progress.record` (a no-op unless
    poprun-lite's stall inspector or ``POPDIST_LITE_STALL_TIMEOUT`` turned it on) on
    the communicator's lane (:func:`set_lane`; the main lane unless set).
    """
    cache = comm_cache(comm)
    seq = cache.get(_CALLS, 0)
    cache[_CALLS] = seq + 1
    lane = cache.get(_LANE, 0)
    if lane is not None:
        progress.record(op, seq, lane)
    return seq


def set_lane(comm, name: str) -> None:
    """Record ``comm``'s calls on the stall inspector's lane ``name``
    (:data:`popdist_lite.progress.LANE_NAME`) instead of the main lane: for a
    communicator of its own whose calls are issued independently of the main thread's
    (the JAX binding's, whose host callbacks run on XLA's threads; a background save's),
    so they neither replace the main lane's last call nor hide behind it. When all
    :data:`popdist_lite.progress.MAX_LANES` lanes are taken, ``comm``'s calls are
    numbered but not recorded. Local (no MPI call); every replica sets the same lane on
    the same communicator.

    Raises:
        ValueError: ``name`` is not a lane name.
    """
    comm_cache(comm)[_LANE] = progress.lane_index(name)


def numbered_all_reduce(values, op, comm, name: str):
    """Collective, unchecked: all-reduce the small numpy array ``values`` in place with
    the MPI operation ``op`` (``MPI.MIN``, ``MPI.MAX``, ...), as call ``name`` on
    ``comm``: numbered (:func:`next_call_number`) and counted under ``name``
    (:mod:`popdist_lite.counters`). For agreements of a few integers every replica makes
    at the same point with the same dtype and length (nothing checks them).

    Returns:
        ``values``, now reduced.
    """
    from mpi4py import MPI

    next_call_number(comm, name)
    start = perf_counter()
    comm.Allreduce(MPI.IN_PLACE, values, op=op)
    n = values.nbytes * (comm.Get_size() - 1)
    counters.record(name, start, n, n)
    return values


def numbered(comm, name: str, call, *args, sent: int = 0, received: int = 0, **kwargs):
    """Collective, unchecked: ``call(*args, **kwargs)``, an MPI call on ``comm`` (a bound
    method such as ``comm.bcast`` or ``comm.Dup``), as call ``name``: numbered
    (:func:`next_call_number`, so the stall inspector names a replica that does not join
    it) and counted under ``name`` with ``sent`` / ``received`` payload bytes
    (:mod:`popdist_lite.counters`). Every replica makes the same call at the same point
    (nothing checks it).

    From a thread other than the main thread, on a communicator of the main lane, the
    call takes its number but is not recorded for the stall inspector: the main lane
    holds the main thread's last call, which a record from another thread could replace
    before the inspector read it. On a communicator with a lane of its own
    (:func:`set_lane`: a background save's) it is recorded there.

    Returns:
        what ``call`` returns.
    """
    if threading.current_thread() is _MAIN_THREAD or comm_cache(comm).get(_LANE, 0) != 0:
        next_call_number(comm, name)
    else:
        cache = comm_cache(comm)
        cache[_CALLS] = cache.get(_CALLS, 0) + 1
    start = perf_counter()
    result = call(*args, **kwargs)
    counters.record(name, start, sent, received)
    return result


_keyval: list = []  # the MPI attribute key of comm_cache, made at its first call
# id(Python object) -> (weak reference to it, its communicator's dict): comm_cache's fast
# path, trusted only while the reference still points to the very object asking.
_by_object: dict[int, tuple] = {}


def comm_cache(comm) -> dict:
    """A dict that lives on the MPI communicator itself and dies with it, for state kept
    per communicator (the call numbers here, a save's duplicate communicator).

    MPI's attribute caching (``MPI_Comm_create_keyval`` / ``MPI_Comm_set_attr``, through
    mpi4py's ``Comm.Create_keyval`` / ``Set_attr`` / ``Get_attr``): every Python object
    of one communicator sees the same dict, a duplicate (``Dup``) starts with none (no
    copy callback), and a freed communicator's dict goes with it. Keying by ``id(comm)``
    instead would hand a freed sub-communicator's state to an unrelated communicator
    that happens to reuse the Python object's address on some replicas only (their call
    numbers then differ and every check fails). A Python object asking again finds its
    dict through a weak reference to itself (about 150 ns, where ``Get_attr`` takes
    200 ns more). An object that is not an mpi4py communicator keeps its dict as an
    attribute.
    """
    hit = _by_object.get(id(comm))
    if hit is not None and hit[0]() is comm:  # the fast path: this very Python object seen before
        return hit[1]
    get = getattr(comm, "Get_attr", None)
    if get is None:
        cache = getattr(comm, "_popdist_lite_cache", None)
        if cache is None:
            cache = {}
            comm._popdist_lite_cache = cache
        return cache
    if not _keyval:
        from mpi4py import MPI

        _keyval.append(MPI.Comm.Create_keyval())
    cache = get(_keyval[0])
    if cache is None:
        cache = {}
        comm.Set_attr(_keyval[0], cache)
    key = id(comm)
    _by_object[key] = (weakref.ref(comm, lambda ref: _by_object.pop(key, None) if _by_object.get(key, (None,))[0]
                                   is ref else None), cache)
    return cache
