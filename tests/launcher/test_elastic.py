"""Elastic jobs on one host (docs/elastic.md): the sizing of attempts, the words of the
membership report, the resize decision, and poprun-lite --min-replicas end to end: a grow
asked through should_checkpoint (not counted against --max-restarts), a shrink after a
failure, the attempts in the report, the options' checks. Multi-host shrink and grow are
in tests/multihost/test_hosts_elastic.py. Every process runs under a timeout."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import JOB_SECONDS, timeout_for
from popdist_lite_launcher import cli
from popdist_lite_launcher.attempts import AttemptRecord, format_attempts
from popdist_lite_launcher.core.api import Membership
from popdist_lite_launcher.core.plan import capacity, plan_ranks
from popdist_lite_launcher.membership import elastic
from popdist_lite_launcher.membership.discovery import DiscoveryError
from popdist_lite_launcher.membership.elastic import Cluster, change, resize_reason, size_attempt, wait_for_membership
from popdist_lite_launcher.membership.resize import ResizeMonitor

LAUNCHER = [sys.executable, "-m", "popdist_lite_launcher"]


# ---------------------------------------------------------------- sizing (pure)

def reference_size(available, max_replicas, feeders):
    """One replica at a time: the first host, in order, with room for a replica and its
    feeders that it has not filled yet."""
    used = {}
    for _ in range(max_replicas):
        for host, slots in available:
            room = 1 if slots is None else slots // (1 + feeders)
            if used.get(host, 0) < room:
                used[host] = used.get(host, 0) + 1
                break
        else:
            break
    # rank order: hosts in discovery order, a block each
    return [(host, used[host]) for host, _ in available if used.get(host)]


hosts_lists = st.lists(st.tuples(st.sampled_from([f"h{i}" for i in range(8)]),
                                 st.none() | st.integers(1, 9)), max_size=6, unique_by=lambda h: h[0])


@settings(max_examples=300, deadline=None)
@given(hosts_lists, st.integers(1, 12), st.integers(0, 3))
def test_size_attempt_fills_hosts_in_order(available, max_replicas, feeders):
    got = size_attempt(available, max_replicas, feeders)
    assert list(got.hosts) == reference_size(available, max_replicas, feeders)
    assert got.replicas <= max_replicas


def test_capacity_and_describe():
    assert capacity(None, 2) == 1 and capacity(4, 0) == 4 and capacity(4, 1) == 2 and capacity(5, 1) == 2
    assert capacity(1, 1) == 0  # no room for a replica and its feeder
    assert size_attempt([("a", 2), ("b", 2)], 4, 0).describe() == "4 replicas on a (2), b (2)"
    assert size_attempt([("a", 2), ("b", 2)], 3, 0).describe() == "3 replicas on a (2), b (1)"
    assert Membership(((None, 1),)).describe() == "1 replica on this host (1)"


def test_change_in_words():
    four = Membership((("a", 2), ("b", 2)))
    two = Membership((("a", 2),))
    assert change(four, two) == "host b lost" and change(two, four) == "host b added"
    assert change(four, Membership((("a", 2), ("c", 2)))) == "host b lost; host c added"
    assert change(Membership(((None, 2),)), Membership(((None, 4),))) == "more replicas on this host"
    assert change(four, four) == ""


def test_resize_reason():
    two = Membership((("a", 2),))
    assert resize_reason(two, size_attempt([("a", 2), ("b", 2)], 4, 0), [("a", 2), ("b", 2)], 0) == "host b added"
    assert resize_reason(two, two, [("a", 2)], 0) is None  # nothing new
    full = Membership((("a", 2), ("b", 2)))
    assert resize_reason(full, full, [("a", 2), ("b", 2), ("c", 2)], 0) is None  # at --num-replicas already
    assert resize_reason(full, two, [("a", 2)], 0) == "host b no longer discovered"
    assert resize_reason(full, full, [("a", 2), ("b", 1)], 0) == "host b now with fewer slots"


def test_format_attempts():
    history = [AttemptRecord(1, Membership((("a", 2), ("b", 2))), outcome="host b lost: replica 2: lost"),
               AttemptRecord(2, Membership((("a", 2),)), "host b lost", "stopped at a step boundary for a resize"),
               AttemptRecord(3, Membership((("a", 2), ("b", 2))), "host b added", "succeeded")]
    assert format_attempts(history) == (
        "attempts:\n"
        "  attempt 1: 4 replicas on a (2), b (2); host b lost: replica 2: lost\n"
        "  attempt 2: 2 replicas on a (2), after host b lost; stopped at a step boundary for a resize\n"
        "  attempt 3: 4 replicas on a (2), b (2), after host b added; succeeded")


def test_plan_ranks_on_a_membership():
    opts = cli.parse_args(["--num-replicas", "4", "--min-replicas", "2", "--feeders-per-replica", "1",
                           "-H", "a:4,b:4", "prog"])
    ranks = plan_ranks(opts, 3, Membership((("a", 2), ("b", 1))))
    assert [(s.role, s.replica, s.host) for s in ranks] == [
        ("replica", 0, "a"), ("replica", 1, "a"), ("replica", 2, "b"),
        ("feeder", 0, "a"), ("feeder", 1, "a"), ("feeder", 2, "b")]
    assert [s.env["POPDIST_LOCAL_INSTANCE_INDEX"] for s in ranks[:3]] == ["0", "1", "0"]
    assert {s.env["POPDIST_NUM_TOTAL_REPLICAS"] for s in ranks} == {"3"}
    assert {s.env["POPDIST_LITE_RESTART_COUNT"] for s in ranks} == {"3"}


@pytest.mark.parametrize("args, message", [
    (["--num-replicas", "2", "--min-replicas", "3"], "--min-replicas 3 is more than --num-replicas 2"),
    (["--num-replicas", "2", "--host-discovery-script", "d", "-H", "a"], "exclude each other"),
])
def test_option_checks(args, message):
    proc = subprocess.run([*LAUNCHER, *args, "true"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_without_min_replicas_the_size_is_fixed():
    opts = cli.parse_args(["--num-replicas", "4", "--host-discovery-script", "d", "prog"])
    assert opts.elastic and opts.min_replicas == 4
    assert not cli.parse_args(["--num-replicas", "4", "prog"]).elastic


class FakeCluster(Cluster):
    """A cluster whose discovery returns the next of ``answers`` (a list of hosts, or an
    exception to raise) and whose probe fails the hosts in ``down``."""

    def __init__(self, answers, down=(), **options):
        opts = cli.parse_args(["--num-replicas", "4", "--min-replicas", "2", "--host-discovery-script", "d",
                               "--discovery-interval", "0.1", "--elastic-timeout", "1", "prog"])
        super().__init__(dataclasses.replace(opts, **options))
        self.answers, self.down, self.probed = list(answers), set(down), []

    def discover(self):
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def usable(self, available, trusted=(), unreachable=None):
        self.probed.append([h for h, _ in available if h not in trusted])
        problems = {h: f"host {h} cannot connect" for h, _ in available if h in self.down and h not in trusted}
        return [(h, s) for h, s in available if h not in problems], problems


def test_monitor_asks_every_replica_once_more_slots_are_usable():
    two = Membership((("a", 2),))
    cluster = FakeCluster([[("a", 2)], [("a", 2), ("b", 2)]], down={"b"})
    sent, said = [], []
    reach = {0}  # replica 1's agent is not connected yet
    monitor = ResizeMonitor(cluster, two, lambda rank, record: (sent.append((rank, record)), rank in reach)[1],
                            say=said.append)
    monitor.check()                      # only a, as before: nothing
    assert monitor.reason is None and not sent and cluster.probed == [[]]  # a is the attempt's: not probed
    monitor.check()                      # b listed, but its probe fails: nothing
    assert monitor.reason is None and not sent and cluster.probed[-1] == ["b"]
    cluster.down.clear()
    monitor.check()                      # b usable: ask both replicas
    assert monitor.reason == "host b added" and monitor.target.replicas == 4
    assert said == ["asking the replicas to checkpoint and stop for a resize to 4 replicas on a (2), b (2) "
                    "(host b added)"]
    assert sent == [(0, {"kind": "resize_request", "replicas": 4}), (1, {"kind": "resize_request", "replicas": 4})]
    reach.add(1)
    monitor.check()                      # again to the one not reached
    assert sent[2:] == [(1, {"kind": "resize_request", "replicas": 4})] and monitor.request.sent == {0, 1}
    monitor.check()
    assert len(sent) == 3 and len(said) == 1


def test_monitor_keeps_the_membership_on_discovery_errors():
    said = []
    cluster = FakeCluster([DiscoveryError("script d exited with code 1"), DiscoveryError("script d exited with code 1"),
                           [("a", 2)]])
    monitor = ResizeMonitor(cluster, Membership((("a", 2),)), lambda rank, record: True, say=said.append)
    for _ in range(3):
        monitor.check()
    assert monitor.reason is None
    assert said == ["host discovery failed during the attempt (membership kept): script d exited with code 1"]


class FakeClock:
    """elastic's ``time``: a monotonic clock that only ``sleep`` moves, so a wait's polls
    are counted, not timed."""

    def __init__(self):
        self.now, self.sleeps = 1000.0, []

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


def test_wait_for_membership_says_what_it_waits_for_and_gives_up(monkeypatch):
    said = []
    clock = FakeClock()
    monkeypatch.setattr(elastic, "time", clock)
    cluster = FakeCluster([[("a", 1)], DiscoveryError("script d: still running after 10 s (killed)"),
                           [("a", 1), ("b", 1)]], down={"b"})
    got = wait_for_membership(cluster, None, say=said.append)
    assert got.code == 1 and got.text == "fewer than --min-replicas 2 replicas usable for --elastic-timeout 1 s"
    # polled every --discovery-interval 0.1 s until --elastic-timeout 1 s had passed; one
    # check met the discovery error, each other one probed b
    assert clock.now == pytest.approx(1001.0) and len(clock.sleeps) >= 10
    assert all(0 <= s <= 0.1 + 1e-9 for s in clock.sleeps) and len(cluster.probed) == len(clock.sleeps)
    assert said == ["waiting for hosts: 1 replica on a (1) usable, --min-replicas 2",
                    "waiting for hosts: no replicas usable, --min-replicas 2\n"
                    "  script d: still running after 10 s (killed)",
                    "waiting for hosts: 1 replica on a (1) usable, --min-replicas 2\n  host b cannot connect"]
    cluster.down.clear()
    assert wait_for_membership(cluster, None, say=said.append) == Membership((("a", 1), ("b", 1)))


# ---------------------------------------------------------------- end to end, one host

PROGRAM = """
import os, sys, time
import numpy as np
import popdist_lite as pl
pl.init()
attempt, r, n = int(os.environ["POPDIST_LITE_RESTART_COUNT"]), pl.replica_id(), pl.num_replicas()
hosts, mode = sys.argv[1], sys.argv[2]
POLLS = 6000  # a count, not a clock: every replica gives up at the same call
for step in range(8):
    pl.all_reduce(np.ones(2))
    if attempt == 0 and step == 3:
        if r == 0:
            with open(hosts, "w") as f:
                f.write("localhost:4\\n" if mode == "grow" else "localhost:2\\n")
            if mode == "shrink":
                raise RuntimeError("replica 0 fails")
        if mode == "grow":  # hold at this step boundary until the launcher asks for the resize
            for _ in range(POLLS):
                if pl.should_checkpoint():
                    break
                time.sleep(0.05)
            else:
                raise SystemExit(f"replica {r}: no resize asked after {POLLS} polls")
    if pl.should_checkpoint():
        print(f"attempt {attempt}: replica {r} of {n} stops at step {step}", flush=True)
        sys.exit(0)
