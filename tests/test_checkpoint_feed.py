"""The feed position in checkpoints (docs/checkpoint.md), against the batch numbers an
uninterrupted run takes: replica r of R takes global batches r, r + R, r + 2R, ... of a
dataset sharded as tf.data's shard, for any number of feeders F.

- Same replica count (any F): the resumed run takes exactly the batches the
  uninterrupted run would have taken next.
- R -> R': every replica resumes at step ceil(S*R/R'): no batch taken before is taken
  again, and fewer than R' batches are skipped.
- A dataset with an ``offset`` parameter resumes exactly at the global position S*R at
  any R' and F': every batch taken exactly once (also from a checkpoint of the older
  form, which holds no ``position``)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import JOB_SECONDS, ROOT, clean_env, timeout_for

PROG = str(Path(__file__).parent / "progs" / "checkpoint_feed_prog.py")
STEPS = 5
pytestmark = timeout_for(2)


def _run(replicas, feeders, *args):
    r = subprocess.run([sys.executable, "-m", "popdist_lite_launcher", "--num-replicas", str(replicas),
                        "--feeders-per-replica", str(feeders), "--timeout", str(JOB_SECONDS), sys.executable, PROG,
                        *map(str, args)], capture_output=True, text=True, timeout=JOB_SECONDS + 60, env=clean_env(),
                       cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("before,after,variant", [((2, 2), (2, 1), "iterate"), ((2, 0), (3, 1), "iterate"),
                                                  ((3, 0), (2, 0), "start")])
def test_feed_position(tmp_path, before, after, variant):
    (r, f), (r2, f2) = before, after
    ckpt = tmp_path / "ckpt"
    _run(r, f, "save", ckpt, tmp_path / "first.json", STEPS, variant)
    _run(r2, f2, "load", ckpt, tmp_path / "second.json", STEPS, variant)
    first = json.loads((tmp_path / "first.json").read_text())
    second = json.loads((tmp_path / "second.json").read_text())
    assert first == [[k + s * r for s in range(STEPS)] for k in range(r)]
    resume = STEPS if r2 == r else -(-STEPS * r // r2)
    assert second == [[k + s * r2 for s in range(resume, resume + STEPS)] for k in range(r2)]
    taken = sorted(g for part in first + second for g in part)
    assert len(set(taken)) == len(taken), "a batch was taken twice"
    skipped = set(range(max(taken))) - set(taken)
    assert len(skipped) < r2 if r2 != r else not skipped


@pytest.mark.parametrize("before,after,old_form", [((2, 0), (3, 1), False), ((3, 1), (2, 2), False),
                                                  ((2, 2), (3, 0), True)])
def test_feed_position_exact(tmp_path, before, after, old_form):
    (r, f), (r2, f2) = before, after
    ckpt = tmp_path / "ckpt"
    _run(r, f, "save", ckpt, tmp_path / "first.json", STEPS, "offset")
    if old_form:  # as saved before positions were kept: steps, replicas and feeders only
        [manifest] = ckpt.glob("step-*/manifest.json")
        content = json.loads(manifest.read_text())
        assert content["values"]["feed"].pop("position") == STEPS * r
        manifest.write_text(json.dumps(content))
    _run(r2, f2, "load", ckpt, tmp_path / "second.json", STEPS, "offset")
    first = json.loads((tmp_path / "first.json").read_text())
    second = json.loads((tmp_path / "second.json").read_text())
    assert first == [[k + s * r for s in range(STEPS)] for k in range(r)]
    assert second == [[STEPS * r + k + s * r2 for s in range(STEPS)] for k in range(r2)]
    taken = sorted(g for part in first + second for g in part)
    assert taken == list(range(STEPS * (r + r2)))  # every batch once, none skipped


def test_open_dataset_and_feeder_skip():
    from popdist_lite.infeed.position import feeder_skip, open_dataset

    calls = []

    def jumps(shard, shards, start=0):
        calls.append(start)
        return iter(range(start, 10))

    assert list(open_dataset(jumps, 0, 1, 3)) == list(range(3, 10)) and calls == [3]
    assert list(open_dataset(lambda shard, shards: iter(range(10)), 0, 1, 3)) == list(range(3, 10))
    assert list(open_dataset(lambda shard, shards: iter(range(2)), 0, 1, 5)) == []
    # steps 0..4 with 2 feeders: feeder 0 served 0, 2, 4; feeder 1 served 1, 3
    assert [feeder_skip(5, 2, k) for k in (0, 1)] == [3, 2]
    assert [feeder_skip(0, 3, k) for k in (0, 1, 2)] == [0, 0, 0]
