"""examples/dlrm.py at 2 replicas on generated Criteo-format data: it learns (ROC AUC
well above 0.5) and a run resumed from a checkpoint continues exactly as the
uninterrupted run; and its pieces against single-process references."""

import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import JOB_SECONDS, ROOT, clean_env, run_python, timeout_for

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
    for part in ("model.sparse_arch.embedding_bag_collection.t_cat_25.optimizer.accumulator",
                 "model.over_arch.", "optimizer."):
        assert any(n.startswith(part) for n in names), (part, names)
    for name in names:
        np.testing.assert_array_equal(np.load(b / name, allow_pickle=False), np.load(a / name, allow_pickle=False),
                                      err_msg=name)


MODEL_CHECK = """
import sys
sys.path.insert(0, {examples!r})
import numpy as np, torch
import popdist_lite as pl
import dlrm
from popdist_lite.torch import EmbeddingBagCollection, EmbeddingBagConfig

torch.manual_seed(0)
names, rows, B = ["a", "b", "c"], [5, 7, 11], 8
ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t_" + f, embedding_dim=4, num_embeddings=n,
                                                        feature_names=[f], seed=3 + j)
                                     for j, (f, n) in enumerate(zip(names, rows))],
                             optimizer=pl.HostEmbeddingOptimizerSpec(0.5))
model = dlrm.DLRM(ebc, dense_in_features=3, dense_arch_layer_sizes=[16, 4], over_arch_layer_sizes=[32, 1])
rng = np.random.default_rng(1)
dense = rng.random((B, 3)).astype(np.float32)
ids = np.stack([rng.integers(0, n, B) for n in rows], axis=1)
labels = rng.integers(0, 2, B).astype(np.float32)
tables = [t.get_embedding_tensor().copy() for t in ebc.tables.values()]
features = pl.KeyedJaggedArray.from_lengths(names, ids.T.reshape(-1), np.ones(ids.size, np.int64))
W = {{k: v.detach().numpy().astype(np.float64) for k, v in model.state_dict().items()}}

# numpy: bottom MLP, the dot products of every pair of the 4 vectors (i < j, row-major), top MLP
relu = lambda x: np.maximum(x, 0)
def linear(x, name):
    return x @ W[name + ".weight"].T + W[name + ".bias"]
h = relu(linear(relu(linear(dense, "dense_arch.model.0")), "dense_arch.model.2"))
vectors = [h] + [t[ids[:, j]].astype(np.float64) for j, t in enumerate(tables)]
dots = [(vectors[i] * vectors[j]).sum(1) for i in range(4) for j in range(i + 1, 4)]
want = linear(relu(linear(np.concatenate([h, np.stack(dots, 1)], 1), "over_arch.model.0")), "over_arch.model.2")
logits = model(torch.from_numpy(dense), features)
np.testing.assert_allclose(logits.detach().numpy(), want, rtol=1e-5, atol=1e-6)

# one step: each table's looked-up rows move by -0.5 x the loss's gradient for them
# (autograd through the same dense layers, over the rows as leaves)
leaves = [torch.tensor(t, requires_grad=True) for t in tables]
pooled = torch.stack([leaf[torch.from_numpy(ids[:, j])] for j, leaf in enumerate(leaves)], 1)
ref = model.over_arch(model.inter_arch(model.dense_arch(torch.from_numpy(dense)), pooled)).squeeze(1)
torch.nn.functional.binary_cross_entropy_with_logits(ref, torch.from_numpy(labels)).backward()
torch.nn.functional.binary_cross_entropy_with_logits(logits.squeeze(1), torch.from_numpy(labels)).backward()
for leaf, table, t in zip(leaves, ebc.tables.values(), tables):
    assert leaf.grad.abs().sum() > 0
    np.testing.assert_allclose(table.get_embedding_tensor(), t - 0.5 * leaf.grad.numpy(), rtol=1e-5, atol=1e-7)
print("OK")
"""


def test_model_and_tables_against_a_numpy_reference():
    """One process: DLRM's logits over popdist_lite.torch's collection equal numpy's (bottom MLP,
    pairwise dot products in triu order, top MLP, each feature's rows from its own
    table), and a backward applies each table's SGD update to the rows its feature
    looked up."""
    pytest.importorskip("torch", reason="examples/dlrm.py needs PyTorch: pip install '.[dlrm]'")
    r = run_python(MODEL_CHECK.format(examples=str(ROOT / "examples")))
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
