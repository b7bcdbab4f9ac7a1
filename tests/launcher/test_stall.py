"""The stall analysis (pure functions): which call, who waits, who is missing, what the
missing replicas last entered, and the printed block; the launcher's inspector on it
(with a fake transport for the stack requests)."""

import io
import re
import time

from popdist_lite_launcher.supervise.collector import Collector
from popdist_lite.progress import MAX_LANES
from popdist_lite_launcher.supervise.inspector import STACK_WAIT_SECONDS, StallInspector
from popdist_lite_launcher.core.text import stopped_text
from popdist_lite_launcher.supervise.stall import Progress, find_stall, format_stall
from peers import AgentConnection, wait_for

NOW = 1000.0


def p(replica, call, op, ago, **where):
    return Progress(replica=replica, call=call, op=op, since=NOW - ago, **where)


def test_no_stall_when_every_replica_is_in_the_same_call():
    progress = {r: p(r, 7, "all_reduce", 100.0 - r) for r in range(3)}
    assert find_stall(progress, 3, NOW) is None
    assert find_stall({}, 3, NOW) is None


def test_one_replica_behind():
    # replicas 0 and 2 entered call #8; replica 1 is still after call #7
    progress = {0: p(0, 8, "all_reduce", 61.0), 1: p(1, 7, "broadcast", 70.0, rank=1, host="h1", pid=42),
                2: p(2, 8, "all_reduce", 65.0)}
    stall = find_stall(progress, 3, NOW)
    assert (stall.op, stall.call) == ("all_reduce", 8)
    assert stall.waiting == [(0, 61.0), (2, 65.0)]  # in replica order
    assert stall.waited == 65.0
    assert [r for r, _ in stall.missing] == [1]
    assert stall.missing[0][1].op == "broadcast" and stall.missing[0][1].call == 7
    text = format_stall(stall, NOW, {1: [("replica 1", 'File "train.py", line 3 in slow_step\n')]})
    lines = text.splitlines()
    assert lines[0] == ("stall: replicas 0, 2 have waited 65.0 s in all_reduce (collective call #8) "
                        "for replica 1, which did not enter it")
    assert "  waiting: replica 2 for 65.0 s" in lines
    assert "  waiting: replica 0 for 61.0 s" in lines
    assert ("  missing: replica 1 (rank 1, host h1, pid 42): last entered broadcast "
            "(collective call #7) 70.0 s ago") in lines
    assert lines[-2:] == ["  Python stack of replica 1:", '    File "train.py", line 3 in slow_step']


def test_several_missing_in_replica_order_and_never_entered():
    progress = {0: p(0, 12, "all_gather", 5.0), 1: p(1, 11, "all_gather", 6.0)}
    stall = find_stall(progress, 4, NOW)
    assert (stall.op, stall.call) == ("all_gather", 12)
    assert stall.waiting == [(0, 5.0)]
    assert [r for r, _ in stall.missing] == [1, 2, 3]  # 2 and 3 never entered any
    text = format_stall(stall, NOW, {1: [("replica 1", "stack one"), ("feeder 0 of replica 1", "feeder")]},
                        title="root cause: stall")
    assert text.startswith("root cause: stall: replica 0 has waited 5.0 s in all_gather "
                           "(collective call #12) for replicas 1, 2, 3, which did not enter it")
    assert "  missing: replica 2: has not entered any collective" in text
    assert "  Python stack of replica 2: not available" in text
    assert "  Python stack of feeder 0 of replica 1:\n    feeder" in text


def test_a_replica_past_the_others_is_the_waiting_one():
    # a broadcast root may leave the call before the others enter it: it then waits in the next
    progress = {0: p(0, 5, "all_reduce", 3.0), 1: p(1, 3, "all_reduce", 9.0), 2: p(2, 4, "broadcast", 4.0)}
    stall = find_stall(progress, 3, NOW)
    assert stall.call == 5 and [r for r, _ in stall.waiting] == [0]
    assert [r for r, _ in stall.missing] == [1, 2]
    assert stall.key == ("main", 5, (1, 2))


def test_clock_ahead_of_the_launcher_counts_as_no_wait():
    stall = find_stall({0: p(0, 2, "all_reduce", -1.0)}, 2, NOW)
    assert stall.waiting == [(0, 0.0)]


# ---------------------------------------------------------------- the inspector

def progress_record(replica, call, op, received):
    """A progress record as the collector passes it on: ``received`` is the launcher's
    stamp; the rank's own ``since`` is from a host clock a day behind (never used)."""
    return {"kind": "progress", "replica": replica, "rank": replica, "role": "replica", "host": "h",
            "pid": 100 + replica, "call": call, "op": op, "since": received - 86400.0,
            "time": received - 86400.0, "received": received}


def make_inspector(asked, answer=True, **kw):
    processes = {r: [(f"replica {r}", r)] for r in range(3)}
    processes[1].append(("feeder 0 of replica 1", 3))
    out = io.StringIO()
    inspector = StallInspector(3, processes, lambda rank, request: asked.append((rank, request)) or answer,
                               out=out, **kw)
    return inspector, out


