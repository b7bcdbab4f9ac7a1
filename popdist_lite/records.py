"""Records between a rank, its agent and the launcher: the one definition of their format.

A record is a JSON object with a ``"kind"`` field, sent as one line of UTF-8 JSON
(newline-delimited JSON, at most :data:`MAX_LINE_BYTES` per line). Records travel in two
legs:

* **rank -> agent**, on the rank's own host: the poprun-lite agent gives its program a
  connected stream socket (a ``socketpair``) whose descriptor is in
  ``POPDIST_LITE_RECORD_FD``; :func:`send` writes a record there. The agent answers every
  line with one byte once it has passed the record on, so a rank that is about to abort
  the job (the excepthook) knows its record has left the host. A program may send only
  ``error``, ``resize_stop`` and ``checkpoint_saved`` records (:data:`FROM_PROGRAM`); the agent replaces their
  identity fields with its own, so a program cannot speak for another rank. The other
  way, the socket carries single bytes: :data:`ACK` (one per line passed on) and
  :data:`RESIZE` (the launcher asked for a resize), which :func:`resize_requested` reads.
* **agent <-> launcher**, over the network: every agent opens ONE TCP connection to the
  launcher's collector, whose address is in ``POPRUN_LITE_COLLECTOR=host:port``. The
  connection is authenticated with the job's secret key and every line on it carries a
  sequence number and a MAC (the framing and the handshake are the launcher's
  ``channel`` module): the collector sends ``challenge``, the agent ``hello``, the
  collector ``welcome``. The agent then sends ``heartbeat`` every
  :data:`HEARTBEAT_SECONDS`, its rank's records as they come (and, for the stall
  inspector, ``progress`` whenever the rank enters another collective call), and
  ``exit`` last (:data:`FROM_AGENT`). The launcher may send requests the other way
  (:data:`TO_AGENT`: ``signal``, ``stack_request``, ``resize_request``).

Every record that crosses a process boundary is checked against :data:`SCHEMA` (its
kind's fields, exactly, with their types; strings bounded) by :func:`decode`; the
receiver drops what does not match. Kinds (fields besides ``kind``):

``challenge`` (launcher -> agent, first line, not authenticated)
    ``nonce``: 32 random bytes in hex.
``hello`` (agent -> launcher, first line)
    the identity fields below (``pid`` is the program's) and ``nonce``, the agent's own
    32 random bytes in hex.
``welcome`` (launcher -> agent, answering a valid ``hello``)
    none.
``heartbeat`` (agent -> launcher)
    none.
``error`` (rank -> agent -> launcher; ``popdist_lite._excepthook`` on an uncaught exception)
    identity + ``exception`` (class name), ``message``, ``traceback`` (formatted text).
``exit`` (agent -> launcher, last line; sent for every end, success included)
    identity + ``exitcode`` (None when killed by a signal), ``signal`` (``"SIGKILL"`` or
    None), ``stderr_tail`` (last lines of the program's stderr), ``terminated`` (the agent
    had been told to stop: a consequence of another failure, not a cause).
``lost`` (made by the launcher's collector, never accepted from a connection)
    identity + ``reason``; ``time`` is when the agent was last heard from; ``terminated``
    as for ``exit`` (the job was already failing or stopping when the loss was seen).
``signal`` (launcher -> agent)
    ``signal``: one of :data:`REQUEST_SIGNALS`, which the agent sends to its program.
``progress`` (agent -> launcher; only with ``POPRUN_LITE_STALL_INSPECTOR=1``)
    identity + ``lane`` (the sequence of calls: ``"main"``, or a communicator's own such
    as ``"jax"``; a :data:`popdist_lite.progress.LANE_NAME`), ``call`` (the collective
    call number the rank last entered on that lane), ``op`` (its operation, e.g.
    ``"all_reduce"``), ``since`` (``time.time()`` when it entered it), and, once the
    rank has a disk-backed table, ``storage`` (optional: the sums over its disk tables
    of :data:`popdist_lite.progress.STORAGE_FIELDS`, counts and ``wait_seconds``). The
    agent reads these from the rank's progress slot (:mod:`popdist_lite.progress`).
``stack_request`` (launcher -> agent)
    ``request``: an integer the answer repeats. The agent has its program dump the
    Python stack of every thread and answers with ``stack``.
``stack`` (agent -> launcher)
    identity + ``request`` and ``text`` (faulthandler's dump, "" if none came).
``resize_request`` (launcher -> agent; elastic jobs, docs/elastic.md, and the
    scheduler's signals, docs/slurm.md)
    ``replicas``: the size the launcher will give the next attempt (after a signal: the
    attempt's own size, the job ends there). The agent passes it
    to its program as one :data:`RESIZE` byte; the program's
    :func:`popdist_lite.should_checkpoint` then answers True on every replica at the same
    step, and the program saves a checkpoint and exits.
``resize_stop`` (rank -> agent -> launcher)
    identity only: the replicas agreed to stop at this step boundary for the resize or
    the signal (sent by :func:`popdist_lite.should_checkpoint` when it first answers
    True), so the attempt's clean end is a resize or a preemption, not the end of the
    job's work.
``checkpoint_saved`` (rank -> agent -> launcher)
    identity + ``step``: this replica's part of checkpoint ``step`` is committed, in a
    save that began after :func:`popdist_lite.should_checkpoint` answered True (sent by
    :func:`popdist_lite.save_checkpoint`); the launcher says a preempted job's checkpoint
    was saved only when every replica sent one.
``timeline`` (rank -> agent -> launcher; with ``--timeline``)
    identity + ``events``: at most :data:`MAX_TIMELINE_EVENTS` of the rank's
    Chrome-trace events since its last such record (:func:`popdist_lite.timeline.drain`),
    sent as they are recorded, so that the launcher writes the timeline of a job that
    failed or stalled too (launcher/supervise/timeline.py).
``signalled`` (agent -> launcher; preemption, launcher/node/hold_signals.py)
    identity + ``signal`` (a signal's name, e.g. ``"SIGTERM"``, ``"SIGUSR1"``) and
    ``sender`` (the pid that sent it, None when the kernel did): the agent got that held
    signal from another process than its parent (Slurm signalling the job's steps, or
    any process of the job's user); the launcher counts it with the other copies of the same signal and
    decides (launcher/slurm/preempt.py), ignoring a signal it does not hold.

Identity fields: ``rank`` (MPI rank or None), ``replica`` (the replica driven, or fed by a
feeder), ``role`` (``"replica"`` or ``"feeder"``), ``feeder`` (a feeder's index, else
None), ``host`` (``socket.gethostname()``), ``pid``, ``time`` (``time.time()`` when the
event happened).

Only the standard library is used, so the launcher and the agents load this module
without starting MPI.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time

from .progress import LANE_NAME, STORAGE_FIELDS

#: The launcher's collector, ``host:port`` (set for every rank by poprun-lite).
COLLECTOR_ENV = "POPRUN_LITE_COLLECTOR"
#: File descriptor of the rank's stream socket to its agent (set by the agent).
RECORD_FD_ENV = "POPDIST_LITE_RECORD_FD"
#: Set to ``"1"`` by poprun-lite when its stall inspector is on: agents then record and
#: forward their rank's progress.
INSPECTOR_ENV = "POPRUN_LITE_STALL_INSPECTOR"
#: The signals the job's processes hold while preemption is on, comma-separated names
#: (set by poprun-lite, read by its agents and by :func:`popdist_lite.held_signals.hold_signals`;
#: launcher/node/hold_signals.py).
HOLD_ENV = "POPRUN_LITE_HOLD_SIGNALS"
#: Seconds between an agent's heartbeats.
HEARTBEAT_SECONDS = 1.0
#: Variables holding the MPI rank, first set wins (Open MPI, MPICH/hydra, PMIx).
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")

#: Longest line (bytes, newline excluded) a reader accepts; longer lines are dropped.
MAX_LINE_BYTES = 1 << 20
#: Longest short string (names: host, exception class, operation, signal, role).
MAX_NAME_CHARS = 255
#: Longest ``message`` / ``reason``.
MAX_MESSAGE_CHARS = 8192
#: Longest multi-line text (``traceback``, ``stderr_tail``, a stack dump). Even escaped
#: as ``\uXXXX`` pairs, one record with its longest text and message stays below
#: :data:`MAX_LINE_BYTES`.
MAX_TEXT_CHARS = 65536
#: Signals the launcher may ask an agent to send to its program.
REQUEST_SIGNALS = ("SIGINT", "SIGTERM", "SIGKILL", "SIGUSR1", "SIGUSR2")

IDENTITY = {"rank": "count?", "replica": "count", "role": "name", "feeder": "count?",
            "host": "name", "pid": "count?", "time": "number"}
#: Every kind's fields (all required, no others) and their types: ``count`` an int >= 0,
#: ``number`` a finite int or float, ``flag`` a bool, ``name`` / ``message`` / ``text``
#: strings of at most :data:`MAX_NAME_CHARS` / :data:`MAX_MESSAGE_CHARS` /
#: :data:`MAX_TEXT_CHARS` characters, ``nonce`` 64 lowercase hex digits, ``signal`` one of
#: :data:`REQUEST_SIGNALS`, ``lane`` a :data:`popdist_lite.progress.LANE_NAME` (at most 16
#: characters); a ``?`` also allows None (JSON null).
SCHEMA = {
    "challenge": {"nonce": "nonce"},
    "hello": {**IDENTITY, "nonce": "nonce"},
    "welcome": {},
    "heartbeat": {},
    "error": {**IDENTITY, "exception": "name", "message": "message", "traceback": "text"},
    "exit": {**IDENTITY, "exitcode": "count?", "signal": "name?", "stderr_tail": "text",
             "terminated": "flag"},
    "lost": {**IDENTITY, "reason": "message", "terminated": "flag"},
    "signal": {"signal": "signal"},
    "progress": {**IDENTITY, "lane": "lane", "call": "count", "op": "name", "since": "number"},
    "stack_request": {"request": "count"},
    "stack": {**IDENTITY, "request": "count", "text": "text"},
    "resize_request": {"replicas": "count"},
    "resize_stop": {**IDENTITY},
    "checkpoint_saved": {**IDENTITY, "step": "count"},
    "signalled": {**IDENTITY, "signal": "name", "sender": "count?"},
    "timeline": {**IDENTITY, "events": "events"},
}
#: Fields a kind may carry besides those of :data:`SCHEMA` (absent, or of this type):
#: ``storage`` a dict of exactly :data:`popdist_lite.progress.STORAGE_FIELDS`, counts and
#: a finite ``wait_seconds`` >= 0.
OPTIONAL = {"progress": {"storage": "storage"}}
IDENTITY_FIELDS = tuple(IDENTITY)
FIELDS = {kind: tuple(fields) + tuple(OPTIONAL.get(kind, ())) for kind, fields in SCHEMA.items()}
#: Kinds an agent may send the launcher after its ``hello``.
FROM_AGENT = ("heartbeat", "error", "exit", "progress", "stack", "resize_stop", "checkpoint_saved", "signalled",
              "timeline")
#: Kinds the launcher may send an agent after its ``welcome`` (requests).
TO_AGENT = ("signal", "stack_request", "resize_request")
#: Kinds a program may send its agent.
FROM_PROGRAM = ("error", "resize_stop", "checkpoint_saved", "timeline")
#: The bytes an agent writes to its program's socket: one ``ACK`` per line it passed on,
#: ``RESIZE`` when the launcher asked for a resize (``resize_request``).
ACK, RESIZE = b"\x06", b"\x05"
#: Kinds that describe how a rank failed (read by the launcher's failure report).
FAILURE_KINDS = ("error", "exit", "lost")

_LIMITS = {"name": MAX_NAME_CHARS, "message": MAX_MESSAGE_CHARS, "text": MAX_TEXT_CHARS}
_HEX = frozenset("0123456789abcdef")


def _is_count(value) -> bool:
    return type(value) is int and 0 <= value < 1 << 63


def _is_text(value, limit: int) -> bool:
    if type(value) is not str or len(value) > limit:
        return False
    try:
        value.encode("utf-8")  # no lone surrogates: every string can be printed
    except UnicodeEncodeError:
        return False
    return True


def _conforms(value, kind: str) -> bool:
    """Does ``value`` have the schema type ``kind`` (see :data:`SCHEMA`)?"""
    if kind.endswith("?"):
        return value is None or _conforms(value, kind[:-1])
    if kind == "count":
        return _is_count(value)
    if kind == "number":
        return type(value) in (int, float) and math.isfinite(value)
    if kind == "flag":
        return type(value) is bool
    if kind == "nonce":
        return type(value) is str and len(value) == 64 and _HEX.issuperset(value)
    if kind == "signal":
        return type(value) is str and value in REQUEST_SIGNALS
    if kind == "lane":
        return type(value) is str and LANE_NAME.fullmatch(value) is not None
    if kind == "events":
        return type(value) is list and len(value) <= MAX_TIMELINE_EVENTS and all(map(_is_trace_event, value))
    if kind == "storage":
        return (type(value) is dict and len(value) == len(STORAGE_FIELDS) and set(value) == set(STORAGE_FIELDS)
                and all(_is_count(value[name]) for name in STORAGE_FIELDS[:-1])
                and _conforms(value["wait_seconds"], "number") and value["wait_seconds"] >= 0)
    return _is_text(value, _LIMITS[kind])


#: Chrome-trace events in one ``timeline`` record, at most.
MAX_TIMELINE_EVENTS = 2000
#: Categories of the timeline's events (:mod:`popdist_lite.timeline`).
TRACE_CATEGORIES = ("collective", "phase", "counter", "span", "step")
_TRACE_NUMBERS = ("pid", "tid")


def _is_trace_event(event) -> bool:
    """One Chrome-trace event as :func:`popdist_lite.timeline.chrome_events` makes them:
    ``"X"`` (``name``, ``cat``, ``pid``, ``tid``, ``ts``, ``dur`` >= 0, ``args``), ``"C"``
    (the same without ``dur``) or a thread track's ``"M"`` ``thread_name``; ``args`` at
    most 16 entries of short names to finite numbers, short strings or None."""
    if type(event) is not dict:
        return False
    ph = event.get("ph")
    if ph == "M":
        return (set(event) == {"name", "ph", "pid", "tid", "args"} and event["name"] == "thread_name"
                and all(_is_count(event[k]) for k in _TRACE_NUMBERS) and type(event["args"]) is dict
                and set(event["args"]) == {"name"} and _is_text(event["args"]["name"], MAX_NAME_CHARS))
    fields = {"name", "cat", "ph", "pid", "tid", "ts", "args"} | ({"dur"} if ph == "X" else set())
    if ph not in ("X", "C") or set(event) != fields:
        return False
    if not (_is_text(event["name"], MAX_NAME_CHARS) and event["cat"] in TRACE_CATEGORIES
            and all(_is_count(event[k]) for k in _TRACE_NUMBERS) and _conforms(event["ts"], "number")):
        return False
    if ph == "X" and not (_conforms(event["dur"], "number") and event["dur"] >= 0):
        return False
    args = event["args"]
    return type(args) is dict and len(args) <= 16 and all(
        _is_text(k, MAX_NAME_CHARS) and (v is None or _conforms(v, "number") or _is_text(v, MAX_NAME_CHARS))
        for k, v in args.items())


def validate(record, kinds=None) -> dict:
    """``record`` itself if it is a record of one of ``kinds`` (any kind if None) whose
    fields are exactly those of its kind in :data:`SCHEMA`, with their types. A kind not
    in :data:`SCHEMA` passes only when ``kinds`` is None (nothing is checked then).

    Raises:
        ValueError: naming the kind and field at fault, never echoing the content.
    """
    if not isinstance(record, dict) or type(record.get("kind")) is not str:
        raise ValueError("not a record (a JSON object with a string 'kind')")
    kind = record["kind"]
    schema = SCHEMA.get(kind)
    if kinds is not None and (schema is None or kind not in kinds):
        raise ValueError(f"a record of a kind not accepted here "
                         f"(expected one of {', '.join(kinds)})")
    if schema is None:
        return record
    missing = [name for name in schema if name not in record]
    if missing:
        raise ValueError(f"{kind} record without field(s) {', '.join(missing)}")
    optional = {name: t for name, t in OPTIONAL.get(kind, {}).items() if name in record}
    if len(record) != len(schema) + len(optional) + 1:
        raise ValueError(f"{kind} record with {len(record) - len(schema) - len(optional) - 1} unknown field(s)")
    for name, expected in {**schema, **optional}.items():
        if not _conforms(record[name], expected):
            raise ValueError(f"{kind} record: field {name!r} is not {expected} "
                             f"(got {type(record[name]).__name__})")
    return record


def fit(record: dict) -> dict:
    """``record`` with its string fields cut to their schema limits (a ``text`` keeps its
    end, where a traceback or an output's last lines are; other strings their start), so
    that what an agent reports always passes :func:`validate`. Kinds not in
    :data:`SCHEMA` are returned unchanged."""
    kind = record.get("kind")
    schema = SCHEMA.get(kind, {}) if isinstance(kind, str) else {}
    out = dict(record)
    for name, expected in schema.items():
        value = out.get(name)
        limit = _LIMITS.get(expected.rstrip("?"))
        if isinstance(value, str) and limit is not None:
            value = value.encode("utf-8", "replace").decode("utf-8")  # lone surrogates -> "?"
            if len(value) > limit:
                value = value[-limit:] if expected.startswith("text") else value[:limit]
            out[name] = value
    return out


def env_rank(environ=None) -> int | None:
    """The MPI rank from the launcher-set variables (:data:`RANK_VARS`), or None."""
    environ = os.environ if environ is None else environ
    for name in RANK_VARS:
        value = environ.get(name, "")
        if value.isdecimal():
            return int(value)
    return None


def env_identity(environ=None, pid: int | None = None) -> dict:
    """Identity fields of the rank described by poprun-lite's variables in ``environ``
    (``POPDIST_REPLICA_INDEX_OFFSET``, ``POPDIST_LITE_ROLE``, ``POPDIST_LITE_FEEDER_OF``,
    ``POPDIST_LITE_FEEDER_INDEX``, the rank variables); ``time`` is now."""
    environ = os.environ if environ is None else environ
    role = environ.get("POPDIST_LITE_ROLE") or "replica"
    replica = int(environ.get("POPDIST_REPLICA_INDEX_OFFSET") or 0)
    feeder = None
    if role == "feeder":
        replica = int(environ.get("POPDIST_LITE_FEEDER_OF") or replica)
        index = environ.get("POPDIST_LITE_FEEDER_INDEX", "")
        feeder = int(index) if index.isdecimal() else None
    return identity(rank=env_rank(environ), replica=replica, role=role, feeder=feeder, pid=pid)


def identity(*, rank: int | None, replica: int, role: str = "replica",
             feeder: int | None = None, pid: int | None = None, host: str | None = None,
             at: float | None = None) -> dict:
    """The identity fields (host defaults to this host, ``time`` to now)."""
    return {"rank": rank, "replica": int(replica), "role": role, "feeder": feeder,
            "host": host or socket.gethostname(), "pid": pid,
            "time": time.time() if at is None else at}


def make(kind: str, ident: dict | None = None, **fields) -> dict:
    """A record of ``kind``: the identity fields of ``ident`` (if given) plus ``fields``.

    Raises:
        ValueError: unknown field for a known kind (a typo would silently break the report).
    """
    known = FIELDS.get(kind)
    if known is not None:
        unknown = set(fields) - set(known)
        if unknown:
            raise ValueError(f"record kind {kind!r} has no field(s) {sorted(unknown)}; "
                             f"expected {list(known)}")
    return {"kind": kind, **(ident or {}), **fields}


def encode(record: dict) -> bytes:
    """One line of JSON (ending in ``\\n``).

    Raises:
        ValueError: ``record`` has no string ``"kind"``.
    """
    if not isinstance(record.get("kind"), str):
        raise ValueError(f"a record needs a string 'kind', got {record!r:.200}")
    return json.dumps(record, separators=(",", ":"), default=str).encode("utf-8") + b"\n"


def decode(line: bytes | str, kinds=None) -> dict:
    """The record in one line, checked by :func:`validate` (with ``kinds``).

    Raises:
        ValueError: longer than :data:`MAX_LINE_BYTES`, not UTF-8 JSON, not a record, or
            not a valid record of one of ``kinds`` (never echoing the line).
    """
    if len(line) > MAX_LINE_BYTES:
        raise ValueError(f"a line longer than {MAX_LINE_BYTES} bytes")
    try:
        record = json.loads(line)
    except RecursionError:  # deeply nested arrays: the parser's recursion limit
        raise ValueError("JSON nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, int too long
        raise ValueError(f"not JSON ({type(exc).__name__})") from None
    return validate(record, kinds)


class LineBuffer:
    """Split a byte stream into lines: ``feed(chunk)`` returns the complete lines.

    Linear time: each byte is searched for a newline once and copied once (the pieces
    of a partial line are kept in a list and joined when its newline comes). A line
    longer than ``max_line`` bytes is dropped up to its newline and counted in
    :attr:`overlong`; nothing of it is kept beyond ``max_line`` bytes.
    """

    def __init__(self, max_line: int = MAX_LINE_BYTES):
        self.max_line = max_line
        self.overlong = 0
        self._pieces: list[bytes] = []
        self._size = 0
        self._skipping = False  # inside an over-long line, until its newline

    def feed(self, chunk: bytes) -> list[bytes]:
        lines = []
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            piece = chunk[start:end]
            if self._skipping:
                self._skipping = False
            elif self._size + len(piece) > self.max_line:
                self.overlong += 1
            else:
                lines.append(b"".join((*self._pieces, piece)) if self._pieces else piece)
            self._pieces, self._size = [], 0
            start = end + 1
        rest = chunk[start:]
        if rest and not self._skipping:
            if self._size + len(rest) > self.max_line:
                self.overlong += 1
                self._skipping = True
                self._pieces, self._size = [], 0
            else:
                self._pieces.append(rest)
                self._size += len(rest)
        return lines

    @property
    def pending(self) -> int:
        """Bytes of the partial line kept so far."""
        return self._size


# ---------------------------------------------------------------- rank side

_channel: dict = {"sock": None, "fd": None, "lock": threading.Lock(), "sent": 0, "acked": 0,
                  "resize": False}


def _agent_socket():
    """This process's socket to its agent (from :data:`RECORD_FD_ENV`), or None."""
    value = os.environ.get(RECORD_FD_ENV, "")
    if not value.isdecimal():
        return None
    if _channel["fd"] != value:
        try:
            _channel["sock"] = socket.socket(fileno=int(value))
        except OSError:
            _channel["sock"] = None
        _channel["fd"], _channel["sent"], _channel["acked"] = value, 0, 0
    return _channel["sock"]


def _absorb(data: bytes) -> None:
    """Take in bytes the agent wrote: acknowledgements and the resize request (any other
    byte is ignored)."""
    _channel["acked"] += data.count(ACK)
    if RESIZE in data:
        _channel["resize"] = True


def send(record: dict, timeout: float = 0.0) -> bool:
    """Send ``record`` to this rank's poprun-lite agent, which passes it to the launcher.

    With ``timeout`` > 0, wait up to that many seconds until the agent confirms it has
    passed the record on. Thread-safe; never raises for transport problems.

    Returns:
        True if sent (and, with a timeout, confirmed); False without an agent (not
        started by poprun-lite), when the agent is gone, or not confirmed in time.

    String fields longer than the schema allows are cut (:func:`fit`), so the record
    still reaches the launcher.

    Raises:
        ValueError: ``record`` has no string ``"kind"``.
    """
    line = encode(fit(record))
    with _channel["lock"]:
        sock = _agent_socket()
        if sock is None:
            return False
        try:
            sock.settimeout(None)
            sock.sendall(line)
            _channel["sent"] += 1
            deadline = time.monotonic() + timeout
            while _channel["acked"] < _channel["sent"]:
                left = deadline - time.monotonic()
                if left > 0:
                    sock.settimeout(left)
                    acks = sock.recv(4096)
                else:  # collect acknowledgements already there, without waiting
                    sock.setblocking(False)
                    try:
                        acks = sock.recv(4096)
                    except BlockingIOError:
                        return timeout <= 0
                if not acks:
                    return False
                _absorb(acks)
            return True
        except OSError:  # includes socket.timeout
            return False


def resize_requested() -> bool:
    """Whether this rank's agent has passed on a ``resize_request`` from the launcher
    (once True, True for the rest of the process). Reads what the agent wrote without
    waiting; False without an agent. Local to this rank: replicas agree on it with
    :func:`popdist_lite.should_checkpoint`."""
    with _channel["lock"]:
        sock = _agent_socket()
        if sock is None or _channel["resize"]:
            return _channel["resize"]
        try:
            sock.setblocking(False)
            while data := sock.recv(4096):
                _absorb(data)
        except OSError:  # BlockingIOError: nothing more for now; others: the agent is gone
            pass
        return _channel["resize"]
