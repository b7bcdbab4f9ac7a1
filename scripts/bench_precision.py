#!/usr/bin/env python3
"""Benchmark reduced precision: bytes moved and step time for fp32 against fp16, and
optimizer-state bytes per replica with and without replicated tensor sharding.

Usage::

    python scripts/bench_precision.py [--replicas 1 2 4] [--iters 10] [--timeout 90]

Runs one ``mpirun -n R`` job per replica count (each under a subprocess timeout, so a
hang cannot stall the benchmark) and prints one JSON document. Per replica count:

- ``all_reduce``: one all-reduce of a gradient the size of the example's char model
  (GRU 256 + dense 256 = 460,544 values) in float32 and in float16.
- ``embedding_step``: a lookup and an ``apply_gradients`` on the char table [256, 256]
  (batch 16 x 100 indices per replica, SGD) stored in fp32, fp16, and fp16 with FP32
  master weights ("mixed"), each strategy with its default exchange (TOKEN: sparse).
- ``dense_adam_step``: a ``CrossReplicaOptimizer(Adam)`` step on the char model's dense
  parameters with float16 gradients, unsharded and with ``shard_optimizer_state=True``.

``bytes_per_step`` is the payload one replica sends to the others per step, from
:func:`popdist_lite.stats` (``bytes_sent`` without the argument checks, ``agree``,
which are ``check_bytes_per_step``; the sparse TOKEN exchange's small header of send
counts travels in its check). See :mod:`popdist_lite.counters` for how each MPI call
is counted (an MPI ``Allreduce`` as ``n x (r - 1)``, the float16 all-reduce as its
``Alltoall`` + ``Allgather``). ``ms_per_step`` and ``ms_min`` are the median and the
fastest of ``--iters`` timed runs after one warm-up, the slowest replica's figures
(on a small shared machine the median is noisy; the bytes are exact).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import run_ranks  # noqa: E402

GRU_AND_DENSE = {"gru_w": (256, 768), "gru_u": (256, 768), "gru_b": (2, 768), "dense_w": (256, 256), "dense_b": (256,)}


def driver(args) -> int:
    results = {}
    started = time.perf_counter()
    for r in args.replicas:
        try:
            results[str(r)] = run_ranks(str(Path(__file__).resolve()), ["--iters", str(args.iters)], r,
                                        args.timeout)[-1]
        except (RuntimeError, IndexError) as exc:
            results[str(r)] = {"error": str(exc)[-2000:]}
    print(json.dumps({"benchmark": "precision", "wall_seconds": round(time.perf_counter() - started, 1),
                      "replicas": results}, indent=2))
    return 0 if all("error" not in v for v in results.values()) else 1


def worker(iters: int) -> None:
    import numpy as np
    from mpi4py import MPI

    import popdist_lite as pl

    pl.init()
    comm = pl.replica_comm()
    r, k = comm.size, comm.rank
    rng = np.random.default_rng(k)

    def measure(fn):
        """{ms_per_step, ms_min: the slowest replica's median and fastest ms; bytes_per_step,
        check_bytes_per_step: this replica's payload and argument-check bytes per call}."""
        fn()
        pl.reset_stats()
        times = []
        for _ in range(iters):
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        stats = pl.stats()
        check = stats["collectives"].get("agree", {}).get("bytes_sent", 0)
        slowest = lambda v: round(comm.allreduce(float(v) * 1e3, op=MPI.MAX), 3)
        return {"ms_per_step": slowest(np.median(times)), "ms_min": slowest(np.min(times)),
                "bytes_per_step": (stats["bytes_sent"] - check) // iters, "check_bytes_per_step": check // iters}

    out = {"replicas": r}

    # 1. all-reduce of a char-model-sized gradient
    n = sum(int(np.prod(s)) for s in GRU_AND_DENSE.values())
    grad32 = rng.standard_normal(n).astype(np.float32)
    grad16 = grad32.astype(np.float16)
    ar = {"elements": n}
    for name, g in (("fp32", grad32), ("fp16", grad16)):
        ar[name] = measure(lambda: pl.all_reduce(g, op="mean"))
    out["all_reduce"] = ar

    # 2. embedding lookup + update on the char table
    idx = rng.integers(0, 256, size=(16, 100))
    emb_out = {"table": [256, 256], "indices_per_replica": int(idx.size)}
    for name, kw in (("fp32", dict(dtype=np.float32)), ("fp16", dict(dtype=np.float16)),
                     ("mixed", dict(dtype=np.float16, master_weights=np.float32))):
        for strategy in ("TOKEN", "ENCODING"):
            emb = pl.create_host_embedding(f"bench_{name}", shape=[256, 256], partition_strategy=strategy,
                                           optimizer_spec=pl.HostEmbeddingOptimizerSpec(0.01), seed=0, **kw)
            grads = rng.standard_normal(idx.shape + (256,)).astype(kw["dtype"])

            def step():
                emb.lookup(idx)
                emb.apply_gradients(idx, grads)

            emb_out[f"{name}_{strategy}"] = {"exchange": emb.exchange, **measure(step)}
    out["embedding_step"] = emb_out

    # 3. dense Adam step, unsharded and sharded, float16 gradients
    dense = {}
    for sharded in (False, True):
        params = {name: rng.standard_normal(shape).astype(np.float32) * 0.1 for name, shape in GRU_AND_DENSE.items()}
        params = pl.all_gather(np.concatenate([p.reshape(-1) for p in params.values()]))[0]  # identical start
        offsets = np.cumsum([0] + [int(np.prod(s)) for s in GRU_AND_DENSE.values()])
        params = {name: params[offsets[i]:offsets[i + 1]].reshape(shape).copy()
                  for i, (name, shape) in enumerate(GRU_AND_DENSE.items())}
        grads = {name: rng.standard_normal(p.shape).astype(np.float16) for name, p in params.items()}
        opt = pl.CrossReplicaOptimizer(pl.Adam(1e-3), shard_optimizer_state=sharded)
        dense["sharded" if sharded else "unsharded"] = {
            **measure(lambda: opt.step(params, grads, loss_scale=1.0)),
            "optimizer_state_bytes_per_replica": opt.state_bytes()}
    dense["parameters"] = n
    out["dense_adam_step"] = dense
    if k == 0:
        print("JSON " + json.dumps(out), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds per mpirun job")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.iters)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
