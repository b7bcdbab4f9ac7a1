"""The launcher's collector: a TCP server receiving the records of every rank's agent.

The launcher starts a :class:`Collector` before mpirun and gives every rank its address
(``POPRUN_LITE_COLLECTOR=host:port``, in the environment) and the job's key (in a key
file of its own, :mod:`popdist_lite_launcher.node.keys`). Each agent opens one
connection, authenticates with the key (:mod:`popdist_lite_launcher.core.channel`: challenge,
hello, welcome; a job's collector takes each rank's hello once and holds the welcomes
until every rank has enrolled, ``enrolment``) and sends framed records (format: :mod:`popdist_lite.records`). Anyone
else who reaches the port (a local user, a host on the job's network) is a stranger:
the collector never raises for what a connection sends, believes nothing before the
handshake, and drops and counts what is not a valid frame and record
(:meth:`Collector.ignored`). The collector

* stamps every record of an authenticated agent on arrival with the launcher's own
  clock: ``received``, the launcher's ``time.monotonic()`` when the record arrived (for a
  ``lost`` record: when its agent was last heard from). The ranks' own ``time`` and
  ``since`` fields come from their hosts' clocks, which may be seconds or minutes off
  the launcher's; ordering (the failure report's root cause) and durations (the stall
  inspector's waits) use ``received`` only;
* keeps a bounded number of records per rank and kind, the latest
  (:data:`KEPT_PER_RANK`; heartbeats none): :meth:`Collector.records` by kind,
  :meth:`Collector.failure_records` for the report. A rank's progress records (five a
  second at most, for as long as the job runs) thus cost the same memory after a
  minute as after a week. The callbacks registered with :meth:`Collector.subscribe` see
  every record of the kinds they asked for (e.g. the stall inspector for
  ``"progress"``); a record must carry its connection's rank, and only the kinds of
  :data:`records.FROM_AGENT <popdist_lite.records.FROM_AGENT>` are accepted (``lost`` is
  made here, never read);
* sends requests to one authenticated agent (:meth:`Collector.send`, e.g.
  ``{"kind": "signal", "signal": "SIGUSR1"}``);
* turns an authenticated agent that disappears into a ``"lost"`` record: its connection
  ended without an ``exit`` record (the agent was killed, its host went down), nothing
  came for ``silence_timeout`` seconds (on the launcher's ``time.monotonic()``, which a
  step of the wall clock does not move) although heartbeats come every second (the host
  or its link is down), or it was still connected without an ``exit`` record when mpirun
  ended (:meth:`Collector.finish`). A loss is marked ``terminated`` (a consequence, not a
  cause) unless the agent fell silent before the first failure or
  :meth:`Collector.stopping`.

Limits: a connection must authenticate within
:data:`~popdist_lite_launcher.core.channel.HELLO_DEADLINE_SECONDS` with a first line of at
most :data:`~popdist_lite_launcher.core.channel.MAX_HELLO_BYTES`; at most
:data:`MAX_PENDING_CONNECTIONS` connections wait for that at once (a new one closes the
oldest, so a flood of strangers delays an agent by one retry, never keeps it out); at
most ``ranks + CONNECTION_MARGIN`` agents; lines of at most
:data:`records.MAX_LINE_BYTES <popdist_lite.records.MAX_LINE_BYTES>`; a connection is
closed at its end of file; when ``accept()`` fails for lack of file descriptors the
collector closes the oldest unauthenticated connection and stops accepting for
:data:`ACCEPT_BACKOFF_SECONDS` (the loop does not spin).

One thread runs a ``selectors`` loop over the listening socket and the connections;
callbacks run in that thread and must be quick.
"""

from __future__ import annotations

import collections
import errno
import itertools
import select
import selectors
import socket
import threading
import time

from popdist_lite import records

from ..core import channel

