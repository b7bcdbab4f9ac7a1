"""A save that cannot finish leaves the previous checkpoint intact and loadable, and the
job's error names the cause: a replica SIGKILLed in the middle of a save (held there by
the test hook POPDIST_LITE_CHECKPOINT_SLOW_WRITE until the kill), and a full disk (a 1 MiB tmpfs; needs
root, skipped otherwise). Loaded state is compared with each replica's own arrays as
they were saved (tests/progs/checkpoint_prog.py)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import CHECKPOINT_PROG, JOB_SECONDS, ROOT, assemble_dumps, clean_env, run_checkpoint_prog, timeout_for


def _compare(out: Path, replicas: int) -> None:
    want, want_values = assemble_dumps(out, "saved", replicas, "TOKEN")
    got, got_values = assemble_dumps(out, "loaded", replicas, "TOKEN")
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert got_values == want_values


pytestmark = timeout_for(2)


def test_replica_killed_during_save(tmp_path):
    ckpt = tmp_path / "ckpt"
    job = subprocess.Popen([sys.executable, "-m", "popdist_lite_launcher", "--num-replicas", "2", "--timeout",
                            str(JOB_SECONDS), sys.executable, CHECKPOINT_PROG, "torn", ckpt, tmp_path, "TOKEN"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(), cwd=ROOT,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + JOB_SECONDS
        while not any(ckpt.glob(".tmp-step-00000007-*/*.npy")):
            assert job.poll() is None, "the job ended before its second save:\n" + "".join(job.communicate())
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(int((tmp_path / "pid.r1").read_text()), signal.SIGKILL)
        out, err = job.communicate(timeout=JOB_SECONDS)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode != 0
    assert "root cause: replica 1" in err and "signal SIGKILL" in err, err
    assert not (ckpt / "step-00000007").exists()
    run_checkpoint_prog(2, "load", ckpt, tmp_path, "TOKEN")  # latest = step 4 (the program checks), verified on load
    _compare(tmp_path, 2)


@pytest.fixture
def tiny_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True,
                           text=True, timeout=30)
    except OSError as exc:
        pytest.skip(f"cannot run mount: {exc}")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True, timeout=30)


def test_full_disk(tiny_disk, tmp_path):
    ckpt = tiny_disk / "ckpt"
    run_checkpoint_prog(2, "disk", ckpt, tmp_path, "TOKEN")
    for k in range(2):
        error = (tmp_path / f"error.r{k}").read_text()
        assert "No space left on device" in error and "failed" in error and "previous checkpoints are intact" in error
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000004"]
    _compare(tmp_path, 2)
