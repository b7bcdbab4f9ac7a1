#!/usr/bin/env python3
"""Benchmark the host feed (popdist_lite.infeed); prints one JSON object on stdout.

1. Steps/s of one replica whose step costs ``--compute-ms`` C of numpy compute while
   each batch costs ``--prep-ms`` P of CPU-bound numpy preprocessing (a per-sample loop
   of small numpy operations, as augmentation code is), for: preprocessing inline in
   the training loop, F = 0 (the infeed's thread), F = 1 and F = 2 feeders.
2. The feed channel's MB/s (one feeder streaming ready-made batches to a replica that
   only receives) next to raw mpi4py ``Send``/``Recv`` of the same bytes between the
   same two ranks in the same job (first raw, then the feed), per batch size. Raw is
   measured into one receive buffer (stays in cache), into a ring of depth + 1
   buffers (the receive working set a feed with that prefetch depth needs), and as a
   stream with the feed's message pattern (header and data ``Isend``, depth batches in
   flight, depth + 2 rotating buffers) without the feed's credits and Python.

Every job runs under ``poprun-lite --timeout`` and a subprocess timeout. Workers are
this script with ``--worker``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.abspath(__file__)
LAUNCHER = [sys.executable, "-m", "popdist_lite_launcher"]
SIZES = [64 << 10, 1 << 20, 4 << 20, 16 << 20]


# ---------------------------------------------------------------- the work

def preprocess(index: int, units: int) -> dict:
    """One batch: ``units`` samples, each a small chain of numpy calls (GIL-heavy, like
    per-sample augmentation). Returns ``{"x": float32 (units, 64), "i": int64 (1,)}``."""
    rng = np.random.default_rng(index)
    out = np.empty((units, 64), dtype=np.float32)
    for s in range(units):
        x = rng.random(256)
        x.sort()
        x -= x.mean()
        x /= x.std() + 1e-6
        out[s] = x[::4]
    return {"x": out, "i": np.array([index], dtype=np.int64)}


_W = np.random.default_rng(0).random((96, 96)) / 96


def compute(batch: dict, units: int) -> float:
    """The training step's compute: ``units`` small matmuls (releases the GIL)."""
    acc = _W
    for _ in range(units):
        acc = np.tanh(acc @ _W)
    return float(acc[0, 0] + batch["x"][0, 0])


def calibrate(fn, target_ms: float) -> int:
    """Units of ``fn(units)`` that take about ``target_ms`` here (best of a few runs)."""
    if target_ms <= 0:
        return 0
    units = 8
    while True:
        best = min(_timed(fn, units) for _ in range(3))
        if best > 0.02:
            return max(1, round(units * target_ms / 1000 / best))
        units *= 2


def _timed(fn, units) -> float:
    start = time.perf_counter()
    fn(units)
    return time.perf_counter() - start


# ---------------------------------------------------------------- workers

def worker_steps(args) -> None:
    import popdist_lite as pl

    total = args.warmup + args.steps

    def make_dataset(shard_index, num_shards):
        for b in range(shard_index, total, num_shards):
            yield preprocess(b, args.prep_units)

    if args.mode == "inline":
        batches = (preprocess(b, args.prep_units) for b in range(total))
    else:
        batches = pl.infeed(make_dataset, prefetch_depth=args.depth)
    start, seen = None, []
    for step, batch in enumerate(batches):
        if step == args.warmup:
            start = time.perf_counter()
        compute(batch, args.compute_units)
        seen.append(int(batch["i"][0]))
    elapsed = time.perf_counter() - start
    assert seen == list(range(total)), "batches out of order"
    print("BENCH " + json.dumps({"steps_per_s": args.steps / elapsed}), flush=True)