#: Seconds without any line from a connected agent before it is declared lost.
AGENT_SILENCE_SECONDS = 10.0
#: Authenticated agents allowed beyond the job's ranks.
CONNECTION_MARGIN = 4
#: Connections waiting to authenticate, at most; a new one beyond closes the oldest.
MAX_PENDING_CONNECTIONS = 32
#: Seconds without accepting after ``accept()`` failed for lack of file descriptors.
ACCEPT_BACKOFF_SECONDS = 0.5
#: Seconds a send to an agent may take before the agent counts as unreachable.
SEND_TIMEOUT_SECONDS = 2.0
#: Records kept per rank and kind, the latest (older ones are dropped); kinds not named
#: keep :data:`KEPT_DEFAULT`. The report reads a rank's last ``exit``, ``error`` and
#: ``lost``; the stall inspector keeps its own last ``progress`` of every replica.
KEPT_PER_RANK = {"progress": 8, "stack": 4}
KEPT_DEFAULT = 4
#: Seconds a job's collector (``enrolment``) waits, from its start, for every rank to
#: enrol before it welcomes those that did and accepts no more.
ENROLMENT_SECONDS = 60.0

_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class _Connection:
    """One connection: unauthenticated until ``session`` is set by a valid hello."""

    def __init__(self, sock: socket.socket, nonce: bytes):
        self.sock = sock
        self.nonce = nonce
        self.started = time.monotonic()
        self.lines = records.LineBuffer(channel.MAX_HELLO_BYTES)
        self.overlong = 0  # lines.overlong already counted
        self.session: channel.Session | None = None
        self.send_lock = threading.Lock()  # frames leave in the order they were sealed
        self.hello: dict | None = None
        self.rank: int | None = None
        self.last_heard = time.monotonic()
        self.exited = False
        self.closed = False
        self.lost = False