print(f"attempt {attempt}: replica {r} of {n} done", flush=True)
"""


def elastic_job(tmp_path, mode, first_hosts, *args):
    (tmp_path / "hosts").write_text(first_hosts)
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/usr/bin/env bash\ncat {tmp_path / 'hosts'}\n")
    discover.chmod(0o755)
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    return subprocess.run([*LAUNCHER, "--num-replicas", "4", "--min-replicas", "2", "--host-discovery-script",
                           str(discover), "--discovery-interval", "0.5", "--timeout", str(JOB_SECONDS), *args,
                           sys.executable, str(prog), str(tmp_path / "hosts"), mode],
                          capture_output=True, text=True, timeout=JOB_SECONDS + 60, stdin=subprocess.DEVNULL)


@timeout_for(1)
def test_grow_is_asked_for_and_not_counted(tmp_path):
    """2 replicas; discovery then offers 4 slots while the replicas wait at step 3 for
    the request: every replica's should_checkpoint() answers True at the same call, the
    attempt ends cleanly and the next runs 4 replicas (with --max-restarts 0: a grow is
    not a failure)."""
    proc = elastic_job(tmp_path, "grow", "localhost:2\n")
    assert proc.returncode == 0, proc.stderr
    lines = sorted(proc.stdout.splitlines())
    stops = [line for line in lines if line.startswith("attempt 0")]
    assert stops == [f"attempt 0: replica {r} of 2 stops at step 3" for r in range(2)], stops
    assert [line for line in lines if line.startswith("attempt 1")] == [
        f"attempt 1: replica {r} of 4 done" for r in range(4)]
    err = proc.stderr
    assert "poprun-lite: attempt 1: 2 replicas on this host (2)\n" in err
    assert "asking the replicas to checkpoint and stop for a resize to 4 replicas on this host (4)" in err
    assert "poprun-lite: job succeeded on attempt 2; attempts:\n" \
           "  attempt 1: 2 replicas on this host (2); stopped at a step boundary for a resize " \
           "(more replicas on this host)\n" \
           "  attempt 2: 4 replicas on this host (4), after more replicas on this host; succeeded" in err


@timeout_for(2)
def test_shrink_after_a_failure_counts_it(tmp_path):
    """4 replicas; replica 0 fails and discovery now offers 2 slots: the next attempt runs
    2 replicas; the failure counts against --max-restarts (with 0 the job ends there)."""
    proc = elastic_job(tmp_path, "shrink", "localhost:4\n", "--max-restarts", "1")
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [f"attempt 1: replica {r} of 2 done" for r in range(2)]
    err = proc.stderr
    assert "poprun-lite: attempt 1 failed (exit code 1)" in err and "RuntimeError: replica 0 fails" in err
    assert "  attempt 2: 2 replicas on this host (2), after a failure; succeeded" in err

    proc = elastic_job(tmp_path, "shrink", "localhost:4\n", "--max-restarts", "0")
    assert proc.returncode == 1, proc.stderr
    assert "poprun-lite: job failed (exit code 1)" in proc.stderr
    assert re.search(r"attempts:\n  attempt 1: 4 replicas on this host \(4\); failed: replica 0 \(rank 0, "
                     r"host \S+, pid \d+\): exit code 1\nlog \(", proc.stderr.rstrip()), proc.stderr
