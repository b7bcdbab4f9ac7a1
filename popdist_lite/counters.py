"""Per-replica counters: calls, bytes sent, bytes received and seconds, per collective
and per embedding phase (``popdist_lite.stats()``, ``popdist_lite.reset_stats()``).

Every MPI call the library makes is recorded once, under the name of the collective
that made it (``all_gather``, ``all_to_all_v``, ...; ``agree`` is the small argument
check that precedes the checked collectives, ``agree_objects`` the pickles of a rare
agreement, ``infeed`` and ``should_checkpoint`` one-integer all-reduces; the gradient
buckets of ``popdist_lite.torch.DistributedDataParallel`` count as ``all_reduce``, with
the seconds of their wait). Bytes are the *payload* that leaves this
replica for other replicas and arrives from other replicas, as if each byte went
straight to the replicas that need it (what a step moves, independent of the MPI
library's algorithm; the copy to oneself is not counted):

===================  ===========================  ===============================
MPI call             bytes sent                   bytes received
===================  ===========================  ===============================
Allgather(v)         own bytes x (r - 1)          everyone else's bytes
Reduce_scatter       all but my own slice         my slice x (r - 1)
Alltoall(v)          all but my own chunk         all but my own chunk
Allreduce            n x (r - 1)                  n x (r - 1)
Bcast                root: n x (r - 1), else 0    root: 0, else n
===================  ===========================  ===============================

so over all replicas the bytes sent equal the bytes received. A float16 reduction
(``all_reduce``, ``reduce_scatter_sum(_v)``; float16 on the wire, see
:mod:`popdist_lite.collectives._reduce`) makes an ``Alltoall(v)`` (and, for an
all-reduce, an ``Allgather``) instead of MPI's reduction: it is one record under the
collective's name with the bytes of those rows and the seconds of the whole reduction,
including its float64 combine (so a float16 all-reduce of ``n`` bytes counts
``2 x (r - 1)/r x n`` each way, where an MPI ``Allreduce`` counts ``n x (r - 1)``).
Embedding phases
(``lookup.ids``, ``update.sum``, ...; see :mod:`popdist_lite.embedding.sparse`) are
counted separately under ``"phases"``, with the bytes of the exchanges they contain
(so phase bytes are not added to the totals a second time).

Counters are always on: each record is a dict update and a clock read (well under a
microsecond). When the timeline is on (:mod:`popdist_lite.timeline`) each record is
also kept as an event, and :func:`sample` keeps values of other counters (a disk
table's cache hits, misses, rows and bytes read, ...) as counter events. Only the
training loop's thread records (a background thread hands its spans to it).
"""

from __future__ import annotations

from time import perf_counter

#: Kinds of events: counted here (collectives, phases), a counter's values (:func:`sample`),
#: the user's timeline spans and steps (:mod:`popdist_lite.timeline`; not counted here).
COLLECTIVE, PHASE, COUNTER, SPAN, STEP = "collective", "phase", "counter", "span", "step"

# name -> [calls, bytes sent, bytes received, seconds, kind]
_table: dict[str, list] = {}
#: Events ``(name, kind, start, seconds, sent, received, detail)`` when the timeline is
#: on, else ``None``: the only cost of the timeline when it is off is this check.
#: ``start`` is a ``perf_counter()`` value; ``detail`` is a phase's table name, a
#: counter's ``{series: value}``, a step's ``{"step": n}``, a span's ``{"thread": name}``
#: from a thread other than the main one, else ``None``.
events: list | None = None


def record(name: str, start: float, sent: int = 0, received: int = 0, kind: str = COLLECTIVE,
           detail: str | None = None, end: float | None = None) -> None:
    """Count one call that began at ``start`` (a :func:`time.perf_counter` value) and ends now.

    Args:
        name: collective or phase name.
        start: ``perf_counter()`` at the start of the call.
        sent, received: payload bytes (see the module docstring).
        kind: ``"collective"`` or ``"phase"``.
        detail: shown on the timeline only (e.g. the table name).
        end: ``perf_counter()`` at its end, when that was not now (a background
            thread's span, recorded later by the training loop's thread).
    """
    seconds = (perf_counter() if end is None else end) - start
    row = _table.get(name)
    if row is None:
        row = _table[name] = [0, 0, 0, 0.0, kind]
    row[0] += 1
    row[1] += sent
    row[2] += received
    row[3] += seconds
    if events is not None:
        events.append((name, kind, start, seconds, int(sent), int(received), detail))


def sample(name: str, values: dict) -> None:
    """Keep the current ``values`` (``{series: int or float}``) of the counters ``name``
    as one timeline counter event (a ``"ph": "C"`` event: Perfetto draws each series as
    a track); nothing when the timeline is off. Not part of :func:`stats`."""
    if events is not None:
        events.append((name, COUNTER, perf_counter(), 0.0, 0, 0, dict(values)))


def stats() -> dict:
    """This replica's counters since the start (or the last :func:`reset_stats`).

    Returns:
        ``{"bytes_sent": int, "bytes_received": int, "seconds": float,
        "collectives": {name: entry}, "phases": {name: entry}}`` where each entry is
        ``{"calls": int, "bytes_sent": int, "bytes_received": int, "seconds": float}``.
        The totals sum the collectives (payload bytes, see the module docstring; seconds
        of wall time inside MPI calls). Phases (embedding lookup/update steps) hold the
        wall time of each step and the bytes its exchanges moved.
    """
    out: dict = {"bytes_sent": 0, "bytes_received": 0, "seconds": 0.0, "collectives": {}, "phases": {}}
    for name in sorted(_table):
        calls, sent, received, seconds, kind = _table[name]
        entry = {"calls": calls, "bytes_sent": sent, "bytes_received": received, "seconds": seconds}
        if kind == COLLECTIVE:
            out["collectives"][name] = entry
            out["bytes_sent"] += sent
            out["bytes_received"] += received
            out["seconds"] += seconds
        else:
            out["phases"][name] = entry
    return out


def reset_stats() -> None:
    """Zero every counter of this replica (timeline events already recorded are kept)."""
    _table.clear()