def test_inspector_warns_once_with_the_stacks_then_times_out():
    asked = []
    inspector, out = make_inspector(asked, warning=2.0, timeout=5.0)
    for r, call in ((0, 4), (1, 3), (2, 4)):
        inspector.on_progress(progress_record(r, call, "all_reduce", NOW))
    assert inspector.poll(NOW + 1.0) is None and asked == []  # not yet 2 s
    assert inspector.poll(NOW + 2.5) is None
    assert [rank for rank, _ in asked] == [1, 3]  # replica 1 and its feeder
    assert out.getvalue() == ""  # waiting for the stacks
    for rank, request in asked:
        inspector.on_stack({"kind": "stack", "rank": rank, "request": request, "text": f"stack of rank {rank}"})
    assert inspector.poll(NOW + 2.6) is None
    printed = out.getvalue()
    assert printed.startswith("poprun-lite: stall: replicas 0, 2 have waited 2.6 s in all_reduce "
                              "(collective call #4) for replica 1")
    assert "  Python stack of replica 1:\n    stack of rank 1" in printed
    assert "  Python stack of feeder 0 of replica 1:\n    stack of rank 3" in printed
    assert inspector.poll(NOW + 3.0) is None and out.getvalue() == printed  # printed once
    assert inspector.poll(NOW + 5.5) is None  # timeout: asks again, waits for fresh stacks
    assert len(asked) == 4
    block = inspector.poll(NOW + 5.5 + STACK_WAIT_SECONDS)  # they never come
    assert block.startswith("root cause: stall: replicas 0, 2 have waited 8.5 s in all_reduce")
    assert "  Python stack of replica 1: not available" in block


def test_a_timeout_before_the_warning_prints_the_warning_first():
    """The first poll after the stall is already past the timeout (a late poll, a
    timeout close to the warning): the warning block is printed, then the root cause."""
    asked = []
    inspector, out = make_inspector(asked, warning=2.0, timeout=3.0)
    for r, call in ((0, 4), (1, 3), (2, 4)):
        inspector.on_progress(progress_record(r, call, "all_reduce", NOW))
    assert inspector.poll(NOW + 4.0) is None and out.getvalue() == ""  # waiting for the stacks
    for rank, request in asked:
        inspector.on_stack({"kind": "stack", "rank": rank, "request": request, "text": f"stack of rank {rank}"})
    block = inspector.poll(NOW + 4.1)
    assert block.startswith("root cause: stall: replicas 0, 2 have waited 4.1 s in all_reduce")
    printed = out.getvalue()
    assert printed.startswith("poprun-lite: stall: replicas 0, 2 have waited 4.1 s in all_reduce "
                              "(collective call #4) for replica 1")
    assert "  Python stack of replica 1:\n    stack of rank 1" in printed
    assert inspector.poll(NOW + 4.2) is not None and out.getvalue() == printed  # printed once


def test_a_timeout_shorter_than_the_warning_tells_the_block_once():
    """--stall-timeout 5 with the default --stall-warning 60: the warning is never due
    before the end, so only the report's root cause tells the block."""
    asked = []
    inspector, out = make_inspector(asked, warning=60.0, timeout=5.0)
    for r, call in ((0, 4), (1, 3), (2, 4)):
        inspector.on_progress(progress_record(r, call, "all_reduce", NOW))
    assert inspector.poll(NOW + 5.5) is None  # waiting for the stacks
    for rank, request in asked:
        inspector.on_stack({"kind": "stack", "rank": rank, "request": request, "text": f"stack of rank {rank}"})
    block = inspector.poll(NOW + 5.6)
    assert block.startswith("root cause: stall: replicas 0, 2 have waited 5.6 s in all_reduce")
    assert out.getvalue() == ""


def test_lanes_are_compared_apart():
    """Replica 1 stopped before a call on the jax lane while every replica is in step on
    the main lane (its numbers there are higher): the stall is named on the jax lane.
    A replica that never used a lane of its own is not missing there; lanes beyond
    MAX_LANES and replicas outside the job are dropped."""
    asked = []
    inspector, out = make_inspector(asked, warning=2.0, timeout=None)
    for r in range(3):
        inspector.on_progress(progress_record(r, 9, "all_reduce", NOW))
        inspector.on_progress({**progress_record(r, 3, "lookup", NOW), "lane": "jax"})
    inspector.on_progress({**progress_record(0, 4, "lookup", NOW), "lane": "jax"})
    inspector.on_progress({**progress_record(2, 4, "lookup", NOW), "lane": "jax"})
    inspector.on_progress({**progress_record(0, 2, "checkpoint_bcast", NOW), "lane": "checkpoint"})  # 1 and 2 never used it
    for k in range(MAX_LANES):
        inspector.on_progress({**progress_record(0, 99, "forged", NOW), "lane": f"extra{k}"})
    inspector.on_progress(progress_record(7, 99, "forged", NOW))
    assert sorted(inspector._progress) == ["checkpoint", "extra0", "jax", "main"]  # MAX_LANES == 4
    assert inspector.poll(NOW + 2.5) is None and [rank for rank, _ in asked] == [1, 3]
    for rank, request in asked:
        inspector.on_stack({"kind": "stack", "rank": rank, "request": request, "text": f"stack of rank {rank}"})
    assert inspector.poll(NOW + 2.6) is None
    printed = out.getvalue()
    assert printed.startswith("poprun-lite: stall: replicas 0, 2 have waited 2.6 s in lookup "
                              "(collective call #4 on the jax lane) for replica 1, which did not enter it"), printed
    assert "  missing: replica 1 (rank 1, host h, pid 101): last entered lookup (collective call #3 on the jax lane)" \
        in printed
    assert "forged" not in printed and "extra" not in printed


