"""Checkpoints of a PyTorch job across replica counts (tests/progs/torch_checkpoint_prog.py):
saved at 2 replicas after 4 steps, loaded at 3 (and 1, and into the other partition
strategy) by fresh modules and a fresh torch.optim optimizer, the full tables, the table
optimizers' slots, the dense weights, the torch optimizer's state and the loss scale
equal the saved ones bit for bit; training continued from the checkpoint equals a
single-process torch reference trained straight through (nn.Embedding with
torch.optim.SparseAdam, nn.EmbeddingBag with Adagrad, the MLP with Adam, on the global
batch), and the save job's own continuation.

Full table arrays are assembled here with numpy from each replica's local arrays by the
partition rules (TOKEN row i on replica i % r at local row i // r; ENCODING columns
[k*c, (k+1)*c)), not by the checkpoint code."""

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="popdist_lite.torch needs PyTorch: pip install '.[torch]'")

from progs import torch_checkpoint_prog as prog  # noqa: E402
from helpers import ROOT, run_mpi, timeout_for  # noqa: E402

PROG = str(ROOT / "tests" / "progs" / "torch_checkpoint_prog.py")
F = torch.nn.functional
pytestmark = timeout_for(2)  # the module's save and a load


def run_prog(ranks: int, *args) -> None:
    try:
        r = run_mpi(ranks, [sys.executable, PROG, *map(str, args)])
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torch_checkpoint_prog {args} on {ranks} ranks hung:\n{e.stdout!r}")
    assert r.returncode == 0, f"{args} on {ranks} ranks:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"


def assemble(out, tag: str, replicas: int, strategy: str) -> dict:
    """Full table arrays from every replica's local ones, by the partition rules."""
    parts = [np.load(out / f"{tag}.r{k}.npz", allow_pickle=False) for k in range(replicas)]
    full = {}
    for name in parts[0].files:
        local = [p[name] for p in parts]
        t = prog.T_EMB if name.startswith("emb/") else prog.T_BAG
        if strategy == "TOKEN":
            full[name] = np.stack([local[i % replicas][i // replicas] for i in range(t)])
        elif local[0].ndim == 1:  # ENCODING "row" arrays: every replica holds all rows
            for other in local[1:]:
                np.testing.assert_array_equal(other, local[0], err_msg=name)
            full[name] = local[0]
        else:
            c = -(-prog.E // replicas)
            full[name] = np.stack([local[j // c][:, j % c] for j in range(prog.E)], axis=1)
    return full


def reference(out, steps: int) -> dict:
    """Single-process torch on the global batch from the save job's initial weights."""
    initial = np.load(out / "initial.full.npz", allow_pickle=False)
    emb = torch.nn.Embedding.from_pretrained(torch.from_numpy(initial["emb/full"]).double(), freeze=False,
                                             sparse=True)
    bag = torch.nn.EmbeddingBag.from_pretrained(torch.from_numpy(initial["bag/full"]).double(), freeze=False,
                                                mode="sum")
    model = prog.dense_model().double()
    model.load_state_dict({n[len("model/"):]: torch.from_numpy(initial[n]) for n in initial.files
                           if n.startswith("model/")})
    a = prog.EMB_ADAM
    optimizers = [torch.optim.SparseAdam(emb.parameters(), lr=a["learning_rate"], betas=(a["beta1"], a["beta2"]),
                                         eps=a["epsilon"]),
                  torch.optim.Adagrad(bag.parameters(), lr=prog.BAG_ADAGRAD["learning_rate"],
                                      initial_accumulator_value=prog.BAG_ADAGRAD["initial_accumulator_value"],
                                      eps=prog.BAG_ADAGRAD["epsilon"]),
                  torch.optim.Adam(model.parameters(), lr=prog.DENSE_LR)]
    for step in range(steps):
        ids, bag_ids, y = (torch.from_numpy(a) for a in prog.batch(step))
        features = torch.cat([emb(ids).sum(1), bag(bag_ids)], 1)
        loss = ((model(features) - y.double()) ** 2).mean()
        for o in optimizers:
            o.zero_grad()
        loss.backward()
        for o in optimizers:
            o.step()
    return {"emb/full": emb.weight.detach().numpy(), "bag/full": bag.weight.detach().numpy(),
            **{f"model/{n}": p.detach().numpy() for n, p in model.state_dict().items()}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of step 4 written at 2 replicas (TOKEN), and that job's dumps."""
    base = tmp_path_factory.mktemp("torch-saved")
    run_prog(2, "save", base / "ckpt", base, "TOKEN")
    return base


@pytest.mark.parametrize("ranks,strategy", [(3, "TOKEN"), (3, "ENCODING"), (1, "TOKEN")])
def test_resume_at_another_replica_count(saved, tmp_path, ranks, strategy):
    run_prog(ranks, "load", saved / "ckpt", tmp_path, strategy)
    # the loaded state is the saved state, bit for bit
    want, got = assemble(saved, "saved", 2, "TOKEN"), assemble(tmp_path, "loaded", ranks, strategy)
    assert sorted(got) == sorted(want) == sorted(
        ["emb/weights", "emb/optimizer/m", "emb/optimizer/v", "emb/optimizer/steps", "bag/weights",
         "bag/optimizer/accumulator"])
    assert want["emb/optimizer/steps"].min() == prog.SAVE_AT  # every row was trained at every step
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    want_full = np.load(saved / "saved.full.npz", allow_pickle=False)
    got_full = np.load(tmp_path / "loaded.full.npz", allow_pickle=False)
    assert sorted(got_full.files) == sorted(want_full.files)
    assert {"opt/0/exp_avg", "opt/3/exp_avg_sq", "opt/3/step"} <= set(want_full.files)
    for name in want_full.files:
        if name == "values":  # step and loss scale equal; the replica count is the job's
            assert got_full[name][:2].tolist() == want_full[name][:2].tolist() == [prog.SAVE_AT, 2.0 ** 5]
            assert got_full[name][2] == ranks
        else:
            np.testing.assert_array_equal(got_full[name], want_full[name], err_msg=name)
    # training continued from it = the single-process reference trained straight through
    # = the 2-replica job that saved it, continued
    ref = reference(saved, prog.END)
    continued = np.load(tmp_path / "continued.full.npz", allow_pickle=False)
    at_two = np.load(saved / "continued.full.npz", allow_pickle=False)
    for name, value in ref.items():
        np.testing.assert_allclose(continued[name], value, rtol=1e-4, atol=2e-6, err_msg=name)
        np.testing.assert_allclose(continued[name], at_two[name], rtol=1e-5, atol=1e-6, err_msg=name)
        assert not np.array_equal(continued[name], want_full[name]), f"{name} did not train after the load"
