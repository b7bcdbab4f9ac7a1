"""examples/shakespeare.py in elastic jobs, on this host (docs/elastic.md): with
``--data-order global --global-batch-size G`` a step does the same math at any replica
count (gradient accumulation), so

- 2 replicas x 2 micro-batches from a 4-replica run's step-10 checkpoint end with the
  4-replica run's tables, optimizer state and dense weights (float32 tolerance), with
  its losses;
- grown from 2 to 4 replicas by the launcher (the discovery script offers 4 slots once
  the step-10 checkpoint exists, while the job waits at step 11 for the launcher's
  request: ``--test-hold-at``), the job stops at that step boundary, resumes there at 4
  replicas and prints the losses of an uninterrupted 4-replica run; so does the same job
  with its embedding table on local disk (DiskStorage).

No test depends on how fast a step runs: the grow happens at step 11 whatever the
machine's speed. Every run is under a timeout."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import EXAMPLE, JOB_SECONDS, ROOT, TINY, clean_env, timeout_for

STEP_RE = re.compile(r"^Step (\d+), loss = ([^\s,]+)", re.M)  # then ", R steps/s, ETA T" after step 0
ARGS = ["--seq-len", "20", "--batch-size", "2", "--log-every", "1", "--sample-chars", "0", "--steps", "20",
        "--checkpoint-every", "10", "--data-order", "global", "--global-batch-size", "8", "--clip-norm", "0",
        "--emb-optimizer", "adam"]
#: The step boundary where a job to be grown waits for the launcher's resize request
#: (--test-hold-at): after the step-10 checkpoint, which makes the discovery script offer 4.
GROW_AT = 11
pytestmark = timeout_for(2)  # a test runs at most two jobs (the module's straight run included)


def launch(replicas: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "popdist_lite_launcher", "--num-replicas", replicas,
                           "--timeout", str(JOB_SECONDS), *args], capture_output=True, text=True,
                          timeout=JOB_SECONDS + 60, env=clean_env(), cwd=ROOT, stdin=subprocess.DEVNULL)


def example(tmp_path, ckpt) -> list[str]:
    data = tmp_path / "tiny.txt"
    data.write_text(TINY)
    return [sys.executable, str(EXAMPLE), "--data", str(data), *ARGS, "--checkpoint-dir", str(ckpt), "--resume"]


def losses(stdout: str) -> dict[int, float]:
    return {int(n): float(x) for n, x in STEP_RE.findall(stdout)}


def arrays(ckpt) -> dict[str, np.ndarray]:
    """Every array of a checkpoint at its global shape (python -m popdist_lite.checkpoint export)."""
    from popdist_lite.checkpoint.__main__ import export
    from popdist_lite.checkpoint.manifest import read_manifest

    out = {}
    for name in read_manifest(ckpt)["arrays"]:
        path = ckpt.parent / (name.replace("/", ".") + ".npy")
        export(ckpt, name, path)
        out[name] = np.load(path)
    return out


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted 4-replica run: its losses and checkpoints (steps 10 and 20)."""
    tmp_path = tmp_path_factory.mktemp("straight")
    proc = launch("4", *example(tmp_path, tmp_path / "ckpt"))
    assert proc.returncode == 0, proc.stderr
    assert "4 replica(s) x batch 2," in proc.stdout
    return losses(proc.stdout), tmp_path / "ckpt"


def test_accumulation_at_2_replicas_equals_4(tmp_path, straight):
    want, ckpt = straight
    shutil.copytree(ckpt / "step-00000010", tmp_path / "ckpt" / "step-00000010")
    proc = launch("2", *example(tmp_path, tmp_path / "ckpt"))
    assert proc.returncode == 0, proc.stderr
    assert "2 replica(s) x batch 2 x 2 micro-batches" in proc.stdout
    got = losses(proc.stdout)
    assert sorted(got) == list(range(10, 20))
    np.testing.assert_allclose([got[s] for s in range(10, 20)], [want[s] for s in range(10, 20)], atol=2e-4)
    mine, theirs = arrays(tmp_path / "ckpt" / "step-00000020"), arrays(ckpt / "step-00000020")
    assert sorted(mine) == sorted(theirs) and "embedding/weights" in mine and "params/dense_kernel" in mine
    for name in theirs:
        np.testing.assert_allclose(mine[name], theirs[name], rtol=1e-4, atol=1e-5, err_msg=name)


