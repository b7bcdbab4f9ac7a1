"""Timeline: every collective, every embedding phase and the user's own steps and spans,
per replica, as one Chrome-trace JSON file that opens in Perfetto
(https://ui.perfetto.dev) or ``chrome://tracing`` (docs/timeline.md).

Turned on by the environment variable ``POPDIST_LITE_TIMELINE=<file>`` (which
``poprun-lite --timeline <file>`` sets for every rank; under plain ``mpirun`` export
it yourself, e.g. ``mpirun -x POPDIST_LITE_TIMELINE=trace.json``). Like Horovod's
``--timeline-filename``. Off by default; when off, the only cost per call is the
``counters.events is not None`` check (a :class:`span` or :func:`step` also builds one
small object).

The user's part, public as ``popdist_lite.timeline``:

- :func:`step` marks the start of a training step (and the end of the one before), as
  ``torch.profiler``'s ``prof.step()`` does; ``with step(n):`` ends it with the block;
- :class:`span` times a block or a function (``with pl.timeline.span("data"):`` or
  ``@pl.timeline.span("data")``); spans and steps land on the replica's track with its
  collectives, which nest inside them.

Three parts, each replaceable: recording (:mod:`popdist_lite.counters` appends one tuple
per event to ``counters.events``: its docstring gives the layout), conversion
(:func:`drain` turns the events recorded since the last drain into Chrome-trace events,
with :func:`metadata_events` naming the replica's track; :func:`merge` joins every
replica's into one trace) and delivery. Under poprun-lite the delivery is a stream:
every :data:`STREAM_SECONDS` a thread of each rank drains the new events and sends them
to the rank's agent as ``timeline`` records (:mod:`popdist_lite.records`), which pass
them to the launcher, which checks them and writes the file at the job's end, whatever
the end: a job that failed or stalled leaves its events up to the last send
(launcher/supervise/timeline.py). Under plain mpirun it is one gather at exit
(``atexit``, before MPI is finalised): every replica sends its events to replica 0 (one
``Gather`` of sizes and one ``Gatherv`` of JSON bytes, numbered and counted as
``timeline_gather`` and ``timeline_gatherv`` by :func:`popdist_lite.calls.numbered`, so
the stall inspector names a replica that does not join them: no shared file system
needed), and replica 0 writes the file (:func:`write`, atomically); a job that aborts
(an uncaught exception on any rank) then writes no timeline.

The file is a JSON object whose ``traceEvents`` hold, per replica ``k``, a
``process_name`` metadata event ("replica k"), a ``process_labels`` one (the host the
replica ran on, ``socket.gethostname()``), ``"ph": "X"`` events with ``pid = tid = k``,
``ts``/``dur`` in microseconds and ``cat`` = ``"collective"`` or ``"phase"`` (``args =
{"bytes_sent", "bytes_received"[, "table"]}``), ``"step"`` (named ``step N``, ``args =
{"step": N}``) or ``"span"`` (a user span; one from a thread other than the main
thread is on a track of its own, named after the thread), and ``"ph": "C"`` counter
events (``cat`` ``"counter"``, ``args`` the series' values: a disk table's cache
counters after each lookup and update, :func:`popdist_lite.counters.sample`).
Timestamps come from each process's wall clock, anchored once at start-up and advanced
with ``perf_counter``, and are shifted so that the earliest event is at 0.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import tempfile
import threading
import time
from time import perf_counter

import numpy as np

from . import counters, records
from .calls import numbered

ENV = "POPDIST_LITE_TIMELINE"
_state: dict = {"path": None, "anchor": None, "replica": 0}
# The open step: [number, start] (perf_counter), or None.
_step: list = [None]


def enabled() -> bool:
    """True when this process records a timeline."""
    return counters.events is not None


#: Seconds between two sends of a rank's new events to poprun-lite (:func:`_stream`).
STREAM_SECONDS = 0.5
_delivery = threading.Lock()  # one drain and send at a time: the stream's or the exit's
#: Bytes of JSON per ``timeline`` record, about, at most (records' lines are bounded).
RECORD_BYTES = 256 * 1024


def enable(path: str, replica: int, comm) -> None:
    """Start recording. Under poprun-lite (the rank has an agent), send the events to
    the launcher as they are recorded (:func:`_stream`), which writes ``path``; else, at
    exit, gather every replica's events on ``comm`` and have replica 0 write them to
    ``path``. Called by :func:`popdist_lite.init` when ``POPDIST_LITE_TIMELINE`` is set;
    collective only at exit, without poprun-lite."""
    if counters.events is not None:
        return
    _state.update(path=os.path.abspath(path), anchor=(time.time() * 1e6, time.perf_counter()),
                  replica=int(replica))
    counters.events = []
    if os.environ.get(records.RECORD_FD_ENV) and os.environ.get(records.COLLECTOR_ENV):
        _state["streaming"] = True
        stop = threading.Event()
        threading.Thread(target=_stream, args=(stop,), name="popdist-lite timeline", daemon=True).start()
        atexit.register(_send_at_exit, stop)
    else:
        atexit.register(_write_at_exit, comm)


# ----------------------------------------------------------------------- the user's part

def _thread() -> dict | None:
    thread = threading.current_thread()
    return None if thread is threading.main_thread() else {"thread": thread.name}


class span(contextlib.ContextDecorator):
    """Time a block or a function on this replica's timeline track::

        with pl.timeline.span("data"):
            batch = next(feed)

        @pl.timeline.span("forward")
        def forward(params, x): ...

    The span is a ``"ph": "X"`` event of category ``"span"`` named ``name``, from entry
    to exit (also when the block raises); collectives and embedding phases inside it nest
    under it. Nothing is recorded when the timeline is off. Any thread may open spans; a
    thread other than the main one has its own track.

    Args:
        name: what the span shows (a ``str``).

    Raises:
        TypeError: ``name`` is not a ``str``.
    """

    __slots__ = ("name", "_start")

    def __init__(self, name: str):
        if not isinstance(name, str):
            raise TypeError(f"timeline.span: argument name: expected a str, got {type(name).__name__}")
        self.name = name
        self._start = None

    def _recreate_cm(self):  # a decorated function: a fresh span per call (recursion, threads)
        return span(self.name)

    def __enter__(self) -> "span":
        self._start = perf_counter() if counters.events is not None else None
        return self

    def __exit__(self, *exc) -> bool:
        events, start = counters.events, self._start
        if events is not None and start is not None:
            events.append((self.name, counters.SPAN, start, perf_counter() - start, 0, 0, _thread()))
        return False


class _Step:
    """What :func:`step` returns: ``with`` ends the step at the end of the block."""

    __slots__ = ("number",)

    def __init__(self, number: int):
        self.number = number

    def __enter__(self) -> "_Step":
        return self

    def __exit__(self, *exc) -> bool:
        if _step[0] is not None and _step[0][0] == self.number:
            _close_step(perf_counter())
        return False


def _close_step(end: float) -> None:
    number, start = _step[0]
    _step[0] = None
    if counters.events is not None:
        counters.events.append((f"step {number}", counters.STEP, start, end - start, 0, 0, {"step": number}))


def step(number: int) -> _Step:
    """Mark the start of training step ``number`` on this replica's track (main thread).

    Called at the top of each iteration, as ``torch.profiler``'s ``prof.step()``: the
    step lasts until the next call (or, for the last one, until the end of the last
    event recorded in it), drawn as a ``"ph": "X"`` event of category ``"step"`` named
    ``step N``. ``with pl.timeline.step(n):`` ends it with the block instead. Nothing is
    recorded when the timeline is off.

    Args:
        number: the step's number (an ``int``, e.g. the loop's counter).

    Returns:
        a context manager that ends the step on exit (ignore it for the first form).

    Raises:
        TypeError: ``number`` is not an integer.
    """
    if isinstance(number, bool) or not isinstance(number, (int, np.integer)):
        raise TypeError(f"timeline.step: argument number: expected an int, got {type(number).__name__}")
    now = perf_counter()
    if _step[0] is not None:
        _close_step(now)
    _step[0] = [int(number), now]
    return _Step(int(number))


# ----------------------------------------------------------------------- conversion

def metadata_events(replica: int) -> list[dict]:
    """The metadata naming replica ``replica``'s track ("replica k") and labelling it
    with this host's name."""
    return [{"name": "process_name", "ph": "M", "pid": replica, "tid": replica,
             "args": {"name": f"replica {replica}"}},
            {"name": "process_labels", "ph": "M", "pid": replica, "tid": replica,
             "args": {"labels": socket.gethostname()}},
            {"name": "thread_name", "ph": "M", "pid": replica, "tid": replica,
             "args": {"name": f"replica {replica}"}}]