def worker_channel(args) -> None:
    import popdist_lite as pl
    from mpi4py import MPI

    pl.init()
    world = MPI.COMM_WORLD
    sizes, count = SIZES, args.messages
    raw, raw_ring, raw_stream = {}, {}, {}
    for size in sizes:  # raw mpi4py: rank 1 (the feeder) sends, rank 0 (the replica) receives
        n = count(size)
        raw_stream[size] = max(_raw_stream(world, size, n, args.depth) for _ in range(3))
        # into one buffer (cache-friendly), and into a ring of depth + 1 buffers (the
        # working set of a feed with that prefetch depth)
        for rates, nbufs in ((raw, 1), (raw_ring, args.depth + 1)):
            # written bytes, as the feed's payload: an untouched np.zeros buffer maps the
            # kernel's zero page, which another process reads faster than any real data
            bufs = [np.ones(size, dtype=np.uint8) for _ in range(nbufs)]
            best = 0.0
            for _ in range(3):
                world.Barrier()
                start = time.perf_counter()
                for i in range(n):
                    if world.rank == 1:
                        world.Send([bufs[0], MPI.BYTE], dest=0, tag=7)
                    else:
                        world.Recv([bufs[i % nbufs], MPI.BYTE], source=1, tag=7)
                world.Barrier()
                best = max(best, n * size / (time.perf_counter() - start) / 1e6)
            rates[size] = best

    session = {"i": 0}

    def make_dataset(shard_index, num_shards):  # on the feeder: one session per size
        size = sizes[session["i"] // 3]
        session["i"] += 1
        payload = np.ones(size, dtype=np.uint8)
        return ({"bytes": payload} for _ in range(count(size) + 1))

    feed_rates = {}
    for size in sizes:
        best = 0.0
        for _ in range(3):
            feed = pl.infeed(make_dataset, prefetch_depth=args.depth)
            next(feed)  # session started, first batch in: time the rest
            start = time.perf_counter()
            n = sum(1 for _ in feed)
            best = max(best, n * size / (time.perf_counter() - start) / 1e6)
        feed_rates[size] = best
    print("BENCH " + json.dumps({"raw": raw, "raw_ring": raw_ring, "raw_stream": raw_stream, "feed": feed_rates}),
          flush=True)


def _raw_stream(world, size: int, n: int, depth: int) -> float:
    """MB/s of raw mpi4py streaming with the feed's message pattern: per batch a header
    and a data ``Isend``, at most ``depth`` batches in flight, received into ``depth + 2``
    rotating buffers (the feed's buffer pool), without the feed's credits and Python."""
    from mpi4py import MPI

    payload = np.ones(size, dtype=np.uint8)
    bufs = [np.ones(size, dtype=np.uint8) for _ in range(depth + 2)]
    header = np.zeros(2, dtype=np.int64)
    world.Barrier()
    start = time.perf_counter()
    if world.rank == 1:
        pending = []
        for _ in range(n):
            pending += [world.Isend(header, dest=0, tag=8), world.Isend([payload, MPI.BYTE], dest=0, tag=9)]
            if len(pending) >= 2 * depth:
                MPI.Request.Waitall(pending[:2])
                pending = pending[2:]
        MPI.Request.Waitall(pending)
    else:
        got = np.empty(2, dtype=np.int64)
        for i in range(n):
            world.Recv(got, source=1, tag=8)
            world.Recv([bufs[i % len(bufs)], MPI.BYTE], source=1, tag=9)
    world.Barrier()
    return n * size / (time.perf_counter() - start) / 1e6


# ---------------------------------------------------------------- driver

def run(cmd: list[str], timeout: float) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("BENCH ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"bench_feed: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][6:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compute-ms", type=float, default=20.0, help="C (default 20)")
    parser.add_argument("--prep-ms", type=float, default=20.0, help="P (default 20)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=2, help="runs per mode (best kept)")
    parser.add_argument("--channel-jobs", type=int, default=3, help="channel jobs (median kept)")
    parser.add_argument("--worker", choices=["steps", "channel"])
    parser.add_argument("--mode", default="feed")
    parser.add_argument("--prep-units", type=int, default=0)
    parser.add_argument("--compute-units", type=int, default=0)
    args = parser.parse_args()
    args.messages = lambda size: max(30, min(400, (512 << 20) // size))
    if args.worker == "steps":
        return worker_steps(args)
    if args.worker == "channel":
        return worker_channel(args)

    load_before = os.getloadavg()[0]
    prep_units = calibrate(lambda u: preprocess(0, u), args.prep_ms)
    compute_units = calibrate(lambda u: compute({"x": np.zeros((1, 1))}, u), args.compute_ms)
    common = ["--worker", "steps", "--steps", str(args.steps), "--warmup", str(args.warmup),
              "--depth", str(args.depth), "--prep-units", str(prep_units),
              "--compute-units", str(compute_units)]
    limit = 120
    steps = {}
    for name, feeders in [("inline", None), ("thread_F0", 0), ("feeders_F1", 1), ("feeders_F2", 2)]:
        rates = []
        for _ in range(args.repeat):
            if feeders is None:
                cmd = [sys.executable, HERE, *common, "--mode", "inline"]
            else:
                cmd = [*LAUNCHER, "--timeout", str(limit), "--num-replicas", "1",
                       "--feeders-per-replica", str(feeders), sys.executable, HERE, *common]
            rates.append(run(cmd, limit + 30)["steps_per_s"])
        steps[name] = round(max(rates), 2)
    # several jobs, median per size: the machine may be shared
    jobs = [run([*LAUNCHER, "--timeout", str(limit), "--num-replicas", "1",
                 "--feeders-per-replica", "1", sys.executable, HERE, "--worker", "channel",
                 "--depth", str(args.depth)], limit + 30) for _ in range(args.channel_jobs)]
    rows = []
    for size in SIZES:
        med = {k: float(np.median([job[k][str(size)] for job in jobs]))
               for k in ("feed", "raw", "raw_ring", "raw_stream")}
        rows.append({"batch_bytes": size, "feed_MBps": round(med["feed"]),
                     "raw_mpi4py_MBps": round(med["raw"]),
                     "raw_mpi4py_ring_MBps": round(med["raw_ring"]),
                     "raw_mpi4py_stream_MBps": round(med["raw_stream"]),
                     "ratio": round(med["feed"] / med["raw"], 3),
                     "ratio_vs_ring": round(med["feed"] / med["raw_ring"], 3),
                     "ratio_vs_stream": round(med["feed"] / med["raw_stream"], 3)})
    speedup = {k: round(v / steps["inline"], 2) for k, v in steps.items()}
    result = {
        # other processes on the machine distort every figure: report the load average
        "machine": {"cpus": os.cpu_count(), "load_avg_1min_before": round(load_before, 2),
                    "load_avg_1min_after": round(os.getloadavg()[0], 2)},
        "config": {"compute_ms": args.compute_ms, "prep_ms": args.prep_ms, "steps": args.steps,
                   "prefetch_depth": args.depth, "prep_units": prep_units,
                   "compute_units": compute_units},
        "steps_per_s": steps,
        "speedup_vs_inline": speedup,
        "channel": rows,
        "targets": {
            "F1_at_least_1.6x_inline": speedup["feeders_F1"] >= 1.6,
            "channel_at_least_80pct_of_raw_from_1MiB": all(
                r["ratio"] >= 0.8 for r in rows if r["batch_bytes"] >= 1 << 20),
            "channel_at_least_80pct_of_raw_ring_from_1MiB": all(
                r["ratio_vs_ring"] >= 0.8 for r in rows if r["batch_bytes"] >= 1 << 20),
            "channel_at_least_80pct_of_raw_stream_from_1MiB": all(
                r["ratio_vs_stream"] >= 0.8 for r in rows if r["batch_bytes"] >= 1 << 20),
        },
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
