"""Smoke test of scripts/bench_precision.py: runs under its own mpirun timeout and prints JSON."""

import json
import subprocess
import sys

from helpers import JOB_SECONDS, ROOT, timeout_for

pytestmark = timeout_for(1)


def test_bench_precision_prints_json_with_half_the_fp16_bytes():
    done = subprocess.run([sys.executable, "scripts/bench_precision.py", "--replicas", "2", "--iters", "1",
                           "--timeout", str(JOB_SECONDS)], capture_output=True, text=True, timeout=JOB_SECONDS + 60, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    two = json.loads(done.stdout)["replicas"]["2"]
    ar = two["all_reduce"]
    assert ar["fp16"]["bytes_per_step"] * 2 == ar["fp32"]["bytes_per_step"] > 0
    emb = two["embedding_step"]
    for strategy in ("TOKEN", "ENCODING"):
        assert emb[f"fp16_{strategy}"]["bytes_per_step"] < emb[f"fp32_{strategy}"]["bytes_per_step"]
        assert emb[f"mixed_{strategy}"]["bytes_per_step"] == emb[f"fp16_{strategy}"]["bytes_per_step"]
    dense = two["dense_adam_step"]
    assert dense["sharded"]["optimizer_state_bytes_per_replica"] * 2 <= dense["unsharded"]["optimizer_state_bytes_per_replica"] + 16