def chrome_events(events, replica: int, anchor: tuple[float, float], metadata: bool = True) -> list[dict]:
    """Chrome-trace events (one track, ``pid = tid = replica``, labelled with this host's
    name unless ``metadata`` is False; a user span from another thread on a track of that
    thread's) from recorded events (:mod:`popdist_lite.counters`' layout), ``anchor``
    being ``(wall-clock microseconds, perf_counter())`` of one instant."""
    wall0, pc0 = anchor
    out = metadata_events(replica) if metadata else []
    threads: dict[str, int] = {}
    for name, kind, start, seconds, sent, received, detail in events:
        ts = wall0 + (start - pc0) * 1e6
        if kind == counters.COUNTER:  # detail: the series' values (counters.sample)
            out.append({"name": name, "cat": kind, "ph": "C", "pid": replica, "tid": replica, "ts": ts,
                        "args": detail})
            continue
        tid = replica
        if kind in (counters.SPAN, counters.STEP):
            args = dict(detail or {})
            thread = args.get("thread")
            if thread is not None:
                tid = threads.get(thread)
                if tid is None:  # a track of the thread's own, after the replicas' numbers
                    tid = threads[thread] = (1 + len(threads)) * 100_000 + replica
                    out.append({"name": "thread_name", "ph": "M", "pid": replica, "tid": tid,
                                "args": {"name": f"replica {replica}: {thread}"}})
        else:
            args = {"bytes_sent": sent, "bytes_received": received}
            if detail:
                args["table"] = detail
        out.append({"name": name, "cat": kind, "ph": "X", "pid": replica, "tid": tid, "ts": ts,
                    "dur": seconds * 1e6, "args": args})
    return out


