"""The rank's progress slot and stack dumps (popdist_lite.progress), read the way the
poprun-lite agent reads them (popdist_lite_launcher.node.rank_progress), in a real child
process: no MPI."""

import os
import signal
import subprocess
import sys
import textwrap
import time

from popdist_lite import progress
from popdist_lite_launcher.node.rank_progress import RankProgress

from helpers import JOB_SECONDS

CHILD = textwrap.dedent("""
    import sys, time
    from popdist_lite import progress
    progress.enable_from_env()
    progress.record("broadcast", 0)
    progress.record("all_reduce", 1)
    progress.record("all_reduce", 2)

    def spin_in_a_python_loop_for_the_test():
        print("spinning", flush=True)
        x = 0
        while True:
            x += 1

    spin_in_a_python_loop_for_the_test()
""")


def test_slot_and_stack_of_a_spinning_rank():
    rank = RankProgress()
    try:
        assert rank.read() is None  # no call entered yet
        before = time.time()
        child = subprocess.Popen([sys.executable, "-c", CHILD], env={**os.environ, **rank.env()},
                                 stdout=subprocess.PIPE, text=True, pass_fds=rank.fds())
        try:
            assert child.stdout.readline().strip() == "spinning"
            call, op, since, pid = rank.read()
            assert (call, op, pid) == (2, "all_reduce", child.pid)
            assert before <= since <= time.time()
            stack = rank.dump_stack(child.pid)
            assert "spin_in_a_python_loop_for_the_test" in stack, stack
            assert "most recent call first" in stack
            again = rank.dump_stack(child.pid)  # only the new dump, not the first one again
            assert again.count("spin_in_a_python_loop_for_the_test") == 1
        finally:
            child.kill()
            child.wait(JOB_SECONDS)
    finally:
        rank.close()


def test_watch_reports_each_new_call():
    """The child enters each call only once the watcher has reported the previous one
    (it reads a line the test writes when it does), so no call can be missed however
    late the watcher's polls come."""
    rank = RankProgress()
    seen = []
    code = textwrap.dedent("""
        import sys
        from popdist_lite import progress
        progress.enable_from_env()
        for call, op in enumerate(["all_gather", "all_reduce", "broadcast"]):
            progress.record(op, call)
            assert sys.stdin.readline() == "seen\\n"
    """)
    try:
        child = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **rank.env()},
                                 stdin=subprocess.PIPE, text=True, pass_fds=rank.fds())

        def report(*args):
            seen.append(args)
            child.stdin.write("seen\n")
            child.stdin.flush()
        try:
            rank.watch(report)
            assert child.wait(timeout=JOB_SECONDS) == 0
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    finally:
        rank.close()
    assert [(lane, call, op) for lane, call, op, _ in seen] == [
        ("main", 0, "all_gather"), ("main", 1, "all_reduce"), ("main", 2, "broadcast")]
    assert seen[0][3] < seen[1][3] < seen[2][3]


def test_lanes_are_read_apart_and_bad_lanes_are_left_out():
    """Calls on the jax lane neither replace the main lane's last call nor hide behind a
    higher one; a lane name or operation code that is not what the slot's writer would
    write (bytes from a hostile or broken rank) is left out of what the agent reads."""
    rank = RankProgress()
    code = textwrap.dedent("""
        from popdist_lite import progress
        progress.enable_from_env()
        jax = progress.lane_index("jax")
        progress.record("all_reduce", 9)
        progress.record("EmbeddingCollection.lookup_in_jit", 3, jax)
        assert progress.lane_index("jax") == jax and progress.last_call()[:2] == (9, "all_reduce")
        for name in ("Jax", "x" * 17, "", "1a", "a-b"):
            try:
                progress.lane_index(name)
            except ValueError:
                continue
            raise AssertionError(name)
        assert progress.lane_index("checkpoint") == 2 and progress.lane_index("other") == 3
        assert progress.lane_index("one_too_many") is None  # MAX_LANES: not recorded
    """)
    try:
        subprocess.run([sys.executable, "-c", code], env={**os.environ, **rank.env()}, pass_fds=rank.fds(),
                       timeout=JOB_SECONDS, check=True)
        lanes = rank.read_lanes()
        assert [(lane, call, op) for lane, call, op, _ in lanes] == [
            ("main", 9, "all_reduce"), ("jax", 3, "EmbeddingCollection.lookup_in_jit")]
        data = bytearray(os.pread(rank.slot.fileno(), progress.SLOT_SIZE, 0))
        words = memoryview(data).cast("q")
        words[2 * progress.LANE_SIZE // 8] = 5  # lane 2 ("checkpoint") entered call 5 ...
        words[2 * progress.LANE_SIZE // 8 + 1] = progress.MAX_OPS  # ... with an op code out of range
        name_at = 3 * progress.LANE_SIZE + 32
        data[name_at:name_at + 5] = b"BAD\n\0"  # lane 3 renamed to something no writer writes
        words[3 * progress.LANE_SIZE // 8] = 1
        assert [lane for lane, *_ in progress.read_lanes(bytes(data))] == ["main", "jax"]
        assert progress.read_lanes(bytes(data[:progress.NAMES_OFFSET - 1])) == []
    finally:
        rank.close()


def test_off_by_default_records_nothing():
    code = ("from popdist_lite import progress\n"
            "assert progress.record is progress._off\n"
            "progress.record('all_reduce', 0)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("POPDIST_LITE_")}
    subprocess.run([sys.executable, "-c", code], env=env, timeout=JOB_SECONDS, check=True)


def test_stack_of_a_stopped_rank_reads_its_state():
    """A rank stopped by SIGSTOP cannot run its stack dump: the answer names its state
    (from /proc/PID/stat) without signalling it; continued, it dumps its stack again."""
    rank = RankProgress()
    try:
        child = subprocess.Popen([sys.executable, "-c", CHILD], env={**os.environ, **rank.env()},
                                 stdout=subprocess.PIPE, text=True, pass_fds=rank.fds())
        try:
            assert child.stdout.readline().strip() == "spinning"
            os.kill(child.pid, signal.SIGSTOP)
            deadline = time.monotonic() + 30
            while _state(child.pid) != "T":  # the stop is asynchronous
                assert time.monotonic() < deadline, "the child never stopped"
                time.sleep(0.02)
            assert rank.dump_stack(child.pid) == "stopped (state T)"
            os.kill(child.pid, signal.SIGCONT)
            stack = rank.dump_stack(child.pid)  # running again: its stack, the one dump
            assert stack.count("spin_in_a_python_loop_for_the_test") == 1, stack
        finally:
            child.kill()
            child.wait(10)
    finally:
        rank.close()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]

