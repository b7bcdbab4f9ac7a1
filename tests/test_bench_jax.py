"""Smoke test of scripts/bench_jax.py: a few steps of every variant under its own
poprun-lite timeout, and the JSON it prints (figures are not checked here)."""

import json
import subprocess
import sys

import pytest

from helpers import JOB_SECONDS, ROOT, timeout_for

pytestmark = [timeout_for(1), pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import jax, flax, optax"], capture_output=True).returncode != 0,
    reason="the JAX binding needs the [jax] extra (pip install '.[jax]')")]


def test_bench_jax_prints_every_variant_and_the_goals():
    done = subprocess.run([sys.executable, "scripts/bench_jax.py", "--ranks", "2", "--steps-char", "4",
                           "--steps-recsys", "4", "--blocks", "2", "--batch-size", "4", "--seq-len", "10",
                           "--timeout", str(JOB_SECONDS)], capture_output=True, text=True, timeout=JOB_SECONDS + 60, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    char = report["results"]["shakespeare"]["ms_per_step"]
    assert set(char) == {"split", "dense", "split_noclip", "in_jit"}
    assert all(v["max"] > 0 and len(v["per_replica"]) == 2 for v in char.values())
    assert set(report["results"]["recsys"]["ms_per_step"]) == {"numpy", "jax", "numpy_bag", "jax_bag"}
    targets = report["summary"]["targets"]
    assert {"binding_overhead_met", "recsys_met"} <= set(targets)
    assert "load_avg_1min_before" in report["machine"]
