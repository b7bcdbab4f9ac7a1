"""Timeline: every collective and every embedding phase, per replica, as one Chrome-trace
JSON file that opens in Perfetto (https://ui.perfetto.dev) or ``chrome://tracing``.

Turned on by the environment variable ``POPDIST_LITE_TIMELINE=<file>`` (which
``poprun-lite --timeline <file>`` sets for every rank; under plain ``mpirun`` export
it yourself, e.g. ``mpirun -x POPDIST_LITE_TIMELINE=trace.json``). Like Horovod's
``--timeline-filename``. Off by default; when off, the only cost per call is the
``counters.events is not None`` check.

While on, :func:`popdist_lite.counters.record` keeps one event per call. At exit
(``atexit``, before MPI is finalised) every replica sends its events to replica 0
(one ``Gather`` of sizes and one ``Gatherv`` of JSON bytes, numbered and counted as
``timeline_gather`` and ``timeline_gatherv`` by :func:`popdist_lite.calls.numbered`,
so the stall inspector names a replica that does not join them: no shared file system
needed), and replica 0 writes the file: a JSON object whose ``traceEvents`` hold, per
replica ``k``, a ``process_name`` metadata event ("replica k"), a ``process_labels``
one (the host the replica ran on, ``socket.gethostname()``) and ``"ph": "X"``
events with ``pid = tid = k``, ``ts``/``dur`` in microseconds, ``cat`` =
``"collective"`` or ``"phase"`` and ``args = {"bytes_sent", "bytes_received"}``, and
``"ph": "C"`` counter events (``cat`` ``"counter"``, ``args`` the series' values: a disk
table's cache counters after each lookup and update, :func:`popdist_lite.counters.sample`).
Timestamps come from each process's wall clock, anchored once at start-up and advanced
with ``perf_counter``, and are shifted so that the earliest event is at 0.
A job that aborts (an uncaught exception on any rank) writes no timeline.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import tempfile
import time

import numpy as np

from . import counters
from .calls import numbered

ENV = "POPDIST_LITE_TIMELINE"
_state: dict = {"path": None, "anchor": None, "replica": 0}


def enabled() -> bool:
    """True when this process records a timeline."""
    return counters.events is not None


def enable(path: str, replica: int, comm) -> None:
    """Start recording; at exit, gather every replica's events on ``comm`` and have
    replica 0 write them to ``path``. Called by :func:`popdist_lite.init` when
    ``POPDIST_LITE_TIMELINE`` is set; collective only at exit."""
    if counters.events is not None:
        return
    _state.update(path=os.path.abspath(path), anchor=(time.time() * 1e6, time.perf_counter()),
                  replica=int(replica))
    counters.events = []
    atexit.register(_write_at_exit, comm)


def chrome_events(events, replica: int, anchor: tuple[float, float]) -> list[dict]:
    """Chrome-trace events (one track, ``pid = tid = replica``, labelled with this host's
    name) from recorded events."""
    wall0, pc0 = anchor
    out = [{"name": "process_name", "ph": "M", "pid": replica, "tid": replica,
            "args": {"name": f"replica {replica}"}},
           {"name": "process_labels", "ph": "M", "pid": replica, "tid": replica,
            "args": {"labels": socket.gethostname()}},
           {"name": "thread_name", "ph": "M", "pid": replica, "tid": replica,
            "args": {"name": f"replica {replica}"}}]
    for name, kind, start, seconds, sent, received, detail in events:
        if kind == counters.COUNTER:  # detail: the series' values (counters.sample)
            out.append({"name": name, "cat": kind, "ph": "C", "pid": replica, "tid": replica,
                        "ts": wall0 + (start - pc0) * 1e6, "args": detail})
            continue
        args = {"bytes_sent": sent, "bytes_received": received}
        if detail:
            args["table"] = detail
        out.append({"name": name, "cat": kind, "ph": "X", "pid": replica, "tid": replica,
                    "ts": wall0 + (start - pc0) * 1e6, "dur": seconds * 1e6, "args": args})
    return out


def merge(parts: list[list[dict]]) -> dict:
    """One trace from every replica's event list; timestamps shifted to start at 0."""
    events = [e for part in parts for e in part]
    starts = [e["ts"] for e in events if "ts" in e]
    t0 = min(starts) if starts else 0.0
    for e in events:
        if "ts" in e:
            e["ts"] = round(e["ts"] - t0, 3)
            if "dur" in e:
                e["dur"] = round(e["dur"], 3)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "popdist-lite", "replicas": len(parts)}}


def write(path: str, trace: dict) -> None:
    """Write ``trace`` as JSON to ``path`` atomically: into a new temporary file in the
    same directory (``tempfile.mkstemp``: an unpredictable name, created exclusively, so
    no symlink planted by another user is followed), then ``os.replace`` onto ``path``
    (which replaces a symlink at ``path`` rather than writing through it). The file is
    readable by its owner only, as ``mkstemp`` makes it.

    Raises:
        OSError: the directory is not writable (the temporary file is removed).
    """
    directory, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(trace, f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _write_at_exit(comm) -> None:
    events, counters.events = counters.events, None
    if events is None:
        return
    from mpi4py import MPI
    if MPI.Is_finalized():
        return
    mine = json.dumps(chrome_events(events, _state["replica"], _state["anchor"])).encode()
    size = np.array([len(mine)], dtype=np.int64)
    sizes = np.empty(comm.size, dtype=np.int64)
    root = comm.rank == 0
    numbered(comm, "timeline_gather", comm.Gather, size, sizes, root=0, sent=size.nbytes,
             received=size.nbytes * (comm.size - 1) if root else 0)
    data = np.frombuffer(mine, dtype=np.uint8)
    if root:
        gathered = np.empty(int(sizes.sum()), dtype=np.uint8)
        numbered(comm, "timeline_gatherv", comm.Gatherv, data, [gathered, (sizes, np.cumsum(sizes) - sizes)],
                 root=0, sent=data.nbytes, received=gathered.nbytes - data.nbytes)
        parts, offset = [], 0
        for n in sizes.tolist():  # once per replica at exit, not a hot path
            parts.append(json.loads(gathered[offset:offset + n].tobytes()))
            offset += n
        write(_state["path"], merge(parts))
    else:
        numbered(comm, "timeline_gatherv", comm.Gatherv, data, None, root=0, sent=data.nbytes)
