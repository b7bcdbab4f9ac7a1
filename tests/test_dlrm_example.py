"""examples/dlrm.py at 2 replicas on generated Criteo-format data: it learns (ROC AUC
well above 0.5) and a run resumed from a checkpoint continues exactly as the
uninterrupted run, printing what the examples print (examples/run_log.py); on a
terminal, its progress bar and --log-dir; and its pieces against single-process
references."""

import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import JOB_SECONDS, ROOT, check_run_lines, clean_env, run_on_a_terminal, run_python, timeout_for

pytestmark = timeout_for(3)

EXAMPLE = ROOT / "examples" / "dlrm.py"
GENERATOR = ROOT / "scripts" / "make_criteo.py"
LINE_RE = re.compile(r"^Step (\d+), loss = ([^\s,]+), AUC = ([^\s,]+)", re.M)
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
    predictions is well above 0.5, and replica 0 prints the examples' lines (a first
    line, step lines with the AUC, a rate and an ETA, the checkpoints, the final loss
    and AUC last). Then the step-60 checkpoint, resumed at 2 replicas with the feed in
    a thread: the same log loss and AUC at every printed step, and a step-120 checkpoint
    equal bit for bit (the tables and their Adagrad state, the dense weights,
    torch.optim's state, the feed position)."""
    pytest.importorskip("torch", reason="examples/dlrm.py needs PyTorch: pip install '.[dlrm]'")
    pytest.importorskip("sklearn", reason="examples/dlrm.py needs scikit-learn: pip install '.[dlrm]'")
    args = ["--data", str(data), "--steps", str(STEPS), "--batch-size", str(BATCH), "--num-embeddings", "10000",
            "--log-every", "20", "--checkpoint-every", str(EVERY), "--checkpoint-keep", "10"]
    out = run([*args, "--checkpoint-dir", str(tmp_path / "a")], feeders=1)
    check_run_lines(out, "dlrm.py", checkpoints=[EVERY, STEPS], metrics=("AUC",))
    straight = metrics(out)
    assert [n for n, _, _ in straight] == [0, *range(19, STEPS, 20)]
    auc = [float(a) for _, _, a in straight]
    assert auc[-1] > 0.65 and auc[-1] > auc[0] + 0.1, straight
    assert float(straight[-1][1]) < float(straight[0][1]) - 0.1, straight  # log loss

    shutil.copytree(tmp_path / "a" / f"step-{EVERY:08d}", tmp_path / "b" / f"step-{EVERY:08d}")
    out = run([*args, "--checkpoint-dir", str(tmp_path / "b"), "--resume"])
    assert f"resumed from {tmp_path / 'b' / f'step-{EVERY:08d}'} (step {EVERY})" in out
    check_run_lines(out, "dlrm.py", checkpoints=[STEPS], metrics=("AUC",))
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


def test_on_a_terminal_of_unknown_size_it_draws_a_bar_and_keeps_a_log(data, tmp_path):
    """One process on a pty of size 0 x 0 (what Open MPI gives a rank under poprun-lite,
    where tqdm alone draws nothing): the progress bar is drawn, its total the steps the
    data hold (no --steps: until the data end, counted), with the step lines through it;
    --log-dir DIR holds the lines (log.txt) and the loss curve (loss.png)."""
    pytest.importorskip("torch", reason="examples/dlrm.py needs PyTorch: pip install '.[dlrm]'")
    pytest.importorskip("sklearn", reason="examples/dlrm.py needs scikit-learn: pip install '.[dlrm]'")
    pytest.importorskip("matplotlib", reason="the loss curve needs the [plot] extra")
    lines = 2 * BATCH * STEPS  # the data fixture's
    batch = lines // 6  # 6 steps, the last few lines dropped
    code, out = run_on_a_terminal([sys.executable, str(EXAMPLE), "--data", str(data), "--batch-size", str(batch),
                                   "--num-embeddings", "1000", "--log-every", "2", "--log-dir",
                                   str(tmp_path / "run")], 0, 0)
    assert code == 0, out[-3000:]
    assert re.search(r"100%\|(#|█)+\| 6/6 \[", out), out
    log = (tmp_path / "run" / "log.txt").read_text()
    said = check_run_lines(log, "dlrm.py", metrics=("AUC",))
    assert [n for n, _, _ in metrics(log)] == [0, 1, 3, 5]
    assert said[-2] == f"loss curve: {tmp_path / 'run' / 'loss.png'}"
    for line in said:
        assert line in out.replace("\r\n", "\n").replace("\r", "\n").splitlines(), line
    assert (tmp_path / "run" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
