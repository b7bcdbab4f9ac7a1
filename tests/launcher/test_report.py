"""Unit tests of the failure report (synthetic records), the record format and the
collector, and of the record writers (``popdist_lite._excepthook`` and the agent),
without MPI."""

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import unittest.mock

import pytest

from popdist_lite import records
from popdist_lite_launcher.core import channel
from popdist_lite_launcher.node import agent, hold_signals
from popdist_lite_launcher.supervise import report
from popdist_lite_launcher.supervise.collector import Collector
from peers import AgentConnection, address, key_file, wait_for

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
    assert "replica 2 (rank 2, host h, pid 102): exit code 3" in text
    assert "    late failure" in text  # an independent failure shows its own output
    # the rank stopped because of it is named once (how it ended is in the job's log)
    assert lines[-1] == "stopped after it: replica 0" and "SIGTERM" not in text
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
    # the error told once: the traceback, which ends with the exception's line
    assert "exit code 1\n  Traceback (most recent call last):" in text
    assert text.count("ZeroDivisionError: division by zero") == 1
    assert "noise" not in text


def test_exception_then_stopped_by_signal_reads_as_the_exception():
    # both replicas raise at once; the first to raise is then SIGTERMed by mpirun's abort
    failures, text = make([
        error_rec(1, 4.0, exc="AttributeError", msg="no attribute 'x'"),
        exit_rec(1, 4.5, sig="SIGTERM", terminated=True, tail="noise"),
        error_rec(0, 4.1, exc="AttributeError", msg="no attribute 'x'"),
        exit_rec(0, 4.6, code=1),
    ])
    # the same error on both: the lowest replica names it, whichever came first
    assert report.root_cause(failures).rank == 0
    assert "root cause: replica 0 (rank 0, host h, pid 100): exit code 1\n  AttributeError: no attribute 'x'" in text
    assert text.count("no attribute 'x'") == 1 and "  replica 1 (rank 1, host h, pid 101): the same error" in text
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


def test_successful_exit_is_not_a_failure_and_lost_agent_is():
    ok = exit_rec(0, 1.0, code=0)
    lost = {"kind": "lost", "rank": 1, "replica": 1, "role": "replica", "feeder": None,
            "host": "h2", "pid": 101, "time": 2.0, "terminated": False,
            "reason": "nothing from its agent for 10 s (host down or unreachable)"}
    failures, text = make([ok, lost, exit_rec(2, 3.0, sig="SIGTERM", terminated=True)])
    assert [f.rank for f in failures] == [1, 2]
    assert "root cause: replica 1 (rank 1, host h2, pid 101): lost: nothing from its agent " \
           "for 10 s (host down or unreachable)" in text
    assert report.exit_code_for(failures, 0) == 1


def test_records_contract():
    ident = records.identity(rank=3, replica=1, role="feeder", feeder=0, pid=7)
    rec = records.make("exit", ident, exitcode=2, signal=None, stderr_tail="x",
                       terminated=False)
    line = records.encode(rec)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert records.decode(line) == rec and rec["kind"] == "exit"
    assert set(rec) == {"kind", *records.FIELDS["exit"]}
    with pytest.raises(ValueError, match="has no field"):
        records.make("error", ident, exitcode=1)
    with pytest.raises(ValueError, match="kind"):
        records.decode(b'{"rank": 1}')
    with pytest.raises(ValueError):
        records.decode(b'{"kind": "exit", "ti')
    assert records.make("custom", ident, step=5)["step"] == 5  # other kinds: any fields
    env = {"PMI_RANK": "4", "POPDIST_REPLICA_INDEX_OFFSET": "1", "POPDIST_LITE_ROLE": "feeder",
           "POPDIST_LITE_FEEDER_OF": "1", "POPDIST_LITE_FEEDER_INDEX": "2"}
    ident = records.env_identity(env)
    assert (ident["rank"], ident["replica"], ident["role"], ident["feeder"]) == (4, 1, "feeder", 2)


