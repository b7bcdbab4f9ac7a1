"""Resume equivalence of the main job (examples/shakespeare.py under poprun-lite, 2
replicas): 40 straight steps against a run whose whole job is SIGKILLed after its step-20
checkpoint and resumed to step 40: the same losses step by step, and bit-identical
tables, optimizer state and dense weights in the two step-40 checkpoints. For SGD and
Adam tables, and with one feeder process per replica. The killed run waits at step 21
(``--test-hold-at``), so the kill lands there whatever the machine's speed."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import EXAMPLE, JOB_SECONDS, ROOT, TINY, clean_env, timeout_for

STEP_RE = re.compile(r"^Step (\d+), loss = ([^\s,]+)", re.M)  # then ", R steps/s, ETA T" after step 0


pytestmark = timeout_for(3)


def _command(feeders: int, *args) -> list[str]:
    return [sys.executable, "-m", "popdist_lite_launcher", "--num-replicas", "2", "--feeders-per-replica",
            str(feeders), "--timeout", str(JOB_SECONDS), sys.executable, str(EXAMPLE), *map(str, args)]


def _losses(stdout: str) -> dict[int, str]:
    return {int(n): x for n, x in STEP_RE.findall(stdout)}


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_bytes()
            except OSError:
                continue
            ppid = int(stat[stat.rfind(b")") + 2:].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def _checkpoint_arrays(path: Path) -> dict[str, np.ndarray]:
    return {f.name: np.load(f, allow_pickle=False) for f in sorted(path.glob("*.npy"))}


@pytest.mark.parametrize("optimizer,feeders", [("sgd", 0), ("adam", 0), ("sgd", 1)])
def test_killed_job_resumes_exactly(tmp_path, optimizer, feeders):
    data = tmp_path / "tiny.txt"
    data.write_text(TINY)
    common = ["--data", data, "--seq-len", 20, "--batch-size", 4, "--log-every", 1, "--sample-chars", 0,
              "--emb-optimizer", optimizer, "--checkpoint-every", 20]
    env = clean_env()

    straight = subprocess.run(_command(feeders, *common, "--steps", 40, "--checkpoint-dir", tmp_path / "a"),
                              capture_output=True, text=True, timeout=JOB_SECONDS + 60, env=env, cwd=ROOT)
    assert straight.returncode == 0, straight.stdout + straight.stderr
    want = _losses(straight.stdout)
    assert sorted(want) == list(range(40))

    # The killed run waits at step 21, after its step-20 checkpoint; the whole job is
    # SIGKILLed as soon as that checkpoint is committed.
    ckpt = tmp_path / "b"
    job = subprocess.Popen(_command(feeders, *common, "--steps", 40, "--checkpoint-dir", ckpt, "--test-hold-at", 21),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + JOB_SECONDS
        while not (ckpt / "step-00000020" / "manifest.json").exists():
            assert job.poll() is None, "the job ended before its first checkpoint:\n" + "".join(job.communicate())
            assert time.monotonic() < deadline, f"no checkpoint within {JOB_SECONDS} s"
            time.sleep(0.01)
    finally:
        for pid in _descendants(job.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    out, err = job.communicate(timeout=60)
    assert job.returncode == -signal.SIGKILL, (job.returncode, err)
    assert "trained" not in out
    assert [p.name for p in ckpt.iterdir()] == ["step-00000020"]

    resumed = subprocess.run(_command(feeders, *common, "--steps", 40, "--checkpoint-dir", ckpt, "--resume"),
                             capture_output=True, text=True, timeout=JOB_SECONDS + 60, env=env, cwd=ROOT)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from {ckpt / 'step-00000020'} (step 20)" in resumed.stdout
    got = _losses(resumed.stdout)
    assert sorted(got) == list(range(20, 40))
    assert got == {n: want[n] for n in range(20, 40)}
    a, b = _checkpoint_arrays(tmp_path / "a" / "step-00000040"), _checkpoint_arrays(ckpt / "step-00000040")
    assert sorted(a) == sorted(b) and any("embedding" in name for name in a)
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)
