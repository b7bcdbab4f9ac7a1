"""The resize request's path (docs/elastic.md): launcher -> agent (``resize_request``,
authenticated) -> program (one byte on the socket pair) -> ``should_checkpoint`` ->
``resize_stop`` record -> agent (stamped with its identity) -> launcher; and a
``resize_stop`` the launcher did not ask for, which fails the attempt naming its sender.
Every process runs under a timeout."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest
from helpers import JOB_SECONDS, timeout_for
from peers import key_file, wait_for

from popdist_lite import records
from popdist_lite_launcher.core import channel
from popdist_lite_launcher.supervise.collector import Collector

LAUNCHER = [sys.executable, "-m", "popdist_lite_launcher"]


def test_the_program_socket_carries_acks_and_the_resize_byte(monkeypatch):
    """records.send counts only ACK bytes as acknowledgements, and a RESIZE byte among
    them (before, between or after) is remembered for resize_requested."""
    ours, theirs = socket.socketpair()
    monkeypatch.setenv(records.RECORD_FD_ENV, str(theirs.fileno()))
    monkeypatch.setitem(records._channel, "fd", None)
    monkeypatch.setitem(records._channel, "resize", False)
    try:
        assert records.resize_requested() is False
        ours.sendall(records.ACK)  # an early ACK, no resize yet
        assert records.resize_requested() is False
        ours.sendall(records.ACK + records.RESIZE)  # the second send's ACK, then RESIZE
        assert records.send(records.make("heartbeat"), timeout=5) is True
        assert records.send(records.make("heartbeat"), timeout=0.5) is True
        assert records.resize_requested() is True
        # a third record gets no ACK: not confirmed, and the RESIZE byte was not taken for one
        assert records.send(records.make("heartbeat"), timeout=0.3) is False
        assert records.resize_requested() is True  # sticky
        lines = ours.recv(4096).split(b"\n")
        assert [records.decode(line)["kind"] for line in lines if line] == ["heartbeat"] * 3
    finally:
        ours.close()
        theirs.close()
        records._channel["sock"] = None


PROGRAM = """
import os, sys, time
import popdist_lite as pl
from popdist_lite import records
before = records.resize_requested()
print("READY", flush=True)
for _ in range(6000):  # a count of polls, not a clock
    if pl.should_checkpoint():
        break
    time.sleep(0.05)
else:
    sys.exit("no resize request after 6000 polls")
print("ASKED", before, pl.should_checkpoint(), flush=True)
"""


@timeout_for(1)
def test_resize_request_reaches_should_checkpoint_and_resize_stop_comes_back():
    with Collector(ranks=1) as collector:
        env = {**os.environ, records.COLLECTOR_ENV: collector.address,
               **key_file(collector.key), "PMI_RANK": "0",
               "POPDIST_REPLICA_INDEX_OFFSET": "0", "POPDIST_LITE_ROLE": "replica"}
        proc = subprocess.Popen([sys.executable, "-m", "popdist_lite_launcher.node.agent", "--",
                                 sys.executable, "-c", PROGRAM], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert proc.stdout.readline().strip() == "READY"
            wait_for(lambda: collector.records("hello"), timeout=JOB_SECONDS, what="the agent's hello")
            assert collector.send(0, records.make("resize_request", replicas=4))
            out, err = proc.communicate(timeout=JOB_SECONDS)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert collector.wait_closed(60)
        assert proc.returncode == 0, err
        assert out.strip() == "ASKED False True"  # not asked before the request; sticky after
        [stop] = collector.records("resize_stop")
        [hello] = collector.records("hello")
        assert {k: stop[k] for k in ("rank", "replica", "role", "host", "pid")} == \
            {k: hello[k] for k in ("rank", "replica", "role", "host", "pid")}
        assert collector.records("exit")[0]["exitcode"] == 0


def test_should_checkpoint_is_false_outside_poprun_lite():
    proc = subprocess.run([sys.executable, "-c", "import popdist_lite as pl; print(pl.should_checkpoint())"],
                          capture_output=True, text=True, timeout=JOB_SECONDS,
                          env={k: v for k, v in os.environ.items()
                               if not k.startswith(("POPDIST", "OMPI_", "PMIX_", "PMI_", "POPRUN"))})
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr


UNASKED = """
import os, sys
from popdist_lite import records
with open(sys.argv[1], "a") as f:
    f.write(os.environ["POPDIST_LITE_RESTART_COUNT"] + "\\n")
assert records.send(records.make("resize_stop", records.identity(rank=0, replica=0, pid=os.getpid())),
                    timeout=60)
"""


@timeout_for(1)
@pytest.mark.parametrize("elastic", [True, False], ids=["elastic", "fixed"])
def test_a_resize_stop_nobody_asked_for_is_a_failure_of_its_sender(tmp_path, elastic):
    """A program that sends resize_stop without a resize_request and exits 0: one attempt
    (--max-restarts 0), exit code 1, the report names the replica that sent it."""
    prog = tmp_path / "prog.py"
    prog.write_text(UNASKED)
    log = tmp_path / "log"
    proc = subprocess.run([*LAUNCHER, "--num-replicas", "1", *(["--min-replicas", "1"] if elastic else []),
                           "--max-restarts", "0", "--timeout", str(JOB_SECONDS), sys.executable, str(prog),
                           str(log)], capture_output=True, text=True, timeout=JOB_SECONDS + 60,
                          stdin=subprocess.DEVNULL)
    assert log.read_text() == "0\n", proc.stderr  # one attempt
    assert proc.returncode == 1, proc.stderr
    sender = r"replica 0 \(rank 0, host \S+, pid \d+\)"
    assert re.search(rf"poprun-lite: job failed \(exit code 1\)\nroot cause: {sender} sent resize_stop, but "
                     rf"poprun-lite asked for no resize in this attempt\nattempts:\n  attempt 1: 1 replica on "
                     rf"this host \(1\); failed: {sender} sent resize_stop unasked \(exit code 1\)$",
                     proc.stderr.rstrip()), proc.stderr
