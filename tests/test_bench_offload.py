"""Smoke test of scripts/bench_offload.py with tiny sizes: it runs under its own
poprun-lite timeout, prints one JSON object with every variant's figures, and removes
its partition files (also those of the large-table mode)."""

import json
import subprocess
import sys

from helpers import JOB_SECONDS, ROOT, timeout_for

pytestmark = timeout_for(2)


def run(tmp_path, *args):
    done = subprocess.run([sys.executable, "scripts/bench_offload.py", "--ranks", "2", "--dir", str(tmp_path),
                           "--timeout", str(JOB_SECONDS), *args],
                          capture_output=True, text=True, timeout=JOB_SECONDS + 60, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not list(tmp_path.iterdir())  # the partition files are gone
    return json.loads(done.stdout)


def test_bench_offload_variants(tmp_path):
    # 128 IDs: a 5 % cache (500 rows) holds the two batches a prefetch keeps in flight
    got = run(tmp_path, "--rows", "20000", "--ids", "128", "--steps", "4", "--warmup", "2", "--blocks", "2")
    variants = got["variants"]
    assert sorted(variants) == ["lfu10", "lfu5", "lfu5p", "lru10", "lru10p", "lru5", "lru5p", "memory"]
    assert variants["memory"]["storage"] == "memory" and "hit_rate" not in variants["memory"]
    for name in ("lru10", "lfu10", "lru5", "lfu5", "lru10p", "lru5p", "lfu5p"):
        v = variants[name]
        assert v["policy"] == name[:3] and v["cache_fraction"] in (0.1, 0.05)
        assert v["prefetch"] is name.endswith("p") and v["wait_ms_per_step"]["avg"] >= 0
        assert 0 < v["hit_rate"]["avg"] <= 1 and v["disk_read_mib_per_step"]["avg"] > 0
        assert v["hit_rate"]["avg"] < 1 or v["prefetch"]  # without prefetch a cold Zipf tail misses
        assert v["cache_rows"] == int(v["cache_fraction"] * 10000)  # of each replica's 10,000 rows
        assert v["file_bytes"] == 10000 * got["record_bytes"] and v["over_memory"] > 0
    assert got["record_bytes"] == 776  # 64 float32 weights, Adam's m and v, the row's step count


def test_bench_offload_large_mode(tmp_path):
    got = run(tmp_path, "--large", "--large-rows", "40000", "--large-steps", "5", "--cache-mib", "4", "--ids", "256")
    large = got["large"]
    assert large["table_bytes_all_replicas"] == 40000 * 776 and large["steps"] == 5
    assert large["cache_bytes_per_replica"] == 4 << 20
    peak = large["peak_rss_mib"]["per_replica"]
    assert len(peak) == 2 and all(p > 4 for p in peak)
    assert abs(large["overhead_mib"]["max"] - (large["peak_rss_mib"]["max"] - 4)) <= 0.11
