"""The timeline (one Chrome-trace JSON, one track per replica) under plain mpirun with
POPDIST_LITE_TIMELINE and through ``poprun-lite --timeline``; the counters in one process."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import popdist_lite as pl
from popdist_lite import counters
from helpers import JOB_SECONDS, ROOT, run_mpi, timeout_for

pytestmark = timeout_for(1)

PROGRAM = """
    import threading
    import numpy as np
    import popdist_lite as pl
    pl.init()
    k, r = pl.replica_id(), pl.num_replicas()
    emb = pl.create_host_embedding("chars", shape=[64, 8], optimizer_spec=pl.HostEmbeddingOptimizerSpec(0.1))

    @pl.timeline.span("forward")
    def forward(idx):
        return emb.lookup(idx)

    for step in range(2):
        pl.timeline.step(step)
        with pl.timeline.span("data"):
            idx = np.arange(3 * k + 2) % 64
        forward(idx)
        emb.apply_gradients(idx, np.ones((idx.size, 8), np.float32))
    with pl.timeline.step(2):
        pl.all_reduce(np.ones(4, np.float32))
    loader = threading.Thread(target=pl.timeline.span("load")(lambda: None), name="loader")
    loader.start()
    loader.join()
    print("done", k, flush=True)
"""


def within(inner, outer) -> bool:
    # to 1 us: a timestamp in wall-clock microseconds (~1.7e15) is exact to 0.25 us before the shift to 0
    return outer["ts"] - 1 <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1


def check_trace(path, replicas):
    trace = json.loads(path.read_text())  # valid JSON
    events = trace["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == set(range(replicas))  # one track per replica
    # the main thread's events on the replica's track, the loader thread's span on its own
    assert all(e["tid"] == e["pid"] for e in events if e["name"] != "load" and "loader" not in str(e["args"]))
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {k: f"replica {k}" for k in range(replicas)}
    labels = {e["pid"]: e["args"]["labels"] for e in events if e["ph"] == "M" and e["name"] == "process_labels"}
    assert labels == {k: socket.gethostname() for k in range(replicas)}  # the host each ran on
    for e in spans:
        assert e["dur"] >= 0 and e["ts"] >= 0 and e["cat"] in ("collective", "phase", "step", "span")
        if e["cat"] in ("collective", "phase"):
            assert isinstance(e["args"]["bytes_sent"], int) and isinstance(e["args"]["bytes_received"], int)
    for k in range(replicas):
        mine = [e for e in spans if e["pid"] == k]
        assert {"lookup", "update", "lookup.ids", "lookup.rows", "update.exchange", "all_reduce"} <= {
            e["name"] for e in mine}
        assert sum(e["name"] == "lookup" for e in mine) == 2
        # the user's steps and spans, on the same track, the library's events nested in them
        steps = sorted((e for e in mine if e["cat"] == "step"), key=lambda e: e["ts"])
        assert [(e["name"], e["args"]) for e in steps] == [(f"step {n}", {"step": n}) for n in range(3)]
        assert steps[0]["ts"] + steps[0]["dur"] == pytest.approx(steps[1]["ts"], abs=1)  # one ends, the next starts (us)
        for name in ("data", "forward"):
            user = [e for e in mine if e["cat"] == "span" and e["name"] == name]
            assert len(user) == 2 and all(within(u, s) for u, s in zip(sorted(user, key=lambda e: e["ts"]), steps))
        lookups = sorted((e for e in mine if e["name"] == "lookup"), key=lambda e: e["ts"])
        forwards = sorted((e for e in mine if e["name"] == "forward"), key=lambda e: e["ts"])
        assert all(within(lookup, f) for lookup, f in zip(lookups, forwards))
        assert all(any(within(u, s) for s in steps) for u in mine if u["name"] in ("update", "all_reduce"))
        [load] = [e for e in mine if e["name"] == "load"]
        assert load["tid"] != k and {"name": "thread_name", "ph": "M", "pid": k, "tid": load["tid"],
                                     "args": {"name": f"replica {k}: loader"}} in events
    sent = sum(e["args"]["bytes_sent"] for e in spans if e["cat"] == "collective")
    received = sum(e["args"]["bytes_received"] for e in spans if e["cat"] == "collective")
    assert sent == received and (sent > 0) == (replicas > 1)
    return trace


@pytest.mark.parametrize("ranks", [1, 3])
def test_timeline_under_plain_mpirun(tmp_path, ranks):
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(PROGRAM))
    out = tmp_path / "trace.json"
    result = run_mpi(ranks, [sys.executable, str(script)], env={"POPDIST_LITE_TIMELINE": str(out)})
    assert result.returncode == 0, result.stderr[-3000:]
    check_trace(out, ranks)
    assert not list(tmp_path.glob("*.tmp"))


def test_timeline_through_poprun_lite(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(PROGRAM))
    out = tmp_path / "sub" / "trace.json"
    out.parent.mkdir()
    result = subprocess.run([sys.executable, "-m", "popdist_lite_launcher", "--timeout", str(JOB_SECONDS), "--num-replicas", "2",
                             "--timeline", str(out), sys.executable, str(script)],
                            capture_output=True, text=True, timeout=JOB_SECONDS + 60, cwd=ROOT,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"timeline written to {out}" in result.stderr
    check_trace(out, 2)


def test_timeline_is_off_by_default_and_counters_count_in_one_process():
    pl.init()
    assert counters.events is None  # off: record() only checks this
    pl.reset_stats()
    pl.all_gather(np.ones(3, np.float32))
    out = np.empty((1, 3), np.float32)
    assert pl.all_gather(np.ones(3, np.float32), out=out) is out
    s = pl.stats()
    assert s["collectives"]["all_gather"]["calls"] == 2
    assert s["collectives"]["agree"]["calls"] == 2
    assert s["bytes_sent"] == s["bytes_received"] == 0  # nothing leaves a single replica
    assert s["collectives"]["all_gather"]["seconds"] >= 0
    with pytest.raises(ValueError, match=r"argument out: expected a writeable C-contiguous float32\[1, 3\] array"):
        pl.all_gather(np.ones(3, np.float32), out=np.empty((2, 3), np.float32))
    pl.reset_stats()
    assert pl.stats() == {"bytes_sent": 0, "bytes_received": 0, "seconds": 0.0, "collectives": {}, "phases": {}}


def test_merge_shifts_time_and_keeps_tracks():
    from popdist_lite import timeline
    parts = [timeline.chrome_events([("all_gather", "collective", 10.0, 0.5, 8, 8, None)], k, (1e6 * k, 0.0))
             for k in range(2)]
    trace = timeline.merge(parts)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["pid"] for e in spans] == [0, 1] and min(e["ts"] for e in spans) == 0
    assert spans[0]["dur"] == 0.5e6 and spans[1]["ts"] == 1e6
    json.dumps(trace)


def test_write_follows_no_symlink(tmp_path):
    """A neighbour who plants symlinks at the temporary name the writer used to take
    (``<path>.<pid>.tmp``) and at the path itself changes nothing but the path: the
    trace lands in a new file, the symlinks' targets are untouched."""
    from popdist_lite import timeline
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = tmp_path / "trace.json"
    os.symlink(victim, f"{path}.{os.getpid()}.tmp")
    trace = timeline.merge([timeline.chrome_events([("all_reduce", "collective", 1.0, 0.5, 8, 8, None)],
                                                   0, (0.0, 0.0))])
    timeline.write(str(path), trace)
    assert victim.read_text() == "precious" and json.loads(path.read_text()) == trace
    os.unlink(path)
    os.symlink(victim, path)  # a symlink at the path itself is replaced, not written through
    timeline.write(str(path), trace)
    assert victim.read_text() == "precious" and not path.is_symlink()
    assert json.loads(path.read_text()) == trace
    assert sorted(os.listdir(tmp_path)) == sorted(["victim", "trace.json", f"trace.json.{os.getpid()}.tmp"])


