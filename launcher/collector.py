"""The launcher's collector: a TCP server receiving the records of every rank's agent.

The launcher starts a :class:`Collector` before mpirun and gives every rank its address
in ``POPRUN_LITE_COLLECTOR=host:port``; each agent opens one connection and sends
newline-delimited JSON records (format: :mod:`popdist_lite.records`). The collector

* keeps every record except heartbeats (:meth:`Collector.records`, by kind), and calls
  the callbacks registered with :meth:`Collector.subscribe` for the kinds they asked for
  (e.g. the stall inspector for ``"progress"``);
* sends requests to one agent (:meth:`Collector.send`, e.g. ``{"kind": "signal",
  "signal": "SIGUSR1"}``);
* turns an agent that disappears into a ``"lost"`` record: its connection ended without
  an ``exit`` record (the agent was killed, its host went down), nothing came for
  ``silence_timeout`` seconds although heartbeats come every second (the host or its
  link is down), or it was still connected without an ``exit`` record when mpirun
  ended (:meth:`Collector.finish`). A loss is marked ``terminated`` (a consequence, not
  a cause) unless the agent fell silent before the first failure or
  :meth:`Collector.stopping`.

One thread runs a ``selectors`` loop over the listening socket and the connections;
callbacks run in that thread and must be quick.
"""

from __future__ import annotations

import select
import selectors
import socket
import threading
import time

from popdist_lite import records

#: Seconds without any line from a connected agent before it is declared lost.
AGENT_SILENCE_SECONDS = 10.0


class _Agent:
    """One agent's connection."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.lines = records.LineBuffer()
        self.hello: dict | None = None
        self.last_heard = time.time()
        self.exited = False
        self.closed = False
        self.lost = False


class Collector:
    """TCP server for the agents' records (see the module docstring).

    ``host`` is the address to listen on (``127.0.0.1`` for a single-host job, the
    launcher's address on the job's network otherwise); ``port`` 0 picks a free one.

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 silence_timeout: float = AGENT_SILENCE_SECONDS):
        self.silence_timeout = silence_timeout
        self._server = socket.create_server((host, port))
        self._server.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._server, selectors.EVENT_READ)
        self._agents: list[_Agent] = []
        self._records: list[dict] = []
        self._subscribers: dict[str, list] = {}
        self._lock = threading.Lock()
        self._failed = False
        self._failed_at: float | None = None  # when the first failure or the stop came
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
        """The records received so far (all kinds but heartbeats), or those of ``kind``."""
        with self._lock:
            return [r for r in self._records if kind is None or r["kind"] == kind]

    def failure_records(self) -> list[dict]:
        """The records the failure report reads (kinds ``error``, ``exit``, ``lost``)."""
        with self._lock:
            return [r for r in self._records if r["kind"] in records.FAILURE_KINDS]

    def subscribe(self, kind: str, callback) -> None:
        """Call ``callback(record)`` (in the collector's thread) for every later record
        of ``kind``."""
        with self._lock:
            self._subscribers.setdefault(kind, []).append(callback)

    def send(self, rank: int, record: dict) -> bool:
        """Send ``record`` to the agent of ``rank``; False if it is not connected."""
        line = records.encode(record)
        with self._lock:
            agents = [a for a in self._agents
                      if a.hello is not None and a.hello.get("rank") == rank and not a.closed]
        for agent in agents:
            return _send_all(agent.sock, line, timeout=2.0)
        return False

    def has_failure(self) -> bool:
        """True once a rank failed (an error record, a failed exit, or a lost agent that is
        not a consequence of stopping)."""
        with self._lock:
            return self._failed

    def stopping(self) -> None:
        """Mark the job as being stopped: agents lost from now on are consequences."""
        with self._lock:
            self._failed_at = self._failed_at or time.time()

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
        """Wait until every connected agent has closed its connection (their last records
        are then in), at most ``timeout`` s. True if all closed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if all(a.closed for a in self._agents):
                    return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        """Stop the thread and close every socket (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._thread.join(2.0)
        for agent in self._agents:
            agent.sock.close()
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
                if key.fileobj is self._server:
                    self._accept()
                else:
                    self._read(key.data)
            self._check_silence()

    def _accept(self) -> None:
        try:
            sock, _ = self._server.accept()
        except OSError:
            return
        sock.setblocking(False)
        agent = _Agent(sock)
        with self._lock:
            self._agents.append(agent)
        self._selector.register(sock, selectors.EVENT_READ, agent)

    def _read(self, agent: _Agent) -> None:
        try:
            chunk = agent.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._selector.unregister(agent.sock)
            if not agent.exited:
                self._lose(agent, "its agent's connection closed without an exit record "
                                  "(agent killed or host down)")
            agent.closed = True
            return
        agent.last_heard = time.time()
        for line in agent.lines.feed(chunk):
            try:
                record = records.decode(line)
            except ValueError:
                continue
            self._add(agent, record)

    def _add(self, agent: _Agent, record: dict) -> None:
        kind = record["kind"]
        if kind == "heartbeat":
            return
        if kind == "hello":
            agent.hello = record
        elif kind == "exit":
            agent.exited = True
        with self._lock:
            self._records.append(record)
            if kind == "error" or (kind == "exit" and (record.get("exitcode") or
                                                       record.get("signal"))
                                   and not record.get("terminated")):
                self._mark_failed()
            callbacks = list(self._subscribers.get(kind, ()))
        for callback in callbacks:
            try:
                callback(record)
            except Exception:  # noqa: BLE001 - a subscriber must not stop the collector
                pass

    def _check_silence(self) -> None:
        now = time.time()
        for agent in list(self._agents):
            if not agent.closed and not agent.exited and agent.hello is not None \
                    and now - agent.last_heard > self.silence_timeout:
                self._selector.unregister(agent.sock)
                agent.sock.close()
                agent.closed = True
                self._lose(agent, f"nothing from its agent for {self.silence_timeout:g} s "
                                  "(host down or unreachable)")

    def _lose(self, agent: _Agent, reason: str) -> None:
        """Record ``agent`` as lost. The loss is a consequence (``terminated``) unless the
        agent fell silent at least two heartbeats before the first failure or the stop."""
        ident = dict(agent.hello or {})
        ident.pop("kind", None)
        if not ident or agent.lost:  # never said hello: nothing to name
            return
        agent.lost = True
        with self._lock:
            terminated = self._failed_at is not None and \
                agent.last_heard > self._failed_at - 2 * records.HEARTBEAT_SECONDS
            record = records.make("lost", {**ident, "time": agent.last_heard},
                                  reason=reason, terminated=terminated)
            self._records.append(record)
            if not terminated:
                self._mark_failed()

    def _mark_failed(self) -> None:
        self._failed = True
        self._failed_at = self._failed_at or time.time()


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
    except OSError:
        return False
    return True