class Collector:
    """TCP server for the agents' records (see the module docstring).

    Args:
        host: the address to listen on (``127.0.0.1`` for a single-host job, the
            launcher's address on the job's network otherwise).
        port: 0 picks a free one.
        key: the job's key (default: a new one, :func:`channel.new_key`); agents get it
            as :attr:`key`.
        ranks: the job's MPI ranks (agents); ``ranks + CONNECTION_MARGIN`` agents may
            authenticate.
        silence_timeout: seconds without a line before an agent is lost.
        enrolment: for a job's collector, seconds (e.g. :data:`ENROLMENT_SECONDS`) the
            ranks have to enrol: each of ranks ``0 .. ranks-1`` is accepted once, with
            its welcome held until every rank has enrolled or these seconds (from the
            collector's start) have passed; then enrolment closes and no hello is
            accepted any more. Every agent removed its key file before its hello,
            so no program (agents start it after their welcome) finds one; a key it
            found anyway (a file whose agent never started) opens nothing. None: any agent, at once (up to ``ranks +
            CONNECTION_MARGIN`` connected; the hosts' check server, tests).

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, key: bytes | None = None,
                 ranks: int = 1, silence_timeout: float = AGENT_SILENCE_SECONDS,
                 enrolment: float | None = None):
        self.key = key or channel.new_key()
        self.ranks = ranks
        self._enrolling = enrolment is not None
        self._enrolment_ends = time.monotonic() + (enrolment or 0.0)
        self._enrolled: set[int] = set()      # ranks whose hello was accepted
        self._held: list[_Connection] = []    # ... whose welcome waits for the others
        self.silence_timeout = silence_timeout
        self.max_agents = ranks + CONNECTION_MARGIN
        self._server = socket.create_server((host, port))
        self._server.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._server, selectors.EVENT_READ)
        self._accept_paused_until: float | None = None
        self._pending: list[_Connection] = []  # oldest first
        self._agents: list[_Connection] = []   # authenticated
        # rank -> kind -> the latest (sequence number, record); the sequence number keeps
        # the order of arrival across ranks and kinds
        self._kept: dict[int | None, dict[str, collections.deque]] = {}
        self._sequence = itertools.count()
        self._lost_cause = False
        self._subscribers: dict[str, list] = {}
        self._refused: collections.Counter = collections.Counter()
        self._dropped: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self._failed = False
        self._failed_at: float | None = None  # monotonic: the first failure or the stop
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="poprun-lite collector",
                                        daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        """``host:port`` for ``POPRUN_LITE_COLLECTOR``."""
        host, port = self._server.getsockname()[:2]
        return f"{host}:{port}"

    # ------------------------------------------------------------ public API

    def records(self, kind: str | None = None) -> list[dict]:
        """The records kept (all kinds but heartbeats, the latest :data:`KEPT_PER_RANK`
        of each rank and kind), or those of ``kind``, in the order they arrived. Each
        carries ``received`` (see the module docstring) besides its kind's fields."""
        return self._kept_records(None if kind is None else (kind,))

    def failure_records(self) -> list[dict]:
        """The records the failure report reads (kinds ``error``, ``exit``, ``lost``), as
        :meth:`records`."""
        return self._kept_records(records.FAILURE_KINDS)

    def _kept_records(self, kinds) -> list[dict]:
        with self._lock:
            found = [item for by_kind in self._kept.values()
                     for kind, kept in by_kind.items() if kinds is None or kind in kinds
                     for item in kept]
        return [record for _, record in sorted(found, key=lambda item: item[0])]

    def ignored(self) -> tuple[dict[str, int], dict[str, int]]:
        """What was not believed so far: ``(refused, dropped)``, counts by reason of the
        connections closed without authenticating and of the lines dropped on
        authenticated connections."""
        with self._lock:
            return dict(self._refused), dict(self._dropped)

    def subscribe(self, kind: str, callback) -> None:
        """Call ``callback(record)`` (in the collector's thread) for every later record
        of ``kind``."""
        with self._lock:
            self._subscribers.setdefault(kind, []).append(callback)

    def send(self, rank: int, record: dict) -> bool:
        """Send ``record`` to the authenticated agent of ``rank``; False if there is none
        or it cannot be reached within :data:`SEND_TIMEOUT_SECONDS`."""
        with self._lock:
            agents = [a for a in self._agents if a.rank == rank and not a.closed]
        for agent in agents:
            with agent.send_lock:
                return _send_all(agent.sock, agent.session.seal(record), SEND_TIMEOUT_SECONDS)
        return False

    def has_failure(self) -> bool:
        """True once a rank failed (an error record, a failed exit, or a lost agent that is
        not a consequence of stopping)."""
        with self._lock:
            return self._failed

    def lost_cause(self) -> bool:
        """True once an agent was lost before the job was failing or stopping."""
        with self._lock:
            return self._lost_cause

    def stopping(self) -> None:
        """Mark the job as being stopped: agents lost from now on are consequences."""
        with self._lock:
            if self._failed_at is None:
                self._failed_at = time.monotonic()

    def finish(self) -> None:
        """Call when mpirun has ended: an agent still connected without an ``exit``
        record is lost (killed, or its host is down; mpirun may end the job before the
        agent's silence is noticed)."""
        with self._lock:
            agents = [a for a in self._agents if not a.exited and not a.lost]
        for agent in agents:
            self._lose(agent, "no exit record from its agent when the job ended (agent "
                              "killed or host down)")

    def wait_closed(self, timeout: float) -> bool:
        """Wait until every authenticated agent has closed its connection (their last
        records are then in), at most ``timeout`` s. True if all closed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if all(a.closed for a in self._agents):
                    return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        """Stop the thread and close every socket (idempotent). Connections still not
        authenticated count as refused."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._thread.join(2.0)
        with self._lock:
            if self._pending:
                self._refused["not authenticated when the job ended"] += len(self._pending)
        for conn in self._pending + self._held + self._agents:
            conn.sock.close()
        self._server.close()
        self._selector.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------ the loop

    def _loop(self) -> None:
        while not self._closed:
            for key, _ in self._selector.select(timeout=0.2):
                conn = key.data
                try:
                    if conn is None:
                        self._accept()
                    elif not conn.closed:
                        self._read(conn)
                except Exception as exc:  # noqa: BLE001 - a bug must not end the collector
                    reason = f"collector error ({type(exc).__name__})"
                    if conn is not None and conn in self._pending:
                        self._refuse(conn, reason)
                    else:
                        with self._lock:
                            self._dropped[reason] += 1
            self._check_deadlines()

    def _accept(self) -> None:
        try:
            sock, _ = self._server.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            if exc.errno in _OUT_OF_DESCRIPTORS:
                # the backlog keeps the connection; free a descriptor and wait, not spin
                self._selector.unregister(self._server)
                self._accept_paused_until = time.monotonic() + ACCEPT_BACKOFF_SECONDS
                if self._pending:
                    self._refuse(self._pending[0], "closed to free a file descriptor")
            return
        if len(self._pending) >= MAX_PENDING_CONNECTIONS:
            self._refuse(self._pending[0], "closed for a newer unauthenticated connection")
        nonce, line = channel.challenge()
        conn = _Connection(sock, nonce)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sent = sock.send(line)  # a new socket's buffer is empty: all of it goes
        except OSError:
            sent = 0
        if sent != len(line):
            sock.close()
            with self._lock:
                self._refused["challenge not delivered"] += 1
            return
        self._pending.append(conn)
        self._selector.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Connection) -> None:
        try:
            chunk = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            if conn.session is None:
                self._refuse(conn, "closed before authenticating")
            else:
                self._end(conn)
                if not conn.exited:
                    self._lose(conn, "its agent's connection closed without an exit record "
                                     "(agent killed or host down)")
            return
        conn.last_heard = time.monotonic()
        for line in conn.lines.feed(chunk):
            if conn.closed:
                return
            if conn.session is None:
                self._authenticate(conn, line)
            else:
                self._receive(conn, line)
        if conn.lines.overlong > conn.overlong and not conn.closed:
            if conn.session is None:
                self._refuse(conn, f"first line over {channel.MAX_HELLO_BYTES} bytes")
                return
            with self._lock:
                self._dropped[f"line over {records.MAX_LINE_BYTES} bytes"] += \
                    conn.lines.overlong - conn.overlong
            conn.overlong = conn.lines.overlong

    def _authenticate(self, conn: _Connection, line: bytes) -> None:
        try:
            session, hello = channel.accept(self.key, conn.nonce, line)
        except channel.ChannelError as exc:
            self._refuse(conn, f"hello: {exc.reason}")
            return
        if self._enrolling:
            self._enrol(conn, session, hello)
            return
        with self._lock:
            live = [a for a in self._agents if not a.closed]
        if any(a.rank == hello["rank"] for a in live):
            self._refuse(conn, "hello for a rank already connected")
            return
        if len(live) >= self.max_agents:
            self._refuse(conn, "more agents than the job's ranks")
            return
        conn.session, conn.hello, conn.rank = session, hello, hello["rank"]
        with conn.send_lock:  # the welcome is frame 0: no request may be sealed before it
            with self._lock:  # send() finds the agent as soon as its welcome can arrive
                self._agents.append(conn)
            welcomed = _send_all(conn.sock, channel.welcome(session), SEND_TIMEOUT_SECONDS)
            if not welcomed:  # gone already: the agent tries again
                with self._lock:
                    self._agents.remove(conn)
        if not welcomed:
            self._refuse(conn, "welcome not delivered")
            return
        self._pending.remove(conn)
        conn.lines.max_line = records.MAX_LINE_BYTES
        self._add(conn, hello)

    def _enrol(self, conn: _Connection, session: channel.Session, hello: dict) -> None:
        """A job's collector: accept the authentic ``hello`` of ``conn`` if its rank is one
        of the job's and has not enrolled before, while enrolment is open; hold its
        welcome until enrolment closes (:meth:`_close_enrolment`)."""
        rank = hello["rank"]
        if self._enrolment_ends is None:
            self._refuse(conn, "hello after enrolment closed")
            return
        if not 0 <= rank < self.ranks:
            self._refuse(conn, "hello for a rank outside the job")
            return
        if rank in self._enrolled:
            self._refuse(conn, "hello for a rank already enrolled")
            return
        self._enrolled.add(rank)
        self._pending.remove(conn)
        conn.session, conn.hello, conn.rank = session, hello, rank
        self._held.append(conn)
        if len(self._enrolled) == self.ranks:
            self._close_enrolment()

    def _close_enrolment(self) -> None:
        """Accept no more hellos and welcome every enrolled agent still connected (loop
        thread only)."""
        self._enrolment_ends = None
        held, self._held = self._held, []
        for conn in held:
            if conn.closed:
                continue
            with conn.send_lock:  # the welcome is frame 0
                with self._lock:
                    self._agents.append(conn)
                welcomed = _send_all(conn.sock, channel.welcome(conn.session), SEND_TIMEOUT_SECONDS)
            conn.last_heard = time.monotonic()  # silent while held: no heartbeats before the welcome
            if not welcomed:
                self._end(conn)
                self._lose(conn, "its agent's welcome could not be delivered")
                continue
            conn.lines.max_line = records.MAX_LINE_BYTES
            self._add(conn, conn.hello)

    def _receive(self, conn: _Connection, line: bytes) -> None:
        try:
            record = conn.session.open(line, records.FROM_AGENT)
        except channel.ChannelError as exc:
            with self._lock:
                self._dropped[exc.reason] += 1
            return
        if "rank" in record and record["rank"] != conn.rank:
            with self._lock:
                self._dropped["record for another rank than its connection's"] += 1
            return
        self._add(conn, record)

    def _add(self, conn: _Connection, record: dict) -> None:
        kind = record["kind"]
        if kind == "heartbeat":
            return
        if kind == "exit":
            conn.exited = True
        record["received"] = conn.last_heard  # set when the chunk holding it arrived
        with self._lock:
            self._keep(conn.rank, record)
            if kind == "error" or (kind == "exit" and (record["exitcode"] or record["signal"])
                                   and not record["terminated"]):
                self._mark_failed()
            callbacks = list(self._subscribers.get(kind, ()))
        for callback in callbacks:
            try:
                callback(record)
            except Exception:  # noqa: BLE001 - a subscriber must not stop the collector
                pass

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        while self._pending and now - self._pending[0].started > channel.HELLO_DEADLINE_SECONDS:
            self._refuse(self._pending[0], f"no hello within {channel.HELLO_DEADLINE_SECONDS:g} s")
        if self._enrolling and self._enrolment_ends is not None and now >= self._enrolment_ends:
            self._close_enrolment()
        if self._accept_paused_until is not None and now >= self._accept_paused_until:
            self._accept_paused_until = None
            self._selector.register(self._server, selectors.EVENT_READ)
        for agent in list(self._agents):
            if not agent.closed and not agent.exited \
                    and now - agent.last_heard > self.silence_timeout:
                self._end(agent)
                self._lose(agent, f"nothing from its agent for {self.silence_timeout:g} s "
                                  "(host down or unreachable)")

    def _end(self, conn: _Connection) -> None:
        """Close ``conn`` (loop thread only)."""
        conn.closed = True
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _refuse(self, conn: _Connection, reason: str) -> None:
        """Count an unauthenticated connection as refused and close it."""
        with self._lock:
            self._refused[reason] += 1
        self._pending.remove(conn)
        self._end(conn)

    def _lose(self, agent: _Connection, reason: str) -> None:
        """Record ``agent`` as lost. The loss is a consequence (``terminated``) unless the
        agent fell silent at least two heartbeats before the first failure or the stop."""
        with self._lock:
            if agent.lost:
                return
            agent.lost = True
            terminated = self._failed_at is not None and \
                agent.last_heard > self._failed_at - 2 * records.HEARTBEAT_SECONDS
            ident = {name: agent.hello[name] for name in records.IDENTITY_FIELDS}
            # the launcher's wall time then, for the record's ``time`` field
            ident["time"] = time.time() - (time.monotonic() - agent.last_heard)
            lost = records.make("lost", ident, reason=reason, terminated=terminated)
            lost["received"] = agent.last_heard
            self._keep(agent.rank, lost)
            if not terminated:
                self._lost_cause = True
                self._mark_failed()

    def _keep(self, rank: int | None, record: dict) -> None:
        """Keep ``record`` of ``rank`` (under the lock), dropping the oldest of its kind
        beyond :data:`KEPT_PER_RANK`."""
        kind = record["kind"]
        by_kind = self._kept.setdefault(rank, {})
        kept = by_kind.get(kind)
        if kept is None:
            kept = by_kind[kind] = collections.deque(maxlen=KEPT_PER_RANK.get(kind, KEPT_DEFAULT))
        kept.append((next(self._sequence), record))

    def _mark_failed(self) -> None:
        self._failed = True
        if self._failed_at is None:
            self._failed_at = time.monotonic()


def _send_all(sock: socket.socket, data: bytes, timeout: float) -> bool:
    """Write ``data`` to a non-blocking socket within ``timeout`` s; False on failure."""
    deadline = time.monotonic() + timeout
    view = memoryview(data)
    try:
        while view:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [sock], [], left)[1]:
                return False
            view = view[sock.send(view):]
    except (OSError, ValueError):  # ValueError: a socket closed meanwhile (fileno -1)
        return False
    return True