def test_collector_drops_bad_lines_and_reports_lost_agents():
    # agent 0 must be lost by closing, however slow this machine: no silence timeout in reach
    with Collector(silence_timeout=3600.0, ranks=2) as collector:
        seen = []
        collector.subscribe("progress", seen.append)
        # agent 0: a bad line, a progress record, then it vanishes without an exit record
        agent0 = AgentConnection(collector, 0)
        agent0.sock.sendall(b"not json\n")
        agent0.send("progress", lane="main", call=3, op="all_reduce", since=1.0)
        wait_for(lambda: seen, what="the progress record")
        agent0.close()
        assert collector.wait_closed(60)
        assert [r["kind"] for r in collector.records()] == ["hello", "progress", "lost"]
        assert seen[0]["call"] == 3 and collector.ignored() == ({}, {"not a frame": 1})
        lost = collector.records("lost")[0]
        assert lost["rank"] == 0 and lost["terminated"] is False and "closed" in lost["reason"]
        assert collector.has_failure() and collector.lost_cause()
        # agent 1: says hello, then goes silent: lost after silence_timeout, a consequence now
        collector.silence_timeout = 1.0  # read at each deadline check
        agent1 = AgentConnection(collector, 1)
        wait_for(lambda: len(collector.records("lost")) == 2, 60, "agent 1's loss")
        lost = collector.records("lost")[1]
        assert lost["rank"] == 1 and lost["terminated"] is True and "nothing" in lost["reason"]
        agent1.close()


def test_root_cause_by_the_launchers_clock_not_a_skewed_host():
    """Replica 0 raises; replica 1, on a host whose clock is 5 s behind, exits with code 14
    (its MPI library saw replica 0 vanish) a moment later. The collector's stamps order
    them: the exception is the root cause, not the exit its host's clock dates 5 s
    earlier."""
    with Collector(ranks=2) as collector:
        agents = [AgentConnection(collector, rank) for rank in range(2)]
        now = time.time()
        agents[0].ident["time"] = now
        agents[0].send("error", exception="ValueError", message="the real error", traceback=TB)
        wait_for(lambda: collector.records("error"), what="the error record")
        agents[1].ident["time"] = now + 0.05 - 5.0
        agents[1].send("exit", exitcode=14, signal=None, stderr_tail="peer vanished",
                       terminated=False)
        wait_for(lambda: collector.records("exit"), what="the exit record")
        failures = report.merge_records(collector.failure_records())
        for agent_connection in agents:
            agent_connection.close()
    cause = report.root_cause(failures)
    assert (cause.rank, cause.exception) == (0, "ValueError")
    assert failures[0].time <= failures[1].time  # the launcher's order of arrival
    assert report.summary(failures).startswith("replica 0 (rank 0, host")


def test_a_step_of_the_launchers_wall_clock_loses_no_agent(monkeypatch):
    """The launcher's wall clock jumps 15 s ahead (NTP, an operator) while an agent is
    connected and silent for less than the silence timeout (10 s): it is not lost. Two
    strangers, refused in turn for not authenticating within 1 s (a later deadline
    check each), show the collector checked its deadlines after the step."""
    monkeypatch.setattr(channel, "HELLO_DEADLINE_SECONDS", 1.0)
    real_time = time.time
    with Collector(ranks=1) as collector:
        agent_connection = AgentConnection(collector, 0)
        wait_for(lambda: collector.records("hello"), what="the hello")
        with unittest.mock.patch("time.time", lambda: real_time() + 15.0):
            for count in (1, 2):
                with socket.create_connection(address(collector)):
                    wait_for(lambda: collector.ignored()[0].get("no hello within 1 s") == count,
                             timeout=30, what=f"stranger {count} refused")
        assert collector.records("lost") == []
        assert not collector.has_failure() and not collector.lost_cause()
        agent_connection.close()