def test_inspector_rearms_after_progress_and_ignores_feeders():
    asked = []
    inspector, out = make_inspector(asked, warning=1.0, answer=False)
    inspector.on_progress(progress_record(0, 1, "broadcast", NOW))
    inspector.on_progress({**progress_record(1, 0, "x", NOW), "role": "feeder"})
    inspector.on_progress(progress_record(2, 1, "broadcast", NOW))
    inspector.on_progress(progress_record(1, 1, "broadcast", NOW + 0.5))  # arrives: no stall
    assert inspector.poll(NOW + 10) is None and asked == [] and out.getvalue() == ""
    inspector.on_progress(progress_record(1, 0, "broadcast", NOW))  # an older record changes nothing
    assert inspector.poll(NOW + 10) is None and asked == []


def test_inspector_off_without_thresholds():
    asked = []
    inspector, out = make_inspector(asked, warning=0, timeout=None)
    inspector.on_progress(progress_record(0, 9, "all_gather", NOW))
    assert inspector.poll(NOW + 1e6) is None and asked == [] and out.getvalue() == ""


def test_same_call_number_different_operations():
    # replica 1 skipped broadcast #5 and entered all_reduce as its #5 (checks off)
    progress = {0: p(0, 5, "broadcast", 30.0), 1: p(1, 5, "all_reduce", 29.0), 2: p(2, 5, "broadcast", 28.0)}
    stall = find_stall(progress, 3, NOW)
    assert (stall.op, stall.call) == ("broadcast", 5)
    assert [r for r, _ in stall.waiting] == [0, 2] and [r for r, _ in stall.missing] == [1]
    assert ("  missing: replica 1: entered all_reduce as collective call #5 instead 29.0 s ago "
            "(a replica skipped or added a collective)") in format_stall(stall, NOW)
    # two replicas, a tie: the group with replica 0 waits
    stall = find_stall({0: p(0, 1, "broadcast", 3.0), 1: p(1, 1, "all_reduce", 3.0)}, 2, NOW)
    assert stall.op == "broadcast" and [r for r, _ in stall.missing] == [1]


def test_a_stopped_replica_reads_stopped_instead_of_a_stack():
    stall = find_stall({0: p(0, 3, "all_reduce", 4.0), 1: p(1, 2, "broadcast", 5.0)}, 3, NOW)
    text = format_stall(stall, NOW, {1: [("replica 1", stopped_text("T")),
                                         ("feeder 0 of replica 1", "feeder stack")]})
    assert "  Python stack of replica 1: not available, stopped (state T)" in text.splitlines()
    assert "  Python stack of feeder 0 of replica 1:\n    feeder stack" in text
    assert "  Python stack of replica 2: not available" in text.splitlines()


def test_wait_is_measured_on_the_launchers_clock_not_a_hosts():
    """Through the real channel: replica 0's host is 300 s behind the launcher and says it
    entered all_reduce #2 at its own time.time(), just now; replica 1 is still in
    broadcast #1. The wait counts from the launcher's receipt: the warning block reads
    well under a minute (not 300 s), and --stall-timeout 120 does not end the job."""
    asked, out = [], io.StringIO()
    processes = {r: [(f"replica {r}", r)] for r in range(2)}
    ask = lambda rank, request: asked.append((rank, request)) or False  # noqa: E731
    warner = StallInspector(2, processes, ask, warning=1e-6, timeout=None, out=out)
    ender = StallInspector(2, processes, ask, warning=None, timeout=120.0, out=out)
    with Collector(ranks=2) as collector:
        seen = []
        for callback in (warner.on_progress, ender.on_progress, seen.append):
            collector.subscribe("progress", callback)
        agents = [AgentConnection(collector, rank) for rank in range(2)]
        behind = time.time() - 300.0
        agents[0].ident["time"] = behind
        agents[0].send("progress", lane="main", call=2, op="all_reduce", since=behind)
        agents[1].send("progress", lane="main", call=1, op="broadcast", since=time.time())
        wait_for(lambda: len(seen) == 2, what="both progress records")
        assert ender.poll() is None and asked == []
        assert warner.poll() is None  # prints the warning block
        for agent_connection in agents:
            agent_connection.close()
    waited = re.search(r"replica 0 has waited ([0-9.]+) s in all_reduce \(collective call #2\) "
                       r"for replica 1", out.getvalue())
    assert waited and float(waited.group(1)) < 60.0, out.getvalue()