def grow(tmp_path, command: list[str]) -> subprocess.CompletedProcess:
    """Run ``command`` (an example of 20 steps with ``--checkpoint-dir tmp_path/ckpt --resume``) at 2
    replicas, offered 4 once its step-10 checkpoint exists and held at step
    :data:`GROW_AT` until the launcher asks for the resize: the finished job, checked to
    have stopped at that step boundary, resumed there at 4 replicas and printed every
    step once."""
    ckpt = tmp_path / "ckpt"
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/usr/bin/env bash\nif [ -d {ckpt}/step-00000010 ]; then echo localhost:4; "
                        f"else echo localhost:2; fi\n")
    discover.chmod(0o755)
    proc = launch("4", "--min-replicas", "2", "--host-discovery-script", str(discover), "--discovery-interval",
                  "0.5", *command, "--test-hold-at", str(GROW_AT))
    assert proc.returncode == 0, proc.stderr
    assert re.findall(r"^stopping at step (\d+) for a resize \(checkpoint saved\)$", proc.stdout, re.M) == \
        [str(GROW_AT)], proc.stdout
    assert f"resumed from {ckpt}/step-{GROW_AT:08d} (step {GROW_AT})" in proc.stdout
    assert sorted(losses(proc.stdout)) == list(range(20))  # no step lost or repeated
    assert "poprun-lite: job succeeded on attempt 2; attempts:\n" \
           "  attempt 1: 2 replicas on this host (2); stopped at a step boundary for a resize " \
           "(more replicas on this host)\n" in proc.stderr
    return proc


def test_grown_by_the_launcher_at_a_step_boundary(tmp_path, straight):
    want, _ = straight
    proc = grow(tmp_path, example(tmp_path, tmp_path / "ckpt"))
    got = losses(proc.stdout)
    np.testing.assert_allclose([got[s] for s in range(20)], [want[s] for s in range(20)], atol=2e-4)


def test_grown_with_the_table_on_disk(tmp_path, straight):
    """The same grow with the embedding table on local disk (``--emb-cache-kib``,
    DiskStorage): the 2-replica attempt's disk tables save the step-11 checkpoint, the
    4-replica attempt loads it into four new partition files, and every loss is the
    in-memory 4-replica run's."""
    want, _ = straight
    files = tmp_path / "rows"
    files.mkdir()
    proc = grow(tmp_path, [*example(tmp_path, tmp_path / "ckpt"), "--emb-cache-kib", "60", "--emb-dir", str(files)])
    got = losses(proc.stdout)
    np.testing.assert_allclose([got[s] for s in range(20)], [want[s] for s in range(20)], atol=2e-4)
    read = re.findall(r"^embedding table on disk \(replica 0\): hit rate \S+, (\d+) rows read", proc.stdout, re.M)
    assert read and int(read[-1]) > 0, proc.stdout  # the resumed attempt read its rows from its file
    assert not list(files.iterdir())  # each attempt's partition files are gone with it


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_framework_examples_grow_at_a_step_boundary(tmp_path, framework):
    """shakespeare_torch.py and shakespeare_jax.py ask should_checkpoint() too: grown from
    2 to 4 replicas, each stops at a step boundary and the 4-replica attempt resumes
    there; its first step's loss is that of a 4-replica run started from the same
    checkpoint by hand (the resumed state and feed position are the saved ones)."""
    pytest.importorskip(framework, reason=f"the {framework} extra: pip install '.[{framework}]'")
    data = tmp_path / "tiny.txt"
    data.write_text(TINY)
    script = EXAMPLE.with_name(f"shakespeare_{framework}.py")
    command = [sys.executable, str(script), "--data", str(data), "--seq-len", "20", "--batch-size", "2",
               "--log-every", "1", "--sample-chars", "0", "--steps", "20", "--checkpoint-every", "10",
               "--checkpoint-keep", "100", "--data-order", "global", "--clip-norm", "0", "--lr", "0.05",
               "--emb-lr", "0.5"]
    proc = grow(tmp_path, [*command, "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume"])
    again = tmp_path / "again"
    shutil.copytree(tmp_path / "ckpt" / f"step-{GROW_AT:08d}", again / f"step-{GROW_AT:08d}")
    by_hand = launch("4", *command, "--steps", str(GROW_AT + 1), "--checkpoint-dir", str(again), "--resume")
    assert by_hand.returncode == 0, by_hand.stderr
    assert losses(by_hand.stdout) == {GROW_AT: losses(proc.stdout)[GROW_AT]}


def test_global_order_is_one_sequence_at_every_shard_count():
    """make_dataset with offset: shard k of n from offset P yields global batches P+k,
    P+k+n, ... of one sequence, the same for every n, in which each epoch holds every
    chunk of the text exactly once."""
    sys.path.insert(0, str(EXAMPLE.parent))
    from shakespeare import make_dataset

    ids = np.arange(21 * 30, dtype=np.int32)  # 30 distinct chunks of 21 characters
    kw = dict(text_ids=ids, seq_len=20, batch_size=4, seed=3)
    one = make_dataset(0, 1, offset=0, **kw)
    sequence = [next(one)["ids"] for _ in range(45)]  # 180 samples: 6 epochs of 30 chunks
    starts = np.concatenate(sequence)[:, 0] // 21
    for epoch in range(6):
        assert sorted(starts[30 * epoch:30 * (epoch + 1)]) == list(range(30))
    for n, offset in ((3, 0), (2, 7), (4, 13)):
        for k in range(n):
            shard = make_dataset(k, n, offset=offset, **kw)
            for g in range(offset + k, 45, n):
                assert np.array_equal(next(shard)["ids"], sequence[g]), (n, offset, k, g)
