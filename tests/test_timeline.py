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
    import numpy as np
    import popdist_lite as pl
    pl.init()
    k, r = pl.replica_id(), pl.num_replicas()
    emb = pl.create_host_embedding("chars", shape=[64, 8], optimizer_spec=pl.HostEmbeddingOptimizerSpec(0.1))
    idx = np.arange(3 * k + 2) % 64
    for _ in range(2):
        emb.lookup(idx)
        emb.apply_gradients(idx, np.ones((idx.size, 8), np.float32))
    pl.all_reduce(np.ones(4, np.float32))
    print("done", k, flush=True)
"""


def check_trace(path, replicas):
    trace = json.loads(path.read_text())  # valid JSON
    events = trace["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == set(range(replicas))  # one track per replica
    assert all(e["tid"] == e["pid"] for e in events)
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {k: f"replica {k}" for k in range(replicas)}
    labels = {e["pid"]: e["args"]["labels"] for e in events if e["ph"] == "M" and e["name"] == "process_labels"}
    assert labels == {k: socket.gethostname() for k in range(replicas)}  # the host each ran on
    for e in spans:
        assert e["dur"] >= 0 and e["ts"] >= 0 and e["cat"] in ("collective", "phase")
        assert isinstance(e["args"]["bytes_sent"], int) and isinstance(e["args"]["bytes_received"], int)
    for k in range(replicas):
        mine = {e["name"] for e in spans if e["pid"] == k}
        assert {"lookup", "update", "lookup.ids", "lookup.rows", "update.exchange", "all_reduce"} <= mine
        assert sum(e["name"] == "lookup" for e in spans if e["pid"] == k) == 2
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
