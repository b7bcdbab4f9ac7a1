"""The agent's authenticated connection to the launcher's collector (:class:`Link`), and
the handshake it makes (:func:`connect`: challenge, hello, welcome;
:mod:`popdist_lite_launcher.core.channel`), which the reachability probe makes too
(:mod:`popdist_lite_launcher.node.probe`)."""

from __future__ import annotations

import collections
import random
import socket
import sys
import threading
import time

from popdist_lite import records

from .keys import KEY_FILE_ENV
from ..core import channel

#: Seconds, in all, the agent keeps trying to connect to the collector and authenticate.
CONNECT_DEADLINE_SECONDS = 30.0
#: First pause between two connection attempts; doubled after each, up to the maximum.
CONNECT_BACKOFF_SECONDS = 0.05
CONNECT_BACKOFF_MAX_SECONDS = 2.0
#: Seconds the agent waits for its welcome after its hello (a job's collector holds it
#: until every rank has enrolled, at most its ``enrolment`` seconds).
WELCOME_DEADLINE_SECONDS = 90.0


def warn(text: str) -> None:
    """``poprun-lite agent on HOST: text`` on stderr (nothing when stderr is gone)."""
    try:
        print(f"poprun-lite agent on {socket.gethostname()}: {text}", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # mpirun, which reads our stderr, is gone
        pass


class _Lines:
    """The lines arriving on a blocking socket, one at a time."""

    def __init__(self, sock: socket.socket, max_line: int):
        self.sock = sock
        self.buffer = records.LineBuffer(max_line)
        self.ready: collections.deque[bytes] = collections.deque()

    def next(self, deadline: float | None = None) -> bytes | None:
        """The next line, or None at the end of the stream.

        Raises:
            OSError: including ``TimeoutError`` once ``deadline`` (monotonic) has passed.
            channel.ChannelError: a line over the buffer's limit.
        """
        while not self.ready:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no answer in time")
                self.sock.settimeout(left)
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.ready.extend(self.buffer.feed(chunk))
            if self.buffer.overlong:
                raise channel.ChannelError(f"a line over {self.buffer.max_line} bytes")
        return self.ready.popleft()


class Link:
    """The agent's authenticated connection to the launcher's collector.

    ``address`` is ``host:port`` and ``key`` the job's key (either None: no records are
    sent). :meth:`start` connects in a thread: TCP connection, ``challenge``, ``hello``,
    ``welcome`` (:mod:`popdist_lite_launcher.core.channel`), trying again with exponential
    back-off while the collector closes the connection before its welcome (a flood of
    strangers' connections may have pushed this one out), for up to
    :data:`CONNECT_DEADLINE_SECONDS` (a refused connection ends the tries: nobody
    listens, the launcher is gone); the welcome itself may take up to
    :data:`WELCOME_DEADLINE_SECONDS`. Then it starts the heartbeat and the reader of the
    launcher's requests, which calls ``on_request(record)`` for every authentic, valid
    request and ``on_lost()`` when the connection ends without :meth:`close`.
    :meth:`send` is thread-safe and waits for the handshake.
    """

    def __init__(self, address: str | None, key: bytes | None):
        self.address, self.key = address, key
        self.sock: socket.socket | None = None
        self.session: channel.Session | None = None
        self.lock = threading.Lock()
        self.ready = threading.Event()  # authenticated, or given up
        self.closed = threading.Event()
        if address and key is None:
            warn(f"no job key (${KEY_FILE_ENV} names no readable key file); "
                 "this rank's failures will not be reported")
        if not address or key is None:
            self.ready.set()

    def start(self, ident: dict, on_request, on_lost=None) -> None:
        """Connect and authenticate as ``ident`` (identity fields) in a thread."""
        if not self.ready.is_set():
            threading.Thread(target=self._run, args=(dict(ident), on_request, on_lost),
                             name="poprun-lite link", daemon=True).start()

    def _run(self, ident: dict, on_request, on_lost) -> None:
        deadline = time.monotonic() + CONNECT_DEADLINE_SECONDS
        pause = CONNECT_BACKOFF_SECONDS
        while True:
            try:
                lines = self._handshake(ident, deadline)
                break
            except Exception as exc:  # noqa: BLE001 - OSError, ChannelError, a bad address
                problem = exc
            if self.closed.is_set() or time.monotonic() + pause > deadline \
                    or isinstance(problem, ConnectionRefusedError):
                warn(f"cannot enrol with the launcher's collector at {self.address}: {problem}")
                self.ready.set()
                return
            time.sleep(pause * random.uniform(0.5, 1.0))
            pause = min(2 * pause, CONNECT_BACKOFF_MAX_SECONDS)
        self.ready.set()
        threading.Thread(target=self._heartbeat, daemon=True).start()
        threading.Thread(target=self._requests, args=(lines, on_request, on_lost),
                         daemon=True).start()

    def _handshake(self, ident: dict, deadline: float) -> _Lines:
        """One attempt; returns the reader of the connection's later lines.

        Raises:
            OSError: cannot connect, closed or no answer before the welcome.
            ValueError: a bad address, or a refused challenge or welcome (ChannelError).
        """
        self.sock, self.session, lines = connect(
            self.address, self.key, ident, deadline,
            welcome_deadline=time.monotonic() + WELCOME_DEADLINE_SECONDS)
        return lines

    def send(self, record: dict) -> bool:
        """Send ``record`` (cut to the schema's limits, :func:`records.fit`); False if
        not sent (no link, or it broke)."""
        self.ready.wait(CONNECT_DEADLINE_SECONDS + 5.0)
        if self.session is None:
            return False
        with self.lock:
            try:
                self.sock.sendall(self.session.seal(records.fit(record)))
                return True
            except OSError:
                return False

    def _heartbeat(self) -> None:
        while not self.closed.wait(records.HEARTBEAT_SECONDS):
            if not self.send(records.make("heartbeat")):
                return

    def _requests(self, lines: _Lines, on_request, on_lost) -> None:
        try:
            self._read_requests(lines, on_request)
        finally:
            if on_lost is not None and not self.closed.is_set():
                on_lost()

    def _read_requests(self, lines: _Lines, on_request) -> None:
        """Until the connection ends."""
        while True:
            try:
                line = lines.next()
            except OSError:
                return
            except channel.ChannelError as exc:  # one over-long line: drop it, read on
                lines.buffer.overlong = 0
                warn(f"dropped a line from the launcher ({exc.reason})")
                continue
            if line is None:
                return
            try:
                request = self.session.open(line, records.TO_AGENT)
            except channel.ChannelError as exc:
                warn(f"dropped a line from the launcher ({exc.reason})")
                continue
            try:
                on_request(request)
            except Exception as exc:  # noqa: BLE001 - a failing request must not kill the agent
                warn(f"request {request['kind']!r} failed: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Stop the heartbeat and close the connection (after the last record)."""
        self.closed.set()
        if self.sock is not None:
            with self.lock:
                try:
                    self.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                self.sock.close()


def connect(address: str, key: bytes, ident: dict, deadline: float, *,
            welcome_deadline: float | None = None) -> tuple[socket.socket, channel.Session, _Lines]:
    """Connect to the collector at ``address`` (``host:port``) and authenticate as
    ``ident`` with ``key`` (challenge, hello, welcome), by ``deadline`` (monotonic; the
    welcome by ``welcome_deadline`` if later): ``(socket, session, reader of its later
    lines)``.

    Raises:
        OSError: cannot connect, closed or no answer before the welcome (TimeoutError
            once ``deadline`` has passed).
        ValueError: a bad address, or a refused challenge or welcome (ChannelError).
    """
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)),
                                    timeout=max(0.1, deadline - time.monotonic()))
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        lines = _Lines(sock, channel.MAX_HELLO_BYTES)
        session, hello = channel.answer(key, _line(lines, deadline), ident)
        sock.sendall(hello)
        channel.check_welcome(session, _line(lines, max(deadline, welcome_deadline or deadline)))
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    lines.buffer.max_line = records.MAX_LINE_BYTES
    return sock, session, lines


def _line(lines: _Lines, deadline: float) -> bytes:
    """The next handshake line.

    Raises:
        ConnectionError: the collector closed the connection first.
    """
    line = lines.next(deadline)
    if line is None:
        raise ConnectionError("the collector closed the connection before the welcome")
    return line
