"""One failure, told once (unit tests, no MPI): the agent's hold on a traceback that
ends its program (node/tee.py HeldTracebacks), the MPI library's end-of-job messages
kept out of mpirun's copied stderr (supervise/mpi_messages.py), the job's log, and the
launcher's timeline of the ranks' streamed events (supervise/timeline.py). The texts are
Open MPI's and MPICH's as they print them (Open MPI 5's help files, hydra)."""

import json
import os

import pytest

from popdist_lite import records
from popdist_lite_launcher.node.tee import HOLD_SECONDS, HeldTracebacks, Tee
from popdist_lite_launcher.supervise import stall
from popdist_lite_launcher.supervise.joblog import JobLog
from popdist_lite_launcher.supervise.mpi_messages import EndMessages
from popdist_lite_launcher.supervise.timeline import Timeline


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


HOOK = (b"popdist-lite: uncaught exception in replica 1 (vm, rank 1):\n"
        b"Traceback (most recent call last):\n  File \"/w/train.py\", line 6, in <module>\n"
        b"    y = pl.all_gather(x)\nValueError: all_gather: argument x: replica 1 passed shape (3, 3)\n")
SYNTAX = b'  File "/w/train.py", line 1\n    def f(:\n          ^\nSyntaxError: invalid syntax\n'
PLAIN = b"Traceback (most recent call last):\n  File \"/w/t.py\", line 2, in <module>\nKeyError: 'x'\n"


@pytest.mark.parametrize("traceback", [HOOK, SYNTAX, PLAIN])
def test_a_traceback_that_ends_the_program_is_not_written(traceback):
    """The lines before it flow at once; the traceback (and what follows it) waits for the
    program's end: dropped when it failed (the report tells it), written when it did not."""
    for failed in (True, False):
        hold = HeldTracebacks(clock=Clock())
        assert hold.feed(b"step 1\n" + traceback[:30]) == b"step 1\n"
        assert hold.feed(traceback[30:]) == b""
        assert hold.end(failed) == (b"" if failed else traceback)


def test_a_traceback_the_program_survives_is_written_late_and_a_progress_bar_flows():
    clock = Clock()
    hold = HeldTracebacks(clock=clock)
    assert hold.feed(b"\r 10%|#   | 1/10") == b"\r 10%|#   | 1/10"  # no newline: written at once
    assert hold.feed(b"\r" + PLAIN) == b"\r"                        # after a bar's \r: a line's start
    assert hold.timeout() == pytest.approx(HOLD_SECONDS)
    clock.now += HOLD_SECONDS - 0.1
    assert hold.expire() == b""
    clock.now += 0.2
    assert hold.expire() == PLAIN and hold.timeout() is None      # the program went on
    assert hold.feed(b"more\n") == b"more\n"
    assert hold.end(True) == b""


def test_only_a_line_start_begins_a_hold_and_a_marker_split_over_chunks_is_found():
    hold = HeldTracebacks(clock=Clock())
    quoted = b"log: Traceback (most recent call last): in a message\n"
    assert hold.feed(quoted) == quoted
    assert hold.feed(b"ok\nTrace") == b"ok\n"                         # maybe a marker: held
    assert hold.feed(b"back (most recent call last):\n") == b""
    assert hold.end(True) == b""
    hold = HeldTracebacks(clock=Clock())
    assert hold.feed(b"Tra") == b"" and hold.feed(b"in 3\n") == b"Train 3\n"


def test_a_hold_beyond_its_limit_is_written():
    hold = HeldTracebacks(limit=100, clock=Clock())
    assert hold.feed(PLAIN) == b""
    assert hold.feed(b"x" * 100) == PLAIN + b"x" * 100


def test_the_tee_writes_what_its_filter_lets_through_and_keeps_every_line():
    src_r, src_w = os.pipe()
    dst_r, dst_w = os.pipe()
    tee = Tee(src_r, dst_w, 50, filter=HeldTracebacks())
    os.write(src_w, b"working\n" + HOOK)
    os.close(src_w)
    tee.finish(failed=True, timeout=30)
    tee.end_line(timeout=30)
    os.close(dst_w)
    with os.fdopen(dst_r, "rb") as f:
        assert f.read() == b"working\n"
    assert tee.text() == (b"working\n" + HOOK).decode().rstrip("\n")  # the tail for the exit record


ABORT_BOX = b"""--------------------------------------------------------------------------
MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD
  Proc: [[44949,1],1]
  Errorcode: 1

NOTE: invoking MPI_ABORT causes Open MPI to kill all MPI processes.
You may or may not see output from other processes, depending on
exactly when Open MPI kills them.
--------------------------------------------------------------------------
"""
EXIT_BOX = b"""--------------------------------------------------------------------------
prterun has exited due to process rank 0 with PID 0 on node vm calling
"abort". This may have caused other processes in the application to be
terminated by signals sent by prterun (as reported here).
--------------------------------------------------------------------------
"""
NONZERO_BOX = b"""--------------------------------------------------------------------------
prterun detected that one or more processes exited with non-zero status,
thus causing the job to be terminated. The first process to do so was:

   Process name: [prterun-vm-14098@1,1]
   Exit code:    1
--------------------------------------------------------------------------
"""
HYDRA_BOX = b"""
===================================================================================
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   PID 4242 RUNNING AT vm
=   EXIT CODE: 1
=   CLEANING UP REMAINING PROCESSES
=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES
===================================================================================
"""
MPICH_ABORT = b"Abort(1) on node 1 (rank 1 in comm 0): application called MPI_Abort(MPI_COMM_WORLD, 1) - process 1\n"
OTHER_BOX = b"""--------------------------------------------------------------------------
There are not enough slots available in the system to satisfy the 4
slots that were requested by the application:
--------------------------------------------------------------------------
"""


