"""examples/shakespeare_jax.py against examples/shakespeare.py (the numpy job) under
poprun-lite, its checkpoints (a resumed run against a straight one), and the JAX extra
staying optional."""

import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import JOB_SECONDS, ROOT, TINY, check_run_lines, clean_env, timeout_for

pytestmark = timeout_for(3)

EXAMPLES = ROOT / "examples"
STEP_RE = re.compile(r"^Step (\d+), loss = ([^\s,]+)", re.M)  # then ", R steps/s, ETA T" after step 0


def test_popdist_lite_does_not_import_jax():
    code = ("import sys, popdist_lite; assert not {'jax', 'flax', 'optax'} & set(sys.modules), 'imported'; "
            "print('OK')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=JOB_SECONDS, cwd=ROOT,
                       env=clean_env())
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


needs_jax = pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import jax, flax, optax"], capture_output=True).returncode != 0,
    reason="the JAX binding needs the [jax] extra (pip install '.[jax]')")


@needs_jax
def test_popdist_lite_jax_imports_flax_only_for_its_layer():
    code = ("import sys, popdist_lite.jax as plj; assert 'flax' not in sys.modules; plj.SparseCoreEmbed; "
            "assert 'flax' in sys.modules; print('OK')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=JOB_SECONDS, cwd=ROOT,
                       env=clean_env())
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


@pytest.fixture
def tiny(tmp_path):
    p = tmp_path / "tiny.txt"
    p.write_text(TINY)
    return p


def _run(example: str, args: list, replicas: int = 2) -> str:
    """The example's stdout under poprun-lite (a failure fails the test)."""
    cmd = [sys.executable, "-m", "popdist_lite_launcher", "--num-replicas", str(replicas), "--timeout", str(JOB_SECONDS),
           sys.executable, str(EXAMPLES / example), *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_SECONDS + 60, cwd=ROOT, env=clean_env())
    assert r.returncode == 0, f"{' '.join(cmd)}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def _losses(example: str, args: list, replicas: int = 2) -> list[tuple[int, float]]:
    return [(int(n), float(x)) for n, x in STEP_RE.findall(_run(example, args, replicas))]


@needs_jax
@pytest.mark.parametrize("options", [
    ["--partition-strategy", "TOKEN"],  # defaults: lr 1, momentum 0.9, embedding SGD lr 10, clipping at norm 1
    ["--partition-strategy", "ENCODING", "--emb-optimizer", "adam", "--clip-norm", "0", "--lr", "0.3",
     "--path", "in-jit"],
], ids=["token-split-clipped", "encoding-in-jit-adam"])
def test_losses_equal_the_numpy_job_for_20_steps_at_2_replicas(tiny, options):
    """From the same initial weights (char_model's, mapped onto the Flax parameters), the
    same batches and the same options, both jobs print the same mean loss at every step.
    The numpy job prints 4 decimals, so losses agree within two roundings (1e-4) plus
    float32 differences between XLA and numpy."""
    common = ["--data", str(tiny), "--steps", "20", "--seq-len", "20", "--batch-size", "4", "--log-every", "1",
              "--sample-chars", "0"]
    jax_options = options
    numpy_options = [o for o in options if o not in ("--path", "in-jit")]
    reference = _losses("shakespeare.py", common + numpy_options)
    got = _losses("shakespeare_jax.py", common + jax_options)
    assert [n for n, _ in reference] == list(range(20)) and [n for n, _ in got] == list(range(20))
    worst = max(abs(a - b) for (_, a), (_, b) in zip(got, reference))
    assert worst <= 2e-4, f"JAX {got}\nnumpy {reference}"
    assert reference[-1][1] < reference[0][1] - 1.0  # it trains: the comparison is not of flat curves


@needs_jax
def test_single_process_run_prints_a_sample(tiny, tmp_path):
    r = subprocess.run([sys.executable, str(EXAMPLES / "shakespeare_jax.py"), "--data", str(tiny), "--steps", "3",
                        "--seq-len", "20", "--batch-size", "4", "--log-every", "1", "--sample-chars", "30",
                        "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2", "--checkpoint-async"],
                       capture_output=True, text=True, timeout=JOB_SECONDS, cwd=ROOT, env=clean_env())
    assert r.returncode == 0, r.stdout + r.stderr
    lines = check_run_lines(r.stdout, "shakespeare_jax.py", checkpoints=[2, 3])
    assert lines[0] == "shakespeare_jax.py: importing JAX and Flax ..."
    assert all(line.endswith(" s in the training loop, written in the background)")
               for line in lines if line.startswith("checkpoint step "))
    assert [n for n, _ in STEP_RE.findall(r.stdout)] == ["0", "1", "2"]
    assert "1 replica(s)" in r.stdout and "JAX split path" in r.stdout and "--- sample ---" in r.stdout


