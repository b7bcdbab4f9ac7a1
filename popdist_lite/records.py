"""Records between a rank, its agent and the launcher: the one definition of their format.

A record is a JSON object with a ``"kind"`` field, sent as one line of UTF-8 JSON
(newline-delimited JSON). Records travel in two legs:

* **rank -> agent**, on the rank's own host: the poprun-lite agent gives its program a
  connected stream socket (a ``socketpair``) whose descriptor is in
  ``POPDIST_LITE_RECORD_FD``; :func:`send` writes a record there. The agent answers every
  line with one byte once it has passed the record on, so a rank that is about to abort
  the job (the excepthook) knows its record has left the host.
* **agent <-> launcher**, over the network: every agent opens ONE TCP connection to the
  launcher's collector, whose address is in ``POPRUN_LITE_COLLECTOR=host:port``. The agent
  sends ``hello`` first, then ``heartbeat`` every :data:`HEARTBEAT_SECONDS`, the rank's
  records as they come (and, for the stall inspector, ``progress`` whenever the rank
  enters another collective call), and ``exit`` last. The launcher may send requests the
  other way (``signal``, ``stack_request``).

Kinds (fields besides ``kind``):

``hello`` (agent -> launcher, first line)
    the identity fields below; ``pid`` is the program's.
``heartbeat`` (agent -> launcher)
    none.
``error`` (rank -> agent -> launcher; ``popdist_lite._excepthook`` on an uncaught exception)
    identity + ``exception`` (class name), ``message``, ``traceback`` (formatted text).
``exit`` (agent -> launcher, last line; sent for every end, success included)
    identity + ``exitcode`` (None when killed by a signal), ``signal`` (``"SIGKILL"`` or
    None), ``stderr_tail`` (last lines of the program's stderr), ``terminated`` (the agent
    had been told to stop: a consequence of another failure, not a cause).
``lost`` (made by the launcher's collector, never sent)
    identity + ``reason``; ``time`` is when the agent was last heard from; ``terminated``
    as for ``exit`` (the job was already failing or stopping when the loss was seen).
``signal`` (launcher -> agent)
    ``signal``: a signal name (``"SIGUSR1"``) the agent sends to its program.
``progress`` (agent -> launcher; only with ``POPRUN_LITE_STALL_INSPECTOR=1``)
    identity + ``call`` (the collective call number the rank last entered), ``op`` (its
    operation, e.g. ``"all_reduce"``), ``since`` (``time.time()`` when it entered it).
    The agent reads these from the rank's progress slot (:mod:`popdist_lite.progress`).
``stack_request`` (launcher -> agent)
    ``request``: an integer the answer repeats. The agent has its program dump the
    Python stack of every thread and answers with ``stack``.
``stack`` (agent -> launcher)
    identity + ``request`` and ``text`` (faulthandler's dump, "" if none came).

Identity fields: ``rank`` (MPI rank or None), ``replica`` (the replica driven, or fed by a
feeder), ``role`` (``"replica"`` or ``"feeder"``), ``feeder`` (a feeder's index, else
None), ``host`` (``socket.gethostname()``), ``pid``, ``time`` (``time.time()`` when the
event happened).

Only the standard library is used, so the launcher and the agents load this module
without starting MPI.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

#: The launcher's collector, ``host:port`` (set for every rank by poprun-lite).
COLLECTOR_ENV = "POPRUN_LITE_COLLECTOR"
#: File descriptor of the rank's stream socket to its agent (set by the agent).
RECORD_FD_ENV = "POPDIST_LITE_RECORD_FD"
#: Set to ``"1"`` by poprun-lite when its stall inspector is on: agents then record and
#: forward their rank's progress.
INSPECTOR_ENV = "POPRUN_LITE_STALL_INSPECTOR"
#: Seconds between an agent's heartbeats.
HEARTBEAT_SECONDS = 1.0
#: Variables holding the MPI rank, first set wins (Open MPI, MPICH/hydra, PMIx).
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")

IDENTITY_FIELDS = ("rank", "replica", "role", "feeder", "host", "pid", "time")
FIELDS = {
    "hello": IDENTITY_FIELDS,
    "heartbeat": (),
    "error": IDENTITY_FIELDS + ("exception", "message", "traceback"),
    "exit": IDENTITY_FIELDS + ("exitcode", "signal", "stderr_tail", "terminated"),
    "lost": IDENTITY_FIELDS + ("reason", "terminated"),
    "signal": ("signal",),
    "progress": IDENTITY_FIELDS + ("call", "op", "since"),
    "stack_request": ("request",),
    "stack": IDENTITY_FIELDS + ("request", "text"),
}
#: Kinds that describe how a rank failed (read by the launcher's failure report).
FAILURE_KINDS = ("error", "exit", "lost")


def env_rank(environ=None) -> int | None:
    """The MPI rank from the launcher-set variables (:data:`RANK_VARS`), or None."""
    environ = os.environ if environ is None else environ
    for name in RANK_VARS:
        value = environ.get(name, "")
        if value.isdigit():
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
        feeder = int(index) if index.isdigit() else None
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


def decode(line: bytes | str) -> dict:
    """The record in one line.

    Raises:
        ValueError: not a JSON object with a string ``"kind"``.
    """
    record = json.loads(line)
    if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
        raise ValueError(f"not a record (a JSON object with a 'kind'): {line!r:.200}")
    return record


class LineBuffer:
    """Split a byte stream into lines: ``feed(chunk)`` returns the complete lines."""

    def __init__(self, max_line: int = 1 << 24):
        self._partial = b""
        self._max = max_line

    def feed(self, chunk: bytes) -> list[bytes]:
        parts = (self._partial + chunk).split(b"\n")
        self._partial = parts.pop()
        if len(self._partial) > self._max:  # a runaway line: drop it rather than grow
            self._partial = b""
        return parts


# ---------------------------------------------------------------- rank side

_channel: dict = {"sock": None, "fd": None, "lock": threading.Lock(), "sent": 0, "acked": 0}


def _agent_socket():
    """This process's socket to its agent (from :data:`RECORD_FD_ENV`), or None."""
    value = os.environ.get(RECORD_FD_ENV, "")
    if not value.isdigit():
        return None
    if _channel["fd"] != value:
        try:
            _channel["sock"] = socket.socket(fileno=int(value))
        except OSError:
            _channel["sock"] = None
        _channel["fd"], _channel["sent"], _channel["acked"] = value, 0, 0
    return _channel["sock"]


def send(record: dict, timeout: float = 0.0) -> bool:
    """Send ``record`` to this rank's poprun-lite agent, which passes it to the launcher.

    With ``timeout`` > 0, wait up to that many seconds until the agent confirms it has
    passed the record on. Thread-safe; never raises for transport problems.

    Returns:
        True if sent (and, with a timeout, confirmed); False without an agent (not
        started by poprun-lite), when the agent is gone, or not confirmed in time.

    Raises:
        ValueError: ``record`` has no string ``"kind"``.
    """
    line = encode(record)
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
                _channel["acked"] += len(acks)
            return True
        except OSError:  # includes socket.timeout
            return False
