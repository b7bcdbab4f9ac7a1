"""examples/dlrm.py at 2 replicas on generated Criteo-format data: it learns (ROC AUC
well above 0.5) and a run resumed from a checkpoint continues exactly as the
uninterrupted run; and its pieces against single-process references."""

import importlib.util
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import JOB_SECONDS, ROOT, clean_env, timeout_for

pytestmark = timeout_for(3)

EXAMPLE = ROOT / "examples" / "dlrm.py"
GENERATOR = ROOT / "scripts" / "make_criteo.py"
LINE_RE = re.compile(r"^Step (\d+), loss = (\S+), AUC = (\S+)", re.M)
BATCH, STEPS, EVERY = 256, 120, 60


def metrics(stdout: str) -> list[tuple[int, str, str]]:
    found = [(int(n), loss, auc) for n, loss, auc in LINE_RE.findall(stdout)]
    assert found, f"no 'Step N, loss = X, AUC = Y' lines in:\n{stdout}"
    return found


def run(args: list[str], feeders: int = 0) -> str:
    cmd = [sys.executable, "-m", "popdist_lite_launcher", "--num-replicas", "2", "--feeders-per-replica",
           str(feeders), "--timeout", str(JOB_SECONDS), sys.executable, str(EXAMPLE), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_SECONDS + 60, env=clean_env(), cwd=ROOT,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("criteo")
    subprocess.run([sys.executable, str(GENERATOR), str(out), "--rows", str(2 * BATCH * STEPS), "--files", "3"],
                   check=True, timeout=JOB_SECONDS, stdout=subprocess.DEVNULL)
    return out


def test_trains_at_two_replicas_and_resumes_exactly(data, tmp_path):
    """120 steps at 2 replicas with one feed process each: the AUC of the last 20 steps'
    predictions is well above 0.5. Then the step-60 checkpoint, resumed at 2 replicas
    with the feed in a thread: the same log loss and AUC at every printed step, and a
    step-120 checkpoint equal bit for bit (the tables and their Adagrad state, the dense
    weights, torch.optim's state, the feed position)."""
    pytest.importorskip("torch", reason="examples/dlrm.py needs PyTorch: pip install '.[dlrm]'")
    pytest.importorskip("sklearn", reason="examples/dlrm.py needs scikit-learn: pip install '.[dlrm]'")
    args = ["--data", str(data), "--steps", str(STEPS), "--batch-size", str(BATCH), "--num-embeddings", "10000",
            "--log-every", "20", "--checkpoint-every", str(EVERY), "--checkpoint-keep", "10"]
    straight = metrics(run([*args, "--checkpoint-dir", str(tmp_path / "a")], feeders=1))
    assert [n for n, _, _ in straight] == [0, *range(19, STEPS, 20)]
    auc = [float(a) for _, _, a in straight]
    assert auc[-1] > 0.65 and auc[-1] > auc[0] + 0.1, straight
    assert float(straight[-1][1]) < float(straight[0][1]) - 0.1, straight  # log loss

    shutil.copytree(tmp_path / "a" / f"step-{EVERY:08d}", tmp_path / "b" / f"step-{EVERY:08d}")
    out = run([*args, "--checkpoint-dir", str(tmp_path / "b"), "--resume"])
    assert f"resumed from {tmp_path / 'b' / f'step-{EVERY:08d}'} (step {EVERY})" in out
    assert metrics(out) == [m for m in straight if m[0] >= EVERY]
    a, b = tmp_path / "a" / f"step-{STEPS:08d}", tmp_path / "b" / f"step-{STEPS:08d}"
    names = sorted(p.name for p in a.glob("*.npy"))
    assert names == sorted(p.name for p in b.glob("*.npy"))
    for part in ("model.sparse_arch.embedding_bag_collection.embedding_bags.t_cat_25.optimizer.accumulator",
                 "model.over_arch.", "optimizer."):
        assert any(n.startswith(part) for n in names), (part, names)
    for name in names:
        np.testing.assert_array_equal(np.load(b / name, allow_pickle=False), np.load(a / name, allow_pickle=False),
                                      err_msg=name)
