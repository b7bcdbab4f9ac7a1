"""Smoke tests of examples/shakespeare.py on a tiny text, its data pipeline, and the
network-free paths of scripts/fetch_shakespeare."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import (EXAMPLE, JOB_SECONDS, ROOT, TINY, check_run_lines, clean_env, run_mpi, run_on_a_terminal,
                     timeout_for)

FETCH = ROOT / "scripts" / "fetch_shakespeare"
sys.path.insert(0, str(ROOT / "examples"))

STEP_RE = re.compile(r"^Step (\d+), loss = ([^\s,]+)", re.M)  # then ", R steps/s, ETA T" after step 0
pytestmark = timeout_for(2)

@pytest.fixture
def tiny(tmp_path):
    p = tmp_path / "tiny.txt"
    p.write_text(TINY)
    return p


def _steps(stdout):
    found = [(int(n), float(x)) for n, x in STEP_RE.findall(stdout)]
    assert found, f"no 'Step N, loss = X' lines in:\n{stdout}"
    for n, x in found:
        assert math.isfinite(x), f"step {n}: loss {x}"
    return found


def _run(args, timeout=JOB_SECONDS, **env):
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True,
                          timeout=timeout, env=clean_env(**env), cwd=ROOT)


def test_single_process(tiny, tmp_path):
    r = _run(["--data", str(tiny), "--steps", "3", "--seq-len", "20", "--batch-size", "4",
              "--log-every", "1", "--sample-chars", "40", "--checkpoint-dir", str(tmp_path / "ckpt"),
              "--checkpoint-every", "2"])
    assert r.returncode == 0, r.stdout + r.stderr
    lines = check_run_lines(r.stdout, "shakespeare.py", checkpoints=[2, 3])
    assert lines[0] == (f"shakespeare.py: starting MPI, then reading {tiny} and making the 256 x 256 TOKEN "
                        f"embedding table ...")
    steps = _steps(r.stdout)
    assert [n for n, _ in steps] == [0, 1, 2]
    # an untrained model over 256 outputs starts near ln(256) = 5.55
    assert 4.5 < steps[0][1] < 6.5
    assert "1 replica(s)" in r.stdout
    assert "--- sample ---" in r.stdout
    assert "\r" not in r.stdout, "no progress bar when stdout is not a terminal"


def test_guide_config(tiny):
    r = _run(["--data", str(tiny), "--steps", "2", "--seq-len", "20", "--batch-size", "4",
              "--log-every", "1", "--sample-chars", "5", "--guide-config"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert [n for n, _ in _steps(r.stdout)] == [0, 1]
    assert "sequences of 19" in r.stdout and "last-char label" in r.stdout
    assert "lr 0.0001, momentum 0.99" in r.stdout


def test_loss_falls(tiny):
    """A few dozen steps on a repetitive text: the loss must drop clearly."""
    r = _run(["--data", str(tiny), "--steps", "40", "--seq-len", "20", "--batch-size", "8",
              "--log-every", "10", "--sample-chars", "0"])
    assert r.returncode == 0, r.stdout + r.stderr
    steps = _steps(r.stdout)
    assert steps[-1][1] < steps[0][1] - 1.0, steps


@pytest.mark.parametrize("strategy", ["TOKEN", "ENCODING"])
def test_two_ranks(tiny, strategy):
    r = run_mpi(2, [sys.executable, str(EXAMPLE), "--data", str(tiny), "--steps", "3",
                    "--seq-len", "20", "--batch-size", "4", "--log-every", "1",
                    "--sample-chars", "20", "--partition-strategy", strategy],
                env=clean_env())
    assert r.returncode == 0, r.stdout + r.stderr
    steps = _steps(r.stdout)
    # only replica 0 prints
    assert [n for n, _ in steps] == [0, 1, 2], r.stdout
    assert "2 replica(s)" in r.stdout and f"{strategy} embedding" in r.stdout
    assert r.stdout.count("--- sample ---") == 1
    check_run_lines(r.stdout, "shakespeare.py")  # only replica 0 prints, from its first line on


def test_missing_data_file(tmp_path):
    r = _run(["--data", str(tmp_path / "nope.txt"), "--steps", "1"])
    assert r.returncode != 0
    assert "data file not found" in r.stderr and "nope.txt" in r.stderr


def test_text_too_short(tmp_path):
    p = tmp_path / "short.txt"
    p.write_text("abc")
    r = _run(["--data", str(p), "--steps", "1", "--seq-len", "20"])
    assert r.returncode != 0
    assert "too short" in r.stderr


@pytest.mark.parametrize("rows, columns", [(24, 80), (0, 0)], ids=["80x24", "0x0"])
def test_progress_bar_on_a_terminal(tiny, rows, columns):
    """On a terminal (single process) a tqdm bar is drawn, also on one whose size is
    unknown (0 x 0, the pty Open MPI gives a rank under poprun-lite, where tqdm alone
    draws a bar of no width: a blank line); the step lines still appear."""
    code, out = run_on_a_terminal([sys.executable, str(EXAMPLE), "--data", str(tiny), "--steps", "3", "--seq-len",
                                   "20", "--batch-size", "4", "--log-every", "1", "--sample-chars", "0"], rows, columns)
    assert code == 0, out
    assert re.search(r"100%\|#*\| 3/3 \[", out) or re.search(r"100%\|█+\| 3/3 \[", out), out
    assert [n for n, _ in _steps(out.replace("\r\n", "\n").replace("\r", "\n"))] == [0, 1, 2]


@pytest.mark.parametrize("matplotlib", [True, False], ids=["matplotlib", "no-matplotlib"])
def test_log_dir_holds_the_lines_and_the_loss_curve(tiny, tmp_path, matplotlib):
    """--log-dir DIR: DIR/log.txt holds what replica 0 printed, DIR/loss.png the loss curve
    (a 640 x 360 PNG); without matplotlib, one line says so and the run goes on."""
    env = {}
    if matplotlib:
        pytest.importorskip("matplotlib", reason="the loss curve needs the [plot] extra")
    else:  # a matplotlib that cannot be imported, ahead of any installed one
        (tmp_path / "block" / "matplotlib").mkdir(parents=True)
        (tmp_path / "block" / "matplotlib" / "__init__.py").write_text("raise ImportError('not installed')\n")
        env["PYTHONPATH"] = str(tmp_path / "block")
    log_dir = tmp_path / "run"
    r = _run(["--data", str(tiny), "--steps", "4", "--seq-len", "20", "--batch-size", "4", "--log-every", "2",
              "--sample-chars", "0", "--log-dir", str(log_dir)], **env)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = check_run_lines(r.stdout, "shakespeare.py")
    assert (log_dir / "log.txt").read_text() == r.stdout
    curve = log_dir / "loss.png"
    if matplotlib:
        assert lines[-2] == f"loss curve: {curve}"
        png = curve.read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
        assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (640, 360)
    else:
        assert lines[-2] == "no loss curve: matplotlib is not installed (pip install 'popdist-lite[plot]')"
        assert not curve.exists()


# ---------------------------------------------------------------------------------------
# the data pipeline
# ---------------------------------------------------------------------------------------
def _take(it, n):
    return [next(it)["ids"] for _ in range(n)]


def test_make_dataset_shapes_and_determinism():
    from shakespeare import encode_text, make_dataset
    vocab, ids = encode_text(TINY)
    assert vocab == sorted(set(TINY))
    assert "".join(np.array(vocab)[ids]) == TINY
    kw = dict(text_ids=ids, seq_len=20, batch_size=4, seed=3)
    a = _take(make_dataset(0, 2, **kw), 5)
    b = _take(make_dataset(0, 2, **kw), 5)
    assert all(x.shape == (4, 21) and x.dtype == np.int32 for x in a)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    c = _take(make_dataset(0, 2, **{**kw, "seed": 4}), 5)
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    # every row is one of shard 0's chunks: text chunks 0, 2, 4, ... of 21 characters
    n = len(ids) // 21
    shard0 = {tuple(c) for c in ids[: n * 21].reshape(n, 21)[0::2]}
    assert all(tuple(row) in shard0 for row in np.concatenate(a))


def test_make_dataset_shards_partition_the_chunks():
    from shakespeare import make_dataset
    ids = np.arange(21 * 30, dtype=np.int32)  # 30 distinct chunks, chunk k starts at 21k
    seen = {}
    for shard in range(3):
        # 5 epochs of this shard's 10 chunks
        rows = np.concatenate(_take(make_dataset(shard, 3, text_ids=ids, seq_len=20,
                                                 batch_size=4, seed=0), 25))
        starts = rows[:, 0] // 21
        assert np.array_equal(rows, starts[:, None] * 21 + np.arange(21))
        counts = np.bincount(starts, minlength=30)
        seen[shard] = set(np.flatnonzero(counts))
        assert seen[shard] == set(range(shard, 30, 3))  # ds.shard(3, shard)
        assert set(counts[counts > 0]) == {10}  # each chunk once per epoch
    assert set().union(*seen.values()) == set(range(30))


def test_make_dataset_errors():
    from shakespeare import make_dataset
    ids = np.zeros(50, dtype=np.int32)
    with pytest.raises(ValueError, match="too short"):
        make_dataset(0, 3, text_ids=ids, seq_len=20, batch_size=2, seed=0)
    with pytest.raises(ValueError):
        make_dataset(2, 2, text_ids=ids, seq_len=20, batch_size=2, seed=0)


# ---------------------------------------------------------------------------------------
# scripts/fetch_shakespeare (network-free paths only)
# ---------------------------------------------------------------------------------------
def test_fetch_is_executable_and_idempotent(tmp_path):
    assert os.access(FETCH, os.X_OK)
    out = tmp_path / "corpus.txt"
    out.write_text("already here\n")
    r = subprocess.run([str(FETCH), "--output", str(out)], capture_output=True, text=True,
                       timeout=JOB_SECONDS)
    assert r.returncode == 0, r.stderr
    assert "already exists" in r.stdout
    assert out.read_text() == "already here\n"
    r = subprocess.run([str(FETCH), "--help"], capture_output=True, text=True, timeout=JOB_SECONDS)
    assert r.returncode == 0 and "--force" in r.stdout


@pytest.mark.parametrize("mode", [["--precision", "fp16", "--loss-scaling", "dynamic", "--stochastic-rounding"],
                                  ["--precision", "mixed", "--loss-scaling", "static"],
                                  ["--precision", "fp16"]])
def test_reduced_precision_trains_like_fp32(tiny, mode):
    """float16 modes on 2 ranks: the loss falls, tracking the fp32 run of the same seed."""
    args = ["--data", str(tiny), "--steps", "30", "--seq-len", "20", "--batch-size", "8",
            "--log-every", "10", "--sample-chars", "0"]
    runs = [run_mpi(2, [sys.executable, str(EXAMPLE), *args, *extra], env=clean_env())
            for extra in ([], mode)]
    for r in runs:
        assert r.returncode == 0, r.stdout + r.stderr
    fp32, half = (_steps(r.stdout) for r in runs)
    assert [n for n, _ in half] == [n for n, _ in fp32]
    assert half[-1][1] < half[0][1] - 1.0, half
    for (_, a), (_, b) in zip(fp32, half):
        assert abs(a - b) < 0.1 * a, (fp32, half)
    assert f"precision {mode[1]}" in runs[1].stdout


def test_feeders_give_the_same_losses(tiny):
    """poprun-lite --feeders-per-replica 1 trains to the same losses as without feeders."""
    args = [sys.executable, str(EXAMPLE), "--data", str(tiny), "--steps", "6", "--seq-len", "20",
            "--batch-size", "4", "--log-every", "1", "--sample-chars", "0"]
    runs = []
    for feeders in ("0", "1"):
        r = subprocess.run([sys.executable, "-m", "popdist_lite_launcher", "--num-replicas", "2",
                            "--feeders-per-replica", feeders, "--timeout", str(JOB_SECONDS), *args],
                           capture_output=True, text=True, timeout=JOB_SECONDS + 60, env=clean_env(), cwd=ROOT)
        assert r.returncode == 0, r.stdout + r.stderr
        runs.append(_steps(r.stdout))
    assert len(runs[0]) == 6 and runs[0] == runs[1], runs