def test_the_mpi_librarys_end_messages_go_to_the_log_and_the_rest_is_written():
    kept = []
    messages = EndMessages(kept.append, clock=Clock())
    stream = b"a rank's line\n" + ABORT_BOX + EXIT_BOX + MPICH_ABORT + HYDRA_BOX + NONZERO_BOX + OTHER_BOX + b"last"
    out = b"".join(messages.feed(stream[i:i + 7]) for i in range(0, len(stream), 7))  # in small pieces
    assert out == b"a rank's line\n" + b"\n" + OTHER_BOX + b"last"
    assert "".join(kept) == (ABORT_BOX + EXIT_BOX + MPICH_ABORT + HYDRA_BOX[1:] + NONZERO_BOX).decode()


def test_a_frame_that_opens_no_box_is_written_after_its_wait():
    clock = Clock()
    messages = EndMessages([].append, clock=clock)
    assert messages.feed(b"-" * 30 + b"\nsection 1\n") == b""
    clock.now += 5
    assert messages.expire() == b"-" * 30 + b"\nsection 1\n"
    assert messages.feed(b"----") == b"" and messages.end(False) == b"----"


def test_the_job_log_is_made_on_first_use(tmp_path):
    log = JobLog(str(tmp_path))
    assert log.path is None and not list(tmp_path.iterdir())
    log.section("mpirun's message", "box")
    log.write("more")
    assert oct(os.stat(os.path.dirname(log.path)).st_mode & 0o777) == "0o700"
    assert open(log.path).read() == "== mpirun's message ==\nbox\nmore\n"


def test_the_stall_block_leaves_the_librarys_timeline_thread_out():
    dump = ('Thread 0x00007f9d98f746c0 (most recent call first):\n'
            '  File "/usr/lib/python3.11/threading.py", line 331 in wait\n'
            '  File "/w/popdist_lite/timeline.py", line 324 in _stream\n\n'
            'Thread 0x00007f9d98f74000 (most recent call first):\n  File "/w/train.py", line 3 in load\n\n'
            'Current thread 0x00007f9da01d7b80 (most recent call first):\n  File "/w/train.py", line 10 in <module>\n')
    kept = stall.without_library_threads(dump)
    assert "_stream" not in kept and "line 3 in load" in kept and "line 10 in <module>" in kept


def event(pid, name="all_reduce", ts=2e15, tid=None):
    return {"name": name, "cat": "collective", "ph": "X", "pid": pid, "tid": pid if tid is None else tid,
            "ts": ts, "dur": 5.0, "args": {"bytes_sent": 8, "bytes_received": 8}}


def timeline_record(replica, events, role="replica", host="h1"):
    return records.make("timeline", records.identity(rank=replica, replica=replica, role=role, host=host),
                        events=events)


def test_the_launchers_timeline_believes_the_agent_not_the_events(tmp_path):
    """Events land on the track of the replica the agent enrolled as, labelled with its
    host; feeders' records are ignored; what is beyond the bound is counted, not kept."""
    trace = Timeline(max_bytes=1000)
    trace.on_record(timeline_record(1, [event(7, ts=2e15 + 10), event(1, tid=7), event(1, tid=200_001)]))
    trace.on_record(timeline_record(0, [event(0)], host="h0"))
    trace.on_record(timeline_record(0, [event(0, name="feed")], role="feeder"))
    out = tmp_path / "trace.json"
    assert trace.deliver(str(out), "the job failed") == f"timeline (partial: the job failed) {out}"
    events = json.loads(out.read_text())["traceEvents"]
    spans = [(e["pid"], e["tid"], e["ts"]) for e in events if e["ph"] == "X"]
    assert spans == [(1, 1, 10.0), (1, 1, 0.0), (1, 200_001, 0.0), (0, 0, 0.0)]
    assert {e["pid"]: e["args"]["labels"] for e in events if e["name"] == "process_labels"} == {0: "h0", 1: "h1"}
    for _ in range(10):
        trace.on_record(timeline_record(0, [event(0)]))
    assert trace.left_out > 0 and trace.size <= 1000
    assert "events left out beyond" in trace.deliver(str(out))
    assert Timeline().deliver(str(out)).startswith("timeline not written (no replica sent events")


def test_a_stall_reports_the_ranks_it_stopped_in_one_line():
    from popdist_lite_launcher.supervise import report
    stopped = [{"kind": "exit", "rank": r, "replica": r, "role": "replica", "host": "h", "pid": 10 + r, "time": 1.0,
                "exitcode": None, "signal": "SIGTERM", "stderr_tail": "", "terminated": True} for r in (10, 2)]
    text = report.format_report(report.merge_records(stopped), 1, reason="job stalled",
                                cause="root cause: stall: replica 2 has waited 5.2 s")
    assert text.splitlines()[-1] == "stopped after it: replica 2, replica 10" and "SIGTERM" not in text
