"""Hand-driven peers of the collector for the launcher tests: an agent connection that
speaks the real protocol (popdist_lite_launcher.core.channel) one step at a time, and a
stranger who does not hold the key."""

from __future__ import annotations

import socket
import time

from popdist_lite import records
from popdist_lite_launcher.core import channel
from popdist_lite_launcher.node import keys


def key_file(key: bytes, rank: int = 0) -> dict[str, str]:
    """The environment entry giving an agent of rank ``rank`` the job's ``key``: a key
    file of its own (keys.write_keys), which the agent removes with its directory."""
    directory = keys.write_keys(key, [rank], "0" * 16)
    return {keys.KEY_FILE_ENV: f"{directory}/{keys.key_file_name(rank)}"}


def address(collector) -> tuple[str, int]:
    host, port = collector.address.rsplit(":", 1)
    return host, int(port)


def read_line(sock: socket.socket, buffer: records.LineBuffer, pending: list, timeout: float = 5.0):
    """The next line from ``sock`` (None at EOF)."""
    deadline = time.monotonic() + timeout
    while not pending:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = sock.recv(65536)
        if not chunk:
            return None
        pending.extend(buffer.feed(chunk))
    return pending.pop(0)


class AgentConnection:
    """An agent's connection: challenge read, hello sent with ``key`` (default the
    collector's), welcome checked unless ``welcome=False``."""

    def __init__(self, collector, rank: int, *, key: bytes | None = None, replica: int | None = None,
                 welcome: bool = True):
        self.sock = socket.create_connection(address(collector), timeout=5)
        self.buffer, self.pending = records.LineBuffer(), []
        self.ident = records.identity(rank=rank, replica=rank if replica is None else replica, pid=1000 + rank)
        self.session, hello = channel.answer(key or collector.key, self.read(), self.ident)
        self.hello_line = hello
        self.sock.sendall(hello)
        if welcome:
            channel.check_welcome(self.session, self.read())

    def read(self, timeout: float = 5.0):
        line = read_line(self.sock, self.buffer, self.pending, timeout)
        assert line is not None, "the collector closed the connection"
        return line

    def receive(self, timeout: float = 5.0) -> dict:
        """The next request from the collector, checked."""
        return self.session.open(self.read(timeout), records.TO_AGENT)

    def send(self, kind: str, **fields) -> bytes:
        """Send a record of this agent (its identity for kinds that have one)."""
        ident = self.ident if "rank" in records.SCHEMA.get(kind, {"rank": 0}) else None
        frame = self.session.seal(records.make(kind, ident, **fields))
        self.sock.sendall(frame)
        return frame

    def send_exit(self, code: int = 0) -> None:
        self.send("exit", exitcode=code, signal=None, stderr_tail="", terminated=False)

    def close(self) -> None:
        self.sock.close()


def wait_for(condition, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