def test_collector_sends_requests_to_one_agent():
    with Collector(ranks=2) as collector:
        agents = [AgentConnection(collector, rank) for rank in range(2)]
        wait_for(lambda: len(collector.records("hello")) == 2, what="two hellos")
        assert collector.send(1, {"kind": "signal", "signal": "SIGUSR1"})
        assert not collector.send(5, {"kind": "signal", "signal": "SIGUSR1"})
        assert agents[1].receive() == {"kind": "signal", "signal": "SIGUSR1"}
        for agent_connection in agents:
            agent_connection.close()


# ---------------------------------------------------------------- record writers

HOOK = ("import mpi4py; mpi4py.rc.initialize = False  # no MPI needed here\n"
        "from popdist_lite import _excepthook\n")


class FakeAgent:
    """The agent's end of a rank's record socket: collects lines, acknowledges each."""

    def __init__(self):
        self.ours, self.theirs = socket.socketpair()
        self.lines = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        buf = records.LineBuffer()
        while chunk := self.ours.recv(65536):
            for line in buf.feed(chunk):
                self.lines.append(records.decode(line))
                self.ours.sendall(b"\x06")

    def env(self):
        return {records.RECORD_FD_ENV: str(self.theirs.fileno())}


def run_py(code, tmp_path, agent=None):
    env = {k: v for k, v in os.environ.items() if k != records.RECORD_FD_ENV}
    env.update(agent.env() if agent else {})
    proc = subprocess.run([sys.executable, "-c", HOOK + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
                          pass_fds=[agent.theirs.fileno()] if agent else ())
    if agent:
        agent.theirs.close()
        agent.thread.join(5)
    return proc


def test_excepthook_prints_replica_and_sends_record(tmp_path):
    fake = FakeAgent()
    proc = run_py("""
        _excepthook.install(5)
        _excepthook.install(3)   # idempotent: only updates the replica
        def f():
            raise ValueError("bad value 42")
        f()
    """, tmp_path, fake)
    assert proc.returncode == 1
    first = proc.stderr.splitlines()[0]
    assert first.startswith("popdist-lite: uncaught exception in replica 3 (")
    assert proc.stderr.count("Traceback (most recent call last)") == 1
    [record] = fake.lines
    assert set(record) == {"kind", *records.FIELDS["error"]}
    assert record["kind"] == "error" and record["replica"] == 3 and record["role"] == "replica"
    assert record["exception"] == "ValueError" and record["message"] == "bad value 42"
    assert "in f\n" in record["traceback"]


def test_excepthook_in_thread(tmp_path):
    fake = FakeAgent()
    proc = run_py("""
        import threading
        _excepthook.install(1, role="feeder")
        t = threading.Thread(target=lambda: {}["missing"], name="loader")
        t.start(); t.join()
        print("main continues")
    """, tmp_path, fake)
    assert "uncaught exception in feeder 1" in proc.stderr and "thread loader" in proc.stderr
    assert "main continues" in proc.stdout
    [record] = fake.lines
    assert record["exception"] == "KeyError" and record["role"] == "feeder"


def test_excepthook_without_agent(tmp_path):
    proc = run_py("""
        _excepthook.install(0)
        raise RuntimeError("no agent")
    """, tmp_path)
    assert proc.returncode == 1 and "RuntimeError: no agent" in proc.stderr
    assert not list(tmp_path.iterdir())


def while_running(proc, condition, timeout: float = 60.0) -> None:
    """Wait until ``condition()`` holds, polled every 0.05 s; AssertionError if the
    agent ``proc`` ends first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline and proc.poll() is None, "the agent ended, or no event in time"
        time.sleep(0.05)


def run_agent(collector, code, env, **kw):
    """The agent supervising ``python -c code``, sending to ``collector``."""
    env = {**os.environ, records.COLLECTOR_ENV: collector.address,
           **key_file(collector.key, int(env.get("PMI_RANK", "0"))), **env}
    return subprocess.Popen([sys.executable, "-m", "popdist_lite_launcher.node.agent", "--",
                             sys.executable, "-c", code], env=env, text=True, **kw)


def test_agent_sends_exit_record(tmp_path):
    """... and of the program's records only its error, stamped with the agent's identity
    (a program cannot speak for another rank, nor send other kinds)."""
    code = ("import sys\nprint('out')\nprint('err line', file=sys.stderr)\n"
            "from popdist_lite import records\n"
            "print(records.send({'kind': 'progress', 'step': 1}, timeout=5))\n"
            "forged = records.identity(rank=7, replica=7, role='feeder', feeder=3, host='elsewhere', pid=1)\n"
            "print(records.send(records.make('error', forged, exception='E', message='m',\n"
            "                                traceback='t'), timeout=5))\nsys.exit(3)\n")
    with Collector() as collector:
        proc = run_agent(collector, code, {"PMI_RANK": "2", "POPDIST_REPLICA_INDEX_OFFSET": "2",
                                           "POPDIST_LITE_ROLE": "replica"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = proc.communicate(timeout=60)
        assert collector.wait_closed(60)
        recs = collector.records()
    assert proc.returncode == 3
    assert out.splitlines() == ["out", "True", "True"]  # both acknowledged
    assert "err line" in err  # teed
    assert [r["kind"] for r in recs] == ["hello", "error", "exit"]
    error = recs[1]
    assert (error["rank"], error["replica"], error["role"], error["feeder"]) == (2, 2, "replica", None)
    assert error["host"] == recs[0]["host"] != "elsewhere" and error["pid"] == recs[0]["pid"]
    assert (error["exception"], error["message"], error["traceback"]) == ("E", "m", "t")
    record = recs[-1]
    assert set(record) == {"kind", "received", *records.FIELDS["exit"]}  # + the launcher's stamp
    assert record["rank"] == 2 and record["replica"] == 2 and record["exitcode"] == 3
    assert record["signal"] is None and record["terminated"] is False
    assert record["stderr_tail"] == "err line"
    assert recs[0]["pid"] == record["pid"] != proc.pid  # the program's pid


def test_agent_success_and_hidden_output(tmp_path):
    env = {"PMI_RANK": "0", "POPDIST_REPLICA_INDEX_OFFSET": "1",
           "POPDIST_LITE_ONLY_OUTPUT_FROM_INSTANCE": "0"}
    code = "import sys; print('o'); print('e', file=sys.stderr)"
    with Collector() as collector:
        proc = run_agent(collector, code, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = proc.communicate(timeout=60)
        assert collector.wait_closed(60)
        recs = collector.failure_records()
    assert proc.returncode == 0 and out == "" and err == ""
    assert [(r["kind"], r["exitcode"]) for r in recs] == [("exit", 0)]
    assert report.merge_records(recs) == []


def test_agent_signals_program_on_request(tmp_path):
    ready = tmp_path / "ready"
    code = ("import signal, time, pathlib, os\n"
            "signal.signal(signal.SIGUSR1, lambda *a: os._exit(7))\n"
            f"pathlib.Path({str(ready)!r}).touch(); time.sleep(60)")
    with Collector() as collector:
        proc = run_agent(collector, code, {"PMI_RANK": "1"}, stderr=subprocess.PIPE)
        try:
            while_running(proc, lambda: ready.exists() and collector.records("hello"))
            assert collector.send(1, {"kind": "signal", "signal": "SIGUSR1"})
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
        assert collector.wait_closed(60)
        assert proc.returncode == 7
        assert collector.records("exit")[0]["exitcode"] == 7


def test_agent_forwards_sigterm_escalates_and_marks_terminated(tmp_path):
    """A child ignoring SIGTERM is SIGKILLed a few seconds after the agent is told to
    stop; the record says ``terminated`` (a consequence, not a root cause)."""
    ready = tmp_path / "ready"
    code = ("import signal, time, pathlib; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            f"pathlib.Path({str(ready)!r}).touch(); time.sleep(60)")
    with Collector() as collector:
        proc = run_agent(collector, code, {"PMI_RANK": "1", "POPDIST_REPLICA_INDEX_OFFSET": "1"},
                         stderr=subprocess.PIPE)
        try:
            while_running(proc, ready.exists)
            start = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
            elapsed = time.monotonic() - start
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
        assert collector.wait_closed(60)
        record = collector.records("exit")[0]
    assert proc.returncode == 128 + signal.SIGKILL
    assert agent.PROGRAM_KILL_DELAY_SECONDS <= elapsed  # SIGKILL came after the delay
    assert record["terminated"] is True and record["signal"] == "SIGKILL"
    assert record["exitcode"] is None


def test_agent_holding_sigterm(tmp_path):
    """With SIGTERM and SIGUSR1 held (preemption on, launcher/node/hold_signals.py): the
    program starts with them and SIGINT ignored; each from another process than the
    agent's parent (Slurm signalling the job's steps; here ``kill``) becomes a
    ``signalled`` record naming it and its sender, and the program runs on; SIGTERM from
    the parent (the MPI daemon; here this test) ends the program with SIGKILL at once, the
    exit record marked ``terminated``."""
    ready = tmp_path / "ready"
    code = ("import pathlib, time; status = pathlib.Path('/proc/self/status').read_text(); "
            f"pathlib.Path({str(ready)!r}).write_text(status); time.sleep(60)")
    with Collector() as collector:
        proc = run_agent(collector, code, {"PMI_RANK": "1", "POPDIST_REPLICA_INDEX_OFFSET": "1",
                                           hold_signals.ENV: "SIGTERM,SIGUSR1"}, stderr=subprocess.PIPE)
        try:
            while_running(proc, lambda: ready.exists() and ready.read_text())
            ignored = int(re.search(r"^SigIgn:\s*([0-9a-f]+)$", ready.read_text(), re.M)[1], 16)
            assert all(ignored >> (s - 1) & 1 for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)), hex(ignored)
            kill = subprocess.Popen(["kill", "-TERM", str(proc.pid)])
            assert kill.wait() == 0
            while_running(proc, lambda: collector.records("signalled"))
            subprocess.run(["kill", "-USR1", str(proc.pid)], check=True)
            while_running(proc, lambda: len(collector.records("signalled")) == 2)
            assert proc.poll() is None  # the program runs on
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
        assert collector.wait_closed(60)
        signalled, exit_record = collector.records("signalled"), collector.records("exit")[0]
    assert [(r["signal"], r["rank"]) for r in signalled] == [("SIGTERM", 1), ("SIGUSR1", 1)]
    assert signalled[0]["sender"] == kill.pid
    assert proc.returncode == 128 + signal.SIGKILL
    assert exit_record["terminated"] is True and exit_record["signal"] == "SIGKILL"


def test_simultaneous_failures_prefer_the_primary_kind():
    # a peer's MPI library exits (code 14) a moment "before" the killed rank's record
    failures, text = make([exit_rec(0, 10.00, code=14, tail="Socket closed"),
                           exit_rec(2, 10.05, sig="SIGKILL", tail="about to die")])
    assert report.root_cause(failures).rank == 2
    assert "root cause: replica 2 (rank 2, host h, pid 102): signal SIGKILL" in text
    # an exception beats a signal at the same moment; seconds apart, the earliest wins
    failures, _ = make([exit_rec(1, 5.0, sig="SIGKILL"), error_rec(3, 5.5)])
    assert report.root_cause(failures).rank == 3
    failures, _ = make([exit_rec(0, 1.0, code=14), exit_rec(2, 3.0, sig="SIGKILL")])
    assert report.root_cause(failures).rank == 0