def drain(final: bool = False) -> list[dict]:
    """This replica's Chrome-trace events recorded since the last drain (without the
    metadata: :func:`metadata_events`), removed from the record; empty when the timeline
    is off. ``final``: also end an open :func:`step` at the end of the last event
    recorded in it (the end of recording)."""
    events = counters.events
    if events is None:
        return []
    if final and _step[0] is not None:
        start = _step[0][1]
        _close_step(max([start] + [e[2] + e[3] for e in events if e[2] >= start]))
    taken = events[:]
    del events[:len(taken)]
    return chrome_events(taken, _state["replica"], _state["anchor"], metadata=False)


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


# ----------------------------------------------------------------------- delivery

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


def _send(events: list[dict], timeout: float = 0.0) -> None:
    """Send ``events`` to this rank's agent as ``timeline`` records of at most
    :data:`records.MAX_TIMELINE_EVENTS <popdist_lite.records.MAX_TIMELINE_EVENTS>` events
    and about :data:`RECORD_BYTES` bytes each."""
    ident = records.identity(rank=None, replica=_state["replica"])
    part, size = [], 0
    for event in events:
        part.append(event)
        size += len(json.dumps(event))
        if len(part) == records.MAX_TIMELINE_EVENTS or size >= RECORD_BYTES:
            records.send(records.make("timeline", ident, events=part), timeout=timeout)
            part, size = [], 0
    if part:
        records.send(records.make("timeline", ident, events=part), timeout=timeout)


def _stream(stop: threading.Event) -> None:
    """Under poprun-lite: every :data:`STREAM_SECONDS`, send the events recorded since
    (so a job that fails or stalls leaves its timeline up to then: the launcher writes
    it); a daemon thread, until :func:`_send_at_exit`."""
    while not stop.wait(STREAM_SECONDS):
        with _delivery:
            if counters.events is None:
                return
            _send(drain())


def flush() -> None:
    """Under poprun-lite, send the events recorded so far at once, the open step ended,
    waiting until the agent has passed them on: called by the excepthook
    (:mod:`popdist_lite._excepthook`) before it aborts the job, so the launcher's
    timeline of a failed job ends at the failure. Nothing otherwise."""
    if not _state.get("streaming") or not _delivery.acquire(timeout=2.0):
        return
    try:
        if counters.events is not None:
            _send(drain(final=True), timeout=2.0)
    finally:
        _delivery.release()


def _send_at_exit(stop: threading.Event) -> None:
    """At exit under poprun-lite: the last events, the open step ended, waiting until the
    agent has passed them on."""
    stop.set()
    with _delivery:
        if counters.events is None:
            return
        events = drain(final=True)
        counters.events = None
        _send(events, timeout=5.0)


def _write_at_exit(comm) -> None:
    if counters.events is None:
        return
    mine = metadata_events(_state["replica"]) + drain(final=True)
    counters.events = None
    from mpi4py import MPI
    if MPI.Is_finalized():
        return
    mine = json.dumps(mine).encode()
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