def test_write_leaves_no_temporary_file_on_failure(tmp_path):
    from popdist_lite import timeline
    with pytest.raises(TypeError):
        timeline.write(str(tmp_path / "trace.json"), {"not json": object()})
    assert os.listdir(tmp_path) == []


@pytest.fixture
def recording(monkeypatch):
    """The timeline on in this process without its exit gather: events into a fresh list."""
    from popdist_lite import timeline
    monkeypatch.setattr(counters, "events", [])
    monkeypatch.setitem(timeline._state, "anchor", (0.0, 0.0))
    monkeypatch.setattr(timeline, "_step", [None])
    return counters.events


def test_spans_and_steps_in_one_process(recording):
    from popdist_lite import timeline

    @timeline.span("fib")
    def fib(n):  # a decorated function: a fresh span per call, recursion included
        return n if n < 2 else fib(n - 1) + fib(n - 2)

    timeline.step(0)
    with timeline.span("data"):
        pass
    assert fib(3) == 2
    with pytest.raises(KeyError):
        with timeline.span("failing"):
            raise KeyError("the span still ends")
    timeline.step(1)
    with timeline.step(2):
        pass
    timeline.step(3)
    with timeline.span("last"):
        pass
    recorded = [e[:2] for e in recording]
    assert recorded == [("data", "span")] + [("fib", "span")] * 5 + [
        ("failing", "span"), ("step 0", "step"), ("step 1", "step"), ("step 2", "step"), ("last", "span")]
    events = timeline.drain(final=True)  # step 3 ends with the last event recorded in it
    assert counters.events == [] and timeline.drain() == []
    by_name = {e["name"]: e for e in events}
    assert by_name["step 3"]["ts"] + by_name["step 3"]["dur"] == pytest.approx(
        by_name["last"]["ts"] + by_name["last"]["dur"])
    assert all(e["ph"] == "X" and e["pid"] == e["tid"] == 0 for e in events)
    fibs = [e for e in events if e["name"] == "fib"]
    outer = max(fibs, key=lambda e: e["dur"])
    assert all(within(e, outer) for e in fibs) and within(outer, by_name["step 0"])


def test_spans_are_free_of_records_when_off_and_check_their_arguments():
    from popdist_lite import timeline
    assert counters.events is None
    with timeline.span("data"):
        pass
    assert timeline.step(5).number == 5 and counters.events is None
    with pytest.raises(TypeError, match="timeline.span: argument name: expected a str, got int"):
        timeline.span(3)
    with pytest.raises(TypeError, match="timeline.step: argument number: expected an int, got str"):
        timeline.step("7")
    assert pl.timeline is timeline
