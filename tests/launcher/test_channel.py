"""The authenticated control plane (launcher/core/channel.py, launcher/node/keys.py, the
collector, the agent's link): the handshake and framing in one process, then the
collector and the agent against strangers (no key, a wrong key, replays, bad MACs,
sequence numbers, over-long lines, floods of connections, running out of file
descriptors). Every refusal is counted, and
the job's own agents still get through."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from popdist_lite import records
from popdist_lite_launcher.core import channel
from popdist_lite_launcher.node import keys, link as link_module
from popdist_lite_launcher.supervise import collector as collector_module
from popdist_lite_launcher.supervise.collector import Collector
from peers import AgentConnection, address, key_file, read_line, wait_for

IDENT = records.identity(rank=0, replica=0, pid=10)


def handshake(key=b"k" * 32, agent_key=None):
    """(launcher session, agent session, hello record) after a complete handshake."""
    nonce, challenge = channel.challenge()
    agent_session, hello = channel.answer(agent_key or key, challenge[:-1], IDENT)
    launcher_session, record = channel.accept(key, nonce, hello[:-1])
    channel.check_welcome(agent_session, channel.welcome(launcher_session)[:-1])
    return launcher_session, agent_session, record


# ---------------------------------------------------------------- the protocol alone

def test_handshake_and_frames_both_ways():
    launcher, agent_side, hello = handshake()
    assert {k: hello[k] for k in records.IDENTITY_FIELDS} == IDENT
    progress = records.make("progress", IDENT, lane="main", call=1, op="all_reduce", since=1.0)
    for _ in range(3):
        assert launcher.open(agent_side.seal(progress)[:-1], records.FROM_AGENT) == progress
    request = records.make("signal", signal="SIGUSR1")
    assert agent_side.open(launcher.seal(request)[:-1], records.TO_AGENT) == request
    assert (agent_side.sent, launcher.received, launcher.sent, agent_side.received) == (4, 4, 2, 2)


def test_wrong_key_is_refused_in_both_directions():
    with pytest.raises(channel.ChannelError, match="bad MAC"):
        handshake(key=b"k" * 32, agent_key=b"x" * 32)  # a stranger's hello
    nonce, challenge = channel.challenge()
    agent_session, hello = channel.answer(b"k" * 32, challenge[:-1], IDENT)
    impostor, _ = channel.accept(b"x" * 32, nonce, channel.answer(b"x" * 32, challenge[:-1], IDENT)[1][:-1])
    with pytest.raises(channel.ChannelError, match="bad MAC"):  # an impostor launcher
        channel.check_welcome(agent_session, channel.welcome(impostor)[:-1])


def test_replayed_hello_and_frames_are_refused():
    key = b"k" * 32
    nonce, challenge = channel.challenge()
    _, hello = channel.answer(key, challenge[:-1], IDENT)
    channel.accept(key, nonce, hello[:-1])
    other_nonce, _ = channel.challenge()  # the same hello on another connection
    with pytest.raises(channel.ChannelError, match="bad MAC"):
        channel.accept(key, other_nonce, hello[:-1])
    launcher, agent_side, _ = handshake(key)
    frame = agent_side.seal(records.make("heartbeat"))[:-1]
    launcher.open(frame, records.FROM_AGENT)
    with pytest.raises(channel.ChannelError, match="out of sequence"):  # replayed
        launcher.open(frame, records.FROM_AGENT)
    agent_side.seal(records.make("heartbeat"))  # never delivered: the next is out of sequence
    with pytest.raises(channel.ChannelError, match="out of sequence"):
        launcher.open(agent_side.seal(records.make("heartbeat"))[:-1], records.FROM_AGENT)
    with pytest.raises(channel.ChannelError, match="bad MAC"):  # reflected to its sender
        agent_side.open(frame, records.TO_AGENT)


@pytest.mark.parametrize("mangle, reason", [
    (lambda f: f[:70] + bytes([f[70] ^ 1]) + f[71:], "bad MAC"),         # payload changed
    (lambda f: f.replace(b" 1 ", b" 2 ", 1), "bad MAC"),                 # sequence number changed
    (lambda f: f.split(b" ", 1)[1], "not a frame"),                      # no MAC
    (lambda f: b"x" * 64 + b" -1 {}", "not a frame"),
    (lambda f: b"0" * 64 + b" " + b"9" * 30 + b" {}", "not a frame"),
])
def test_bad_frames(mangle, reason):
    launcher, agent_side, _ = handshake()
    frame = agent_side.seal(records.make("heartbeat"))[:-1]
    assert frame.split(b" ")[1] == b"1"  # after the hello, frame 0
    with pytest.raises(channel.ChannelError, match=reason):
        launcher.open(mangle(frame), records.FROM_AGENT)


def test_authentic_frame_with_invalid_record():
    launcher, agent_side, _ = handshake()
    bad = agent_side.seal({"kind": "lost", "rank": 0})[:-1]  # made only by the collector
    with pytest.raises(channel.ChannelError, match="invalid record"):
        launcher.open(bad, records.FROM_AGENT)
    assert launcher.open(agent_side.seal(records.make("heartbeat"))[:-1], records.FROM_AGENT)


def test_take_key_reads_and_removes_the_file(tmp_path):
    mark = "0123456789abcdef"
    directory = keys.write_keys(b"\xab" * 32, [0, 3], mark, parent=str(tmp_path))
    assert os.stat(directory).st_mode & 0o777 == 0o700 and keys.is_key_dir(directory, mark)
    assert sorted(os.listdir(directory)) == ["rank-0", "rank-3"]
    assert all(os.stat(f"{directory}/{n}").st_mode & 0o777 == 0o600 for n in ("rank-0", "rank-3"))
    env = {keys.KEY_FILE_ENV: f"{directory}/rank-0", "OTHER": "1"}
    assert keys.take_key(env) == b"\xab" * 32 and env == {"OTHER": "1"}
    assert os.listdir(directory) == ["rank-3"]  # its own file only; the directory goes with the last
    assert keys.take_key({keys.KEY_FILE_ENV: f"{directory}/rank-3"}) == b"\xab" * 32
    assert not os.path.exists(directory)
    assert keys.take_key({keys.KEY_FILE_ENV: f"{directory}/rank-3"}) is None  # read once
    assert keys.take_key({}) is None


@pytest.mark.parametrize("case", ["short", "not hex", "readable by others", "symlink", "fifo"])
def test_take_key_refuses_a_bad_file(tmp_path, case):
    path = tmp_path / "rank-0"
    if case == "symlink":
        target = tmp_path / "target"
        target.write_text("ab" * 32)
        target.chmod(0o600)
        path.symlink_to(target)
    elif case == "fifo":
        os.mkfifo(path, 0o600)
    else:
        path.write_text({"short": "ab" * 16, "not hex": "zz" * 32}.get(case, "ab" * 32))
        path.chmod(0o644 if case == "readable by others" else 0o600)
    assert keys.take_key({keys.KEY_FILE_ENV: str(path)}) is None  # and returns at once


@pytest.mark.parametrize("printed", ["relative/poprun-lite-key-0123456789abcdef-x", "/tmp/other",
                                     "/tmp/poprun-lite-key-fedcba9876543210-x", "/tmp/../poprun-lite-key-0123456789abcdef-x",
                                     "/tmp/poprun-lite-key-0123456789abcdef-x;rm", "/tmp/poprun-lite-key-0123456789abcdef-x\n"])
def test_a_key_directory_printed_by_a_host_is_checked(printed):
    assert not keys.is_key_dir(printed, "0123456789abcdef")
    assert keys.is_key_dir("/tmp/poprun-lite-key-0123456789abcdef-x_1.a", "0123456789abcdef")


def test_the_key_reaches_another_host_on_standard_input_only():
    """What the launcher runs on another host: the key on standard input, the directory
    (in keys.key_parent()) printed; a bad mark, rank or key writes nothing.
    remove_keys removes the attempt's."""
    mark, key = "0123456789abcdee", b"\x5a" * 32
    run = [sys.executable, "-m", "popdist_lite_launcher.node.keys"]
    mine = lambda: sorted(n for n in os.listdir(keys.key_parent()) if mark in n)  # noqa: E731
    keys.remove_keys(mark)
    try:
        done = subprocess.run([*run, mark, "0", "2"], input=key.hex() + "\n", capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        directory = done.stdout.strip()
        assert keys.is_key_dir(directory, mark) and os.path.dirname(directory) == keys.key_parent()
        assert keys.take_key({keys.KEY_FILE_ENV: f"{directory}/rank-2"}) == key
        for args, given in (([mark, "0"], "zz\n"), (["nothex", "0"], key.hex()), ([mark, "-1"], key.hex()),
                            ([mark], key.hex())):
            bad = subprocess.run([*run, *args], input=given, capture_output=True, text=True, timeout=60)
            assert bad.returncode == 2 and not bad.stdout
        assert len(mine()) == 1
        assert keys.remove_keys(mark) == 1 and not mine()
    finally:
        keys.remove_keys(mark)


# ---------------------------------------------------------------- the collector

def test_collector_refuses_and_counts_strangers():
    with Collector(ranks=2) as collector:
        AgentConnection(collector, 0, key=b"x" * 32, welcome=False)  # wrong key
        legit = AgentConnection(collector, 1)
        with socket.create_connection(address(collector)) as sock:  # legit's hello, replayed
            sock.sendall(legit.hello_line)
            assert sock.recv(100).startswith(b'{"kind":"challenge"')
        with socket.create_connection(address(collector)) as sock:  # closes before its hello
            pass
        with socket.create_connection(address(collector)) as sock:  # a hello over 4 KiB
            sock.sendall(b"y" * (channel.MAX_HELLO_BYTES + 10))
            sock.recv(100)
            sock.settimeout(5)
            assert sock.recv(100) == b""  # closed at once
        # the authenticated agent: a bad MAC, a replay, another rank, an over-long line
        frame = legit.send("heartbeat")
        legit.sock.sendall(frame)
        legit.sock.sendall(b"0" * 64 + frame[64:])
        legit.send("stack", request=1, text="")
        legit.sock.sendall(legit.session.seal(records.make("stack", {**legit.ident, "rank": 0},
                                                           request=2, text="")))
        legit.sock.sendall(b"z" * (records.MAX_LINE_BYTES + 5) + b"\n")
        legit.sock.sendall(legit.session.seal(records.make("lost", legit.ident, reason="r",
                                                           terminated=False)))
        legit.send_exit(0)
        legit.close()
        assert collector.wait_closed(60)
        wait_for(lambda: sum(collector.ignored()[0].values()) == 4, what="4 refusals")
        refused, dropped = collector.ignored()
        assert refused == {"hello: bad MAC": 2, "closed before authenticating": 1,
                           f"first line over {channel.MAX_HELLO_BYTES} bytes": 1}
        assert dropped == {"out of sequence": 1, "bad MAC": 1, "invalid record": 1,
                           "record for another rank than its connection's": 1,
                           f"line over {records.MAX_LINE_BYTES} bytes": 1}
        assert [(r["kind"], r["rank"]) for r in collector.records()] == [
            ("hello", 1), ("stack", 1), ("exit", 1)]
        assert not collector.has_failure() and not collector.lost_cause()


def test_hello_deadline_closes_idle_connections(monkeypatch):
    monkeypatch.setattr(channel, "HELLO_DEADLINE_SECONDS", 0.5)
    with Collector() as collector:
        with socket.create_connection(address(collector)) as sock:
            sock.settimeout(10)
            assert sock.recv(1000).startswith(b'{"kind":"challenge"')
            assert sock.recv(1000) == b""  # closed by the collector (a recv timeout raises)
        assert collector.ignored() == ({"no hello within 0.5 s": 1}, {})
        # a hello that takes too long counts as nothing, not as a lost agent
        assert collector.records() == [] and not collector.has_failure()


def test_send_goes_only_to_authenticated_agents():
    with Collector(ranks=2) as collector:
        stranger = AgentConnection(collector, 0, key=b"x" * 32, welcome=False)
        assert not collector.send(0, records.make("signal", signal="SIGTERM"))
        legit = AgentConnection(collector, 0)
        assert collector.send(0, records.make("signal", signal="SIGUSR1"))
        assert legit.receive() == {"kind": "signal", "signal": "SIGUSR1"}
        stranger.sock.settimeout(5)
        assert stranger.sock.recv(100) == b""  # refused, never a request
        # a second hello for a connected rank is refused
        with pytest.raises((AssertionError, OSError)):
            AgentConnection(collector, 0)
        assert collector.ignored()[0]["hello for a rank already connected"] == 1


def test_agents_beyond_the_ranks_are_refused(monkeypatch):
    monkeypatch.setattr(collector_module, "CONNECTION_MARGIN", 1)
    with Collector(ranks=1) as collector:
        first, second = AgentConnection(collector, 0), AgentConnection(collector, 1)
        with pytest.raises((AssertionError, OSError)):
            AgentConnection(collector, 2)
        assert collector.ignored()[0] == {"more agents than the job's ranks": 1}
        first.close(), second.close()


def test_enrolment_takes_each_rank_once_and_welcomes_them_together():
    """A job's collector: the hello of rank 0 is accepted but its welcome held until rank
    1 has enrolled too; a second hello for rank 0, one for a rank beyond the job, and any
    hello after every rank enrolled (the key is spent) are refused and counted."""
    with Collector(ranks=2, enrolment=60) as collector:
        first = AgentConnection(collector, 0, welcome=False)
        with pytest.raises(TimeoutError):
            first.read(timeout=0.5)  # held
        AgentConnection(collector, 0, welcome=False)
        AgentConnection(collector, 5, welcome=False)
        wait_for(lambda: sum(collector.ignored()[0].values()) == 2, what="2 refusals")
        assert collector.records() == [] and not collector.send(0, records.make("signal", signal="SIGUSR1"))
        second = AgentConnection(collector, 1)
        channel.check_welcome(first.session, first.read())
        wait_for(lambda: len(collector.records("hello")) == 2, what="two hellos")
        assert collector.send(0, records.make("signal", signal="SIGUSR1"))
        assert first.receive() == {"kind": "signal", "signal": "SIGUSR1"}
        for rank in (0, 1, 2):
            late = AgentConnection(collector, rank, welcome=False)
            late.sock.settimeout(5)
            assert late.sock.recv(100) == b""
        assert collector.ignored()[0] == {"hello for a rank already enrolled": 1,
                                          "hello for a rank outside the job": 1,
                                          "hello after enrolment closed": 3}
        first.send_exit(0), second.send_exit(0)
        first.close(), second.close()
        assert collector.wait_closed(60) and not collector.has_failure()


def test_enrolment_closes_after_its_seconds():
    """A rank that never comes: the others are welcomed when the enrolment's seconds are
    over, and the missing rank's hello is refused after that."""
    with Collector(ranks=2, enrolment=1.0) as collector:
        start = time.monotonic()
        first = AgentConnection(collector, 0)  # its welcome comes after about 1 s
        assert 0.5 < time.monotonic() - start
        late = AgentConnection(collector, 1, welcome=False)
        late.sock.settimeout(5)
        assert late.sock.recv(100) == b""
        assert collector.ignored()[0] == {"hello after enrolment closed": 1}
        first.close()


def test_agent_link_ends_its_program_when_the_launcher_goes():
    """The agent's Link calls on_lost when the collector's side of the connection ends
    (the launcher was killed), not when the agent closes it itself."""
    lost = threading.Event()
    with Collector(ranks=1) as collector:
        link = link_module.Link(collector.address, collector.key)
        link.start(records.identity(rank=0, replica=0, pid=1), lambda r: None, lost.set)
        assert link.ready.wait(10) and link.session is not None
        assert not lost.wait(0.3)
    assert lost.wait(10)  # the collector closed every connection
    quiet = threading.Event()
    with Collector(ranks=1) as collector:
        link = link_module.Link(collector.address, collector.key)
        link.start(records.identity(rank=0, replica=0, pid=1), lambda r: None, quiet.set)
        assert link.ready.wait(10) and link.session is not None
        link.close()
        assert collector.wait_closed(60)
    assert not quiet.wait(0.5)


def run_link(collector, rank):
    """A real agent Link (the agent's code) authenticating as ``rank``; its requests."""
    link = link_module.Link(collector.address, collector.key)
    requests = []
    link.start(records.identity(rank=rank, replica=rank, pid=1), requests.append)
    return link, requests


def test_agent_gets_through_a_flood_of_connections():
    """200 idle connections held open, and a stranger opening and closing connections
    as fast as it can: the agent's connection may be pushed out before its welcome, it
    tries again, and it gets through; the collector holds at most
    MAX_PENDING_CONNECTIONS strangers at a time."""
    with Collector(ranks=1) as collector:
        idle = [socket.create_connection(address(collector)) for _ in range(200)]
        stop = threading.Event()

        def flood():
            while not stop.is_set():
                try:
                    socket.create_connection(address(collector)).close()
                except OSError:
                    pass
        threads = [threading.Thread(target=flood, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            link, requests = run_link(collector, 0)
            assert link.ready.wait(link_module.CONNECT_DEADLINE_SECONDS + 5) and link.session is not None
            assert link.send(records.make("stack", records.identity(rank=0, replica=0, pid=1),
                                          request=5, text="x"))
            wait_for(lambda: collector.records("stack"), what="the agent's record")
            assert collector.send(0, records.make("signal", signal="SIGUSR2"))
            wait_for(lambda: requests, what="the request")
            assert requests == [{"kind": "signal", "signal": "SIGUSR2"}]
        finally:
            stop.set()
            for t in threads:
                t.join(5)
        refused, _ = collector.ignored()
        assert refused["closed for a newer unauthenticated connection"] >= 200 - \
            collector_module.MAX_PENDING_CONNECTIONS
        assert len(collector._pending) <= collector_module.MAX_PENDING_CONNECTIONS
        link.close()
        for sock in idle:
            sock.close()


class _Exhausted:
    """The collector's listening socket, whose accept() fails with EMFILE while
    ``failing`` is set; counts the calls."""

    def __init__(self, sock):
        self.sock, self.failing, self.calls = sock, True, 0

    def accept(self):
        self.calls += 1
        if self.failing:
            raise OSError(errno.EMFILE, "Too many open files")
        return self.sock.accept()

    def __getattr__(self, name):
        return getattr(self.sock, name)


def test_out_of_descriptors_backs_off_and_recovers():
    with Collector() as collector:
        idle = socket.create_connection(address(collector))
        wait_for(lambda: len(collector._pending) == 1, what="the idle connection")
        server = collector._server = _Exhausted(collector._server)
        start = time.monotonic()
        waiting = socket.create_connection(address(collector))  # readable listener from now on
        wait_for(lambda: server.calls >= 3, 60, "three accept() calls")
        calls, elapsed = server.calls, time.monotonic() - start
        # without the back-off the loop would call accept() thousands of times a second
        backoff = collector_module.ACCEPT_BACKOFF_SECONDS
        assert elapsed >= 2 * backoff and calls <= 3 * (1 + elapsed / backoff), (calls, elapsed)
        idle.settimeout(5)
        idle.recv(1000)
        assert idle.recv(1000) == b""  # the oldest stranger closed to free a descriptor
        server.failing = False
        waiting.settimeout(10)
        assert waiting.recv(1000).startswith(b'{"kind":"challenge"')  # accepted after all
        assert collector.ignored()[0] == {"closed to free a file descriptor": 1}
        waiting.close()


# ---------------------------------------------------------------- the agent

class FakeLauncher:
    """A server that challenges like the collector but holds ``key`` (the wrong one)."""

    def __init__(self, key):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.key, self.connections = key, 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                sock, _ = self.server.accept()
            except OSError:
                return
            self.connections += 1
            nonce, challenge = channel.challenge()
            sock.sendall(challenge)
            line = read_line(sock, records.LineBuffer(), [], 5) or b""
            try:
                hello = records.decode(line.split(b" ", 2)[-1], ("hello",))
            except ValueError:
                sock.close()
                continue
            session = channel.Session(self.key, nonce, bytes.fromhex(hello["nonce"]), channel.LAUNCHER)
            sock.sendall(channel.welcome(session) + session.seal(records.make("signal", signal="SIGKILL")))
            sock.settimeout(60)
            try:  # until the agent, having refused the welcome, hangs up
                while sock.recv(65536):
                    pass
            except OSError:
                pass
            sock.close()

    @property
    def address(self):
        return "127.0.0.1:%d" % self.server.getsockname()[1]


def test_agent_obeys_only_the_launcher_with_the_key(monkeypatch, capsys):
    monkeypatch.setattr(link_module, "CONNECT_DEADLINE_SECONDS", 1.0)
    fake = FakeLauncher(b"x" * 32)
    link = link_module.Link(fake.address, b"k" * 32)
    requests = []
    link.start(records.identity(rank=0, replica=0, pid=1), requests.append)
    assert link.ready.wait(10)
    assert link.session is None and requests == [] and fake.connections >= 2  # it retried
    assert not link.send(records.make("heartbeat"))
    assert "cannot enrol with the launcher's collector" in capsys.readouterr().err
    fake.server.close()


def test_agent_drops_invalid_requests_and_strips_the_key(tmp_path):
    """A request for a signal not allowed (SIGSTOP) is dropped, a valid one obeyed; the
    program's environment holds no key."""
    ready = tmp_path / "ready"
    code = ("import os, signal, time, pathlib\n"
            "signal.signal(signal.SIGUSR1, lambda *a: os._exit(7))\n"
            f"pathlib.Path({str(ready)!r}).write_text(str({keys.KEY_FILE_ENV!r} in os.environ) + "
            f"str(open('/proc/self/environ', 'rb').read().count(b{keys.KEY_FILE_ENV!r})))\n"
            "time.sleep(60)")
    with Collector(ranks=1) as collector:
        env = {**os.environ, records.COLLECTOR_ENV: collector.address,
               **key_file(collector.key), "PMI_RANK": "0"}
        proc = subprocess.Popen([sys.executable, "-m", "popdist_lite_launcher.node.agent", "--",
                                 sys.executable, "-c", code], env=env, text=True,
                                stderr=subprocess.PIPE)
        try:
            wait_for(lambda: ready.exists() and ready.read_text() and collector.records("hello"),
                     timeout=60, what="the program")
            assert ready.read_text() == "False0"
            assert collector.send(0, {"kind": "signal", "signal": "SIGSTOP"})
            assert collector.send(0, {"kind": "signal", "signal": "SIGUSR1"})
            proc.wait(timeout=60)  # a stopped program would never exit
        finally:
            if proc.poll() is None:
                proc.kill()
            _, err = proc.communicate()
        assert collector.wait_closed(60)
        assert proc.returncode == 7 and collector.records("exit")[0]["exitcode"] == 7
        assert "dropped a line from the launcher (invalid record)" in err
