"""The job's timeline, as the ranks send it: checked, kept, and written at the job's end.

Under poprun-lite each rank sends its timeline events as it records them
(:func:`popdist_lite.timeline._stream`: ``timeline`` records through its agent, checked
against :data:`popdist_lite.records.SCHEMA` on the way), and the launcher writes the one
file at the end of the job, however it ended: a job that failed, stalled or was stopped
leaves the events its ranks sent until then, and the report says so (``timeline
(partial: the job failed) PATH``). Nothing crosses hosts but the agents' connections, so
no shared filesystem is needed, and the file is on the launcher's host, where
``--timeline`` named it.

What a record says is believed only as far as it can be checked: its events land on the
track of the replica its agent enrolled as (``pid`` is set to it, a ``tid`` that is not
that replica's is moved onto its main track), the track is labelled with the host its
agent named, feeders' records are ignored, and the launcher keeps at most
:data:`MAX_BYTES` of events (what comes beyond is counted, and the report's line says
how many were left out).
"""

from __future__ import annotations

import json
import threading

from popdist_lite import timeline as _library

#: Bytes of events (as JSON) kept for the job at most.
MAX_BYTES = 128 * 1024 * 1024
#: Thread tracks are numbered ``k * TRACK_STRIDE + replica`` (popdist_lite.timeline).
TRACK_STRIDE = 100_000


class Timeline:
    """The events the ranks sent, by replica (a collector's subscriber: :meth:`on_record`)."""

    def __init__(self, max_bytes: int = MAX_BYTES):
        self.max_bytes = max_bytes
        self.events: list[str] = []
        self.size = 0
        self.left_out = 0
        self.hosts: dict[int, str] = {}
        self.lock = threading.Lock()

    def on_record(self, record: dict) -> None:
        """A ``timeline`` record the collector accepted (schema checked, identity the
        agent's): its events onto its replica's track, within :data:`MAX_BYTES`."""
        if record.get("role") != "replica":
            return
        replica = record["replica"]
        with self.lock:
            self.hosts.setdefault(replica, record["host"])
            for event in record["events"]:
                tid = event["tid"]
                if tid != replica and (tid < TRACK_STRIDE or tid % TRACK_STRIDE != replica):
                    tid = replica
                text = json.dumps({**event, "pid": replica, "tid": tid})
                if self.size + len(text) > self.max_bytes:
                    self.left_out += 1
                    continue
                self.events.append(text)
                self.size += len(text)

    def trace(self) -> dict:
        """The Chrome trace (:func:`popdist_lite.timeline.merge`), each replica's track
        named and labelled with its host."""
        with self.lock:
            parts = []
            for replica, host in sorted(self.hosts.items()):
                meta = _library.metadata_events(replica)
                meta[1]["args"]["labels"] = host
                parts.append(meta)
            parts.append([json.loads(text) for text in self.events])
        return _library.merge(parts) | {"otherData": {
            "producer": "popdist-lite", "replicas": len(self.hosts), "left_out": self.left_out}}

    def deliver(self, path: str, partial: str | None = None) -> str:
        """Write the file at ``path`` (atomically, :func:`popdist_lite.timeline.write`)
        and return the line saying where: ``timeline written to PATH``, or ``timeline
        (partial: PARTIAL) PATH`` for a job that did not end well; ``timeline not
        written ...`` when no rank sent any event or the file cannot be written."""
        if not self.hosts:
            return f"timeline not written (no replica sent events: did the program call popdist_lite.init()?): {path}"
        try:
            _library.write(path, self.trace())
        except OSError as exc:
            return f"timeline not written: {path}: {exc.strerror or exc}"
        left_out = f", {self.left_out} events left out beyond {self.max_bytes >> 20} MiB" if self.left_out else ""
        if partial:
            return f"timeline (partial: {partial}{left_out}) {path}"
        return f"timeline written to {path}" + (f" ({left_out[2:]})" if left_out else "")


#: The timeline of the job this launcher runs.
TRACE = Timeline()
