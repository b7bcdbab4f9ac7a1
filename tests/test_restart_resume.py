"""Recovery end to end: examples/shakespeare.py under poprun-lite --max-restarts 1 with
checkpoints every 10 steps; replica 1 is SIGKILLed at step 25 of 60. The restarted
attempt resumes from the step-20 checkpoint and finishes all 60 steps, and its losses
from step 30 on equal an uninterrupted run's. The first attempt waits after step 25
(``--test-hold-at 26``), so the kill lands there whatever the machine's speed. Every run
is under a timeout."""

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from helpers import EXAMPLE, JOB_SECONDS, ROOT, TINY, clean_env, timeout_for

STEP_RE = re.compile(r"^Step (\d+), loss = ([^\s,]+)")  # then ", R steps/s, ETA T" after step 0
LAUNCHER = [sys.executable, "-m", "popdist_lite_launcher", "--num-replicas", "2", "--timeout", str(JOB_SECONDS)]
pytestmark = timeout_for(2)


def example_args(tmp_path, ckpt):
    data = tmp_path / "tiny.txt"
    data.write_text(TINY)
    return [sys.executable, str(EXAMPLE), "--data", str(data), "--steps", "60", "--seq-len", "20",
            "--batch-size", "4", "--log-every", "1", "--sample-chars", "0",
            "--checkpoint-dir", str(ckpt), "--checkpoint-every", "10", "--resume"]


def replica_program(replica: int, attempt: int) -> int | None:
    """PID of the example's process driving ``replica`` in ``attempt`` (not its agent)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(EXAMPLE).encode() in cmdline and b"popdist_lite_launcher.node.agent" not in cmdline \
                and f"POPDIST_REPLICA_INDEX_OFFSET={replica}".encode() in environ \
                and f"POPDIST_LITE_RESTART_COUNT={attempt}".encode() in environ:
            return int(entry)
    return None


def test_killed_replica_restarts_from_the_checkpoint(tmp_path):
    env = clean_env()
    straight = subprocess.run([*LAUNCHER, *example_args(tmp_path, tmp_path / "a")], capture_output=True,
                              text=True, timeout=JOB_SECONDS + 60, env=env, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert straight.returncode == 0, straight.stderr
    want = {int(m[1]): m[2] for m in map(STEP_RE.match, straight.stdout.splitlines()) if m}
    assert sorted(want) == list(range(60))

    job = subprocess.Popen([*LAUNCHER, "--max-restarts", "1", *example_args(tmp_path, tmp_path / "b"),
                            "--test-hold-at", "26"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                           stdin=subprocess.DEVNULL)
    steps, killed = [], []  # (step, loss) in order of arrival; the kill's position in it

    def read():
        for line in job.stdout:
            m = STEP_RE.match(line.strip())
            if m:
                steps.append((int(m[1]), m[2]))
                if int(m[1]) == 25 and not killed:
                    pid = replica_program(1, 0)
                    if pid is not None:
                        os.kill(pid, signal.SIGKILL)
                        killed.append(len(steps))
    errors = []
    readers = [threading.Thread(target=read, daemon=True),
               threading.Thread(target=lambda: errors.append(job.stderr.read()), daemon=True)]
    for reader in readers:
        reader.start()
    try:
        job.wait(timeout=JOB_SECONDS + 60)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    for reader in readers:
        reader.join(5)
    err = "".join(errors)
    assert killed, "replica 1 was not found at step 25"
    assert job.returncode == 0, err
    assert "poprun-lite: attempt 1 of 2 failed" in err
    assert "root cause: replica 1 (rank 1" in err and "signal SIGKILL" in err
    assert "poprun-lite: job succeeded on attempt 2 of 2" in err
    before, after = steps[:killed[0]], steps[killed[0]:]
    assert [s for s, _ in before] == list(range(26))
    # the second attempt resumed from the step-20 checkpoint and ran to the end
    assert [s for s, _ in after] == list(range(20, 60)), after
    assert {s: x for s, x in after if s >= 30} == {s: want[s] for s in range(30, 60)}
