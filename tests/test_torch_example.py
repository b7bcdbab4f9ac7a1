"""examples/shakespeare_torch.py against the numpy example, and the binding's import
boundary: ``import popdist_lite`` never imports torch."""

import re
import subprocess
import sys

import numpy as np
import pytest

from helpers import JOB_SECONDS, ROOT, TINY, check_run_lines, clean_env, timeout_for

pytestmark = timeout_for(3)

TORCH_EXAMPLE = ROOT / "examples" / "shakespeare_torch.py"
NUMPY_EXAMPLE = ROOT / "examples" / "shakespeare.py"
STEP_RE = re.compile(r"^Step (\d+), loss = ([^\s,]+)", re.M)  # then ", R steps/s, ETA T" after step 0


def losses(stdout: str) -> list[tuple[int, float]]:
    found = [(int(n), float(x)) for n, x in STEP_RE.findall(stdout)]
    assert found, f"no 'Step N, loss = X' lines in:\n{stdout}"
    return found


def run(replicas: int, script, args: list[str], timeout: float = JOB_SECONDS + 60) -> str:
    cmd = [sys.executable, str(script), *args]
    if replicas > 1:
        cmd = [sys.executable, "-m", "popdist_lite_launcher", "--num-replicas", str(replicas),
               "--timeout", str(timeout - 60), *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=clean_env(), cwd=ROOT,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_import_popdist_lite_does_not_import_torch():
    code = "import popdist_lite, sys; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=JOB_SECONDS, env=clean_env())


@pytest.fixture
def tiny(tmp_path):
    p = tmp_path / "tiny.txt"
    p.write_text(TINY)
    return p


@pytest.mark.parametrize("strategy", ["TOKEN", "ENCODING"])
def test_losses_equal_the_numpy_example_at_two_replicas(tiny, strategy):
    """The same initial weights, data and math (clipping off: the two examples clip at
    different points, see the example's docstring): 20 equal losses, to the printed 4
    decimals (float32 rounding differs between torch's GRU and char_model's; 2e-4 allows
    a last-digit difference)."""
    pytest.importorskip("torch", reason="popdist_lite.torch needs PyTorch: pip install '.[torch]'")
    args = ["--data", str(tiny), "--steps", "20", "--seq-len", "20", "--batch-size", "4", "--log-every", "1",
            "--clip-norm", "0", "--lr", "0.2", "--emb-lr", "2", "--sample-chars", "0",
            "--partition-strategy", strategy]
    torch_losses = losses(run(2, TORCH_EXAMPLE, args))
    numpy_losses = losses(run(2, NUMPY_EXAMPLE, args))
    assert [n for n, _ in torch_losses] == list(range(20))
    assert [n for n, _ in torch_losses] == [n for n, _ in numpy_losses]
    for (n, got), (_, want) in zip(torch_losses, numpy_losses):
        assert got == pytest.approx(want, abs=2e-4), f"step {n}: torch {got}, numpy {want}"
    assert torch_losses[-1][1] < torch_losses[0][1] - 1.0  # it learns


def test_single_process_mixed_precision_with_loss_scaling_and_clipping(tiny, tmp_path):
    pytest.importorskip("torch", reason="popdist_lite.torch needs PyTorch: pip install '.[torch]'")
    out = run(1, TORCH_EXAMPLE, ["--data", str(tiny), "--steps", "30", "--seq-len", "20", "--batch-size", "8",
                                 "--log-every", "10", "--precision", "mixed", "--loss-scaling", "dynamic",
                                 "--stochastic-rounding", "--emb-optimizer", "adam", "--sample-chars", "40",
                                 "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "15"])
    lines = check_run_lines(out, "shakespeare_torch.py", checkpoints=[15, 30])
    assert lines[:2] == ["shakespeare_torch.py: importing PyTorch ...",
                         f"shakespeare_torch.py: starting MPI, then reading {tiny} and making the 256 x 256 TOKEN "
                         f"embedding table ..."]
    found = losses(out)
    assert [n for n, _ in found] == [0, 9, 19, 29]
    assert found[-1][1] < found[0][1] - 1.0, found
    assert "final loss scale" in out and "--- sample ---" in out and "1 replica(s)" in out


@pytest.mark.parametrize("extra", [[], ["--partition-strategy", "ENCODING", "--emb-optimizer", "adam",
                                        "--loss-scaling", "dynamic", "--checkpoint-async"]],
                         ids=["token-sgd", "encoding-adam-scaler-async"])
def test_resumed_run_continues_exactly_as_a_straight_one(tiny, tmp_path, extra):
    """40 straight steps against 20, then --resume from the step-20 checkpoint to 40, at 2
    replicas: the same losses at every step (the model, the table and its optimizer state,
    torch.optim's momentum, the loss scaler and the feed position all restored); and the
    same final table and dense weights in both runs' step-40 checkpoints, bit for bit."""
    pytest.importorskip("torch", reason="popdist_lite.torch needs PyTorch: pip install '.[torch]'")
    args = ["--data", str(tiny), "--seq-len", "20", "--batch-size", "4", "--log-every", "1", "--sample-chars",
            "0", "--checkpoint-every", "10", "--checkpoint-keep", "10", *extra]
    straight = losses(run(2, TORCH_EXAMPLE, [*args, "--steps", "40", "--checkpoint-dir", str(tmp_path / "a")]))
    first = losses(run(2, TORCH_EXAMPLE, [*args, "--steps", "20", "--checkpoint-dir", str(tmp_path / "b")]))
    out = run(2, TORCH_EXAMPLE, [*args, "--steps", "40", "--checkpoint-dir", str(tmp_path / "b"), "--resume"])
    assert f"resumed from {tmp_path / 'b' / 'step-00000020'} (step 20)" in out
    resumed = first + losses(out)
    assert [n for n, _ in resumed] == list(range(40)) == [n for n, _ in straight]
    assert resumed == straight
    a, b = tmp_path / "a" / "step-00000040", tmp_path / "b" / "step-00000040"
    names = sorted(p.name for p in a.glob("*.npy"))
    assert names == sorted(p.name for p in b.glob("*.npy"))
    for part in ("embedding.", "model.gru.", "optimizer."):
        assert any(n.startswith(part) for n in names), (part, names)
    for name in names:
        np.testing.assert_array_equal(np.load(b / name, allow_pickle=False), np.load(a / name, allow_pickle=False),
                                      err_msg=name)


def test_checkpoint_options_are_checked():
    pytest.importorskip("torch", reason="popdist_lite.torch needs PyTorch: pip install '.[torch]'")
    for bad in (["--resume"], ["--checkpoint-every", "5"], ["--checkpoint-dir", "x", "--checkpoint-every", "0"]):
        r = subprocess.run([sys.executable, str(TORCH_EXAMPLE), *bad], capture_output=True, text=True, timeout=JOB_SECONDS,
                           env=clean_env(), cwd=ROOT, stdin=subprocess.DEVNULL)
        assert r.returncode == 2 and "--checkpoint" in r.stderr, (bad, r.stderr)