@needs_jax
def test_in_jit_path_refuses_joint_clipping():
    r = subprocess.run([sys.executable, str(EXAMPLES / "shakespeare_jax.py"), "--path", "in-jit", "--steps", "1"],
                       capture_output=True, text=True, timeout=JOB_SECONDS, cwd=ROOT, env=clean_env())
    assert r.returncode == 2 and "--path in-jit needs --clip-norm 0" in r.stderr


@needs_jax
@pytest.mark.parametrize("args,message", [
    (["--resume"], "--resume and --checkpoint-every need --checkpoint-dir"),
    (["--checkpoint-dir", "ckpt", "--checkpoint-keep", "0"], "--checkpoint-every and --checkpoint-keep must be >= 1"),
])
def test_checkpoint_options_are_checked(args, message):
    r = subprocess.run([sys.executable, str(EXAMPLES / "shakespeare_jax.py"), *args], capture_output=True, text=True,
                       timeout=JOB_SECONDS, cwd=ROOT, env=clean_env())
    assert r.returncode == 2 and message in r.stderr


@needs_jax
def test_guide_config_losses_equal_the_numpy_job(tiny):
    """The guide's set-up (all T outputs flattened into the dense layer, last-character
    label), one process."""
    args = ["--data", str(tiny), "--steps", "4", "--seq-len", "20", "--batch-size", "4", "--log-every", "1",
            "--sample-chars", "0", "--guide-config"]
    got, reference = _losses("shakespeare_jax.py", args, replicas=1), _losses("shakespeare.py", args, replicas=1)
    assert [n for n, _ in got] == [0, 1, 2, 3] and [n for n, _ in reference] == [0, 1, 2, 3]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, reference)) <= 2e-4, (got, reference)


@needs_jax
@pytest.mark.parametrize("options", [
    [],  # the split path, TOKEN, SGD table, blocking saves
    ["--path", "in-jit", "--clip-norm", "0", "--lr", "0.3", "--partition-strategy", "ENCODING", "--emb-optimizer",
     "adam", "--checkpoint-async"],
], ids=["split-token-sgd", "in-jit-encoding-adam-async"])
def test_resumed_run_prints_the_losses_of_a_straight_run_at_2_replicas(tiny, tmp_path, options):
    """40 straight steps against a run resumed from its step-20 checkpoint to 40: the
    same printed losses for steps 20-39 and bit-identical step-40 checkpoints (table and
    its optimizer state, dense parameters, Optax state). The first run goes on past its
    step-20 checkpoint (to 30, whose checkpoint is then removed), so the checkpoint is
    one taken mid-run, with the next batch already due."""
    common = ["--data", tiny, "--seq-len", 20, "--batch-size", 4, "--log-every", 1, "--sample-chars", 0,
              "--checkpoint-every", 20, *options]
    example = "shakespeare_jax.py"
    straight = dict(STEP_RE.findall(_run(example, common + ["--steps", 40, "--checkpoint-dir", tmp_path / "a"])))
    assert sorted(map(int, straight)) == list(range(40))
    _run(example, common + ["--steps", 30, "--checkpoint-dir", tmp_path / "b"])
    shutil.rmtree(tmp_path / "b" / "step-00000030")
    out = _run(example, common + ["--steps", 40, "--checkpoint-dir", tmp_path / "b", "--resume"])
    assert f"resumed from {tmp_path / 'b' / 'step-00000020'} (step 20)" in out
    resumed = dict(STEP_RE.findall(out))
    assert sorted(map(int, resumed)) == list(range(20, 40))
    assert resumed == {n: straight[n] for n in resumed}
    a, b = tmp_path / "a" / "step-00000040", tmp_path / "b" / "step-00000040"
    names = sorted(p.name for p in a.glob("*.npy"))
    assert names == sorted(p.name for p in b.glob("*.npy"))
    for part in ("embedding.char_embedding.weights.r1", "dense.params.", "dense.opt_state."):
        assert any(n.startswith(part) for n in names), (part, names)
    for name in names:
        np.testing.assert_array_equal(np.load(b / name, allow_pickle=False), np.load(a / name, allow_pickle=False),
                                      err_msg=name)
