"""Unit tests of the failure report (synthetic records) and of the record writers
(``popdist_lite._excepthook`` and the agent), without MPI."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from popdist_lite_launcher import agent, report

TB = 'Traceback (most recent call last):\n  File "t.py", line 3, in <module>\n    1 / 0\n' \
     "ZeroDivisionError: division by zero\n"


def exit_rec(rank, t, *, code=None, sig=None, terminated=False, tail="", role="replica"):
    return {"kind": "exit", "rank": rank, "replica": rank, "role": role, "host": "h",
            "pid": 100 + rank, "time": t, "exitcode": code, "signal": sig,
            "stderr_tail": tail, "terminated": terminated}


def error_rec(rank, t, exc="ZeroDivisionError", msg="division by zero", tb=TB):
    return {"kind": "error", "rank": rank, "replica": rank, "role": "replica", "host": "h",
            "pid": 100 + rank, "time": t, "exception": exc, "message": msg, "traceback": tb}


def make(records, code=None, **kw):
    failures = report.merge_records(records)
    code = report.exit_code_for(failures, 1) if code is None else code
    return failures, report.format_report(failures, code, **kw)


def test_root_cause_is_earliest_not_terminated():
    failures, text = make([
        exit_rec(0, 10.0, sig="SIGTERM", terminated=True),
        exit_rec(2, 12.0, code=3, tail="late failure"),
        exit_rec(1, 11.0, code=1, tail="Traceback ...\nValueError: first"),
    ])
    lines = text.splitlines()
    assert lines[0] == "poprun-lite: job failed (exit code 1)"
    assert lines[1] == "root cause: replica 1 (rank 1, host h, pid 101): exit code 1"
    assert lines[2:4] == ["  Traceback ...", "  ValueError: first"]
    assert lines[4] == "other failures:"
    assert "replica 0 (rank 0, host h, pid 100): signal SIGTERM (terminated after the root " \
           "cause)" in text
    assert "replica 2 (rank 2, host h, pid 102): exit code 3" in text
    assert "    late failure" in text  # an independent failure shows its own output
    assert report.root_cause(failures).rank == 1


def test_error_record_wins_over_stderr_tail_and_sets_time():
    # the agent of the aborting rank may itself be told to stop: the exception still wins
    failures, text = make([
        exit_rec(0, 5.0, sig="SIGTERM", terminated=True),
        exit_rec(1, 6.0, code=1, terminated=True, tail="noise\nmore noise"),
        error_rec(1, 4.0),
    ])
    cause = report.root_cause(failures)
    assert cause.rank == 1 and cause.time == 4.0
    assert "root cause: replica 1 (rank 1, host h, pid 101): exit code 1" in text
    assert "  ZeroDivisionError: division by zero\n  Traceback (most recent call last):" in text
    assert "noise" not in text


def test_exception_then_stopped_by_signal_reads_as_the_exception():
    # both replicas raise at once; the first to raise is then SIGTERMed by mpirun's abort
    failures, text = make([
        error_rec(1, 4.0, exc="AttributeError", msg="no attribute 'x'"),
        exit_rec(1, 4.5, sig="SIGTERM", terminated=True, tail="noise"),
        error_rec(0, 4.1, exc="AttributeError", msg="no attribute 'x'"),
        exit_rec(0, 4.6, code=1),
    ])
    assert report.root_cause(failures).rank == 1
    assert "root cause: replica 1 (rank 1, host h, pid 101): exit code 1\n  AttributeError: no attribute 'x'" in text
    assert "SIGTERM" not in text
    assert report.exit_code_for(failures, 143) == 1
    assert text.startswith("poprun-lite: job failed (exit code 1)")


def test_signal_root_cause_shows_stderr_tail_and_exit_code():
    failures, text = make([exit_rec(3, 1.0, sig="SIGKILL", tail="last words")])
    assert "root cause: replica 3 (rank 3, host h, pid 103): signal SIGKILL\n  last words" in text
    assert report.exit_code_for(failures, 1) == 137
    assert text.startswith("poprun-lite: job failed (exit code 137)")


def test_error_record_alone():
    failures, text = make([error_rec(2, 1.0, exc="KeyError", msg="'x'")])
    assert "root cause: replica 2 (rank 2, host h, pid 102): exit code 1\n  KeyError: 'x'" in text
    assert report.exit_code_for(failures, 0) == 1


def test_keyboard_interrupt_after_stop_is_not_a_root_cause():
    failures, text = make([
        exit_rec(0, 2.0, code=1, terminated=True),
        error_rec(0, 1.5, exc="KeyboardInterrupt", msg=""),
    ], code=130, reason="job interrupted by SIGINT")
    assert report.root_cause(failures) is None
    assert text.splitlines() == [
        "poprun-lite: job interrupted by SIGINT (exit code 130)", "stopped ranks:",
        "  replica 0 (rank 0, host h, pid 100): exit code 1: KeyboardInterrupt:  (terminated)"]


def test_no_records_falls_back_to_mpirun_output():
    failures, text = make([], code=5, mpirun_tail="line 1\nprterun: something broke")
    assert text.splitlines() == [
        "poprun-lite: job failed (exit code 5)",
        "no failure records from the ranks; last lines of mpirun's output:",
        "  line 1", "  prterun: something broke"]
    assert report.exit_code_for([], 5) == 5
    assert report.exit_code_for([], 0) == 1
    assert report.exit_code_for([], -9) == 137
    _, text = make([], code=130, reason="job interrupted by SIGINT", mpirun_tail="x")
    assert text == "poprun-lite: job interrupted by SIGINT (exit code 130)"


def test_long_tail_is_trimmed():
    tail = "\n".join(f"line {i}" for i in range(200))
    _, text = make([exit_rec(0, 1.0, code=2, tail=tail)])
    assert "line 199" in text and "line 100" not in text
    assert f"({200 - report.SHOWN_TAIL_LINES} earlier lines not shown)" in text


def test_other_role_title():
    failures = report.merge_records([exit_rec(4, 1.0, code=1, role="feeder")])
    assert failures[0].title() == "feeder of replica 4 (rank 4, host h, pid 104)"


def test_load_records_skips_partial_files(tmp_path):
    (tmp_path / "rank-0.exit.json").write_text(json.dumps(exit_rec(0, 1.0, code=1)))
    (tmp_path / "rank-0.error.json").write_text(json.dumps(error_rec(0, 0.5)))
    (tmp_path / "rank-1.exit.json").write_text('{"rank": 1, "ti')
    (tmp_path / "rank-2.exit.json.123.tmp").write_text("{}")
    records = report.load_records(str(tmp_path))
    assert sorted(r["kind"] for r in records) == ["error", "exit"]
    assert report.load_records(str(tmp_path / "missing")) == []


# ---------------------------------------------------------------- record writers

EXCEPTHOOK_PY = os.path.join(os.path.dirname(__file__), "..", "..", "popdist_lite",
                             "_excepthook.py")
# load the module by path: fast (no popdist_lite/__init__, hence no MPI start-up)
LOAD = ("import importlib.util as u; s = u.spec_from_file_location('_excepthook', {!r}); "
        "_excepthook = u.module_from_spec(s); s.loader.exec_module(_excepthook)\n")


def run_py(code, tmp_path, **env):
    code = LOAD.format(os.path.abspath(EXCEPTHOOK_PY)) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **env}, cwd=tmp_path)


def test_excepthook_prints_replica_and_writes_record(tmp_path):
    path = tmp_path / "rank-0.error.json"
    proc = run_py("""
        _excepthook.install(5)
        _excepthook.install(3)   # idempotent: only updates the replica
        def f():
            raise ValueError("bad value 42")
        f()
    """, tmp_path, POPDIST_LITE_ERROR_FILE=str(path))
    assert proc.returncode == 1
    first = proc.stderr.splitlines()[0]
    assert first.startswith("popdist-lite: uncaught exception in replica 3 (")
    assert proc.stderr.count("Traceback (most recent call last)") == 1
    record = json.loads(path.read_text())
    assert set(record) == {"rank", "replica", "role", "host", "pid", "time", "exception",
                           "message", "traceback"}
    assert record["replica"] == 3 and record["role"] == "replica"
    assert record["exception"] == "ValueError" and record["message"] == "bad value 42"
    assert "in f\n" in record["traceback"]
    assert not list(tmp_path.glob("*.tmp"))


def test_excepthook_in_thread(tmp_path):
    path = tmp_path / "err.json"
    proc = run_py("""
        import threading
        _excepthook.install(1, role="feeder")
        t = threading.Thread(target=lambda: {}["missing"], name="loader")
        t.start(); t.join()
        print("main continues")
    """, tmp_path, POPDIST_LITE_ERROR_FILE=str(path))
    assert "uncaught exception in feeder 1" in proc.stderr and "thread loader" in proc.stderr
    record = json.loads(path.read_text())
    assert record["exception"] == "KeyError" and record["role"] == "feeder"


def test_excepthook_without_error_file(tmp_path):
    proc = run_py("""
        _excepthook.install(0)
        raise RuntimeError("no file")
    """, tmp_path)
    assert proc.returncode == 1 and "RuntimeError: no file" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_agent_writes_exit_record(tmp_path):
    script = tmp_path / "p.py"
    script.write_text("import sys\nprint('out')\nprint('err line', file=sys.stderr)\n"
                      "import os\nprint(os.environ['POPDIST_LITE_ERROR_FILE'])\nsys.exit(3)\n")
    env = {**os.environ, "POPDIST_LITE_RUN_DIR": str(tmp_path), "PMI_RANK": "2",
           "POPDIST_REPLICA_INDEX_OFFSET": "2", "POPDIST_LITE_ROLE": "replica"}
    proc = subprocess.run([sys.executable, "-m", "popdist_lite_launcher.agent", "--",
                           sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 3
    assert proc.stdout.splitlines() == ["out", str(tmp_path / "rank-2.error.json")]
    assert "err line" in proc.stderr  # teed
    record = json.loads((tmp_path / "rank-2.exit.json").read_text())
    assert set(record) == {"rank", "replica", "role", "host", "pid", "time", "exitcode",
                           "signal", "stderr_tail", "terminated"}
    assert record["rank"] == 2 and record["replica"] == 2 and record["exitcode"] == 3
    assert record["signal"] is None and record["terminated"] is False
    assert record["stderr_tail"] == "err line"


def test_agent_success_leaves_no_record_and_hidden_output(tmp_path):
    env = {**os.environ, "POPDIST_LITE_RUN_DIR": str(tmp_path), "PMI_RANK": "0",
           "POPDIST_REPLICA_INDEX_OFFSET": "1", "POPDIST_LITE_ONLY_OUTPUT_FROM_INSTANCE": "0"}
    code = "import sys; print('o'); print('e', file=sys.stderr)"
    proc = subprocess.run([sys.executable, "-m", "popdist_lite_launcher.agent", "--",
                           sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == ""
    assert not list(tmp_path.iterdir())


def test_agent_forwards_sigterm_escalates_and_marks_terminated(tmp_path):
    """A child ignoring SIGTERM is SIGKILLed a few seconds after the agent is told to
    stop; the record says ``terminated`` (a consequence, not a root cause)."""
    ready = tmp_path / "ready"
    code = ("import signal, time, pathlib; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            f"pathlib.Path({str(ready)!r}).touch(); time.sleep(60)")
    env = {**os.environ, "POPDIST_LITE_RUN_DIR": str(tmp_path), "PMI_RANK": "1",
           "POPDIST_REPLICA_INDEX_OFFSET": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "popdist_lite_launcher.agent", "--",
                             sys.executable, "-c", code], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert proc.returncode == 128 + signal.SIGKILL
    assert agent.KILL_GRACE_SECONDS <= elapsed < agent.KILL_GRACE_SECONDS + 3
    record = json.loads((tmp_path / "rank-1.exit.json").read_text())
    assert record["terminated"] is True and record["signal"] == "SIGKILL"
    assert record["exitcode"] is None
