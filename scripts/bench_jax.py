#!/usr/bin/env python3
"""The JAX binding's cost: the Shakespeare JAX job's step with and without the
embedding exchange, the split path against the in-jit path, and lookup + update on
the recommender workload of bench_lookup.py through popdist_lite.jax and through the
numpy API.

    python scripts/bench_jax.py [--ranks 2] [--steps-char 96] [--steps-recsys 160] [--blocks 16] [--timeout 600]

prints one JSON object on stdout. Without ``--worker`` it launches itself once per
workload on ``--ranks`` replicas with ``poprun-lite`` (under ``--timeout``). As in
bench_lookup.py, every variant of a workload runs in the same job, their timed blocks
interleaved (block 1 of every variant, then block 2, ...), and a variant's time is its
median block (per replica; reported as the average and the maximum over replicas);
ratios are also given paired (the median over rounds of the ratio of two variants'
blocks in the same round, each block the slowest replica's).

Workloads and variants (ms per step):

``shakespeare``: examples/shakespeare_jax.py's model and options (batch 16 x 100
characters per replica, GRU(256), host embedding [256, 256] with SGD, dense momentum
SGD), batches of its ``make_dataset`` (data/shakespeare.txt when present, else a
synthetic text of random printable characters: noted in the JSON), cycled.

- ``split``: the job's step (``TrainStep``: host lookup, jitted forward + backward with
  joint clipping, host all-reduce of the dense gradients, jitted Optax update, host
  embedding update; the next batch is passed as ``next_features``);
- ``dense``: the same jitted forward + backward and update and the same all-reduce,
  on fixed activations: no lookup, no embedding update. ``split`` minus ``dense`` is the
  binding's overhead per step (goal: at most 10% of ``split``);
- ``split_noclip`` and ``in_jit``: both paths without clipping (the in-jit path cannot
  clip jointly), the in-jit step being one jitted function with host callbacks.

``recsys``: bench_lookup.py's recommender workload (1,000,000 x 64 float32, SGD, 8192
Zipf(1.1) IDs per replica): lookup + update through ``popdist_lite.jax.HostEmbedding``
(a ``jax.Array`` out, a ``jax.Array`` gradient in) against ``popdist_lite.HostEmbedding``
with numpy arrays (goal: at most 1.1x), and the same step through the bag path
(``lookup_bags`` + ``apply_bag_gradients``, one ID per bag) of both
(``jax_bag_over_numpy_bag``, for context).

Take figures to quote under ``flock /tmp/popdist-bench.lock`` on an otherwise idle
machine; the JSON records the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import numpy as np  # noqa: E402

from _launch import run_ranks, under_mpi  # noqa: E402
from bench_lookup import WORKLOADS, across, batches, interleaved, paired_ratio  # noqa: E402

BATCHES = 4  # distinct batches per replica, cycled (as bench_lookup.py)


def shakespeare_worker(opts) -> dict:
    import char_model
    import jax
    import shakespeare
    import shakespeare_jax as sj

    import popdist_lite as pl
    import popdist_lite.jax as plj

    pl.init()
    comm = pl.replica_comm()
    batch, seq_len = opts.batch_size, opts.seq_len
    data = shakespeare.DEFAULT_DATA
    if data.exists():
        _, text_ids = shakespeare.encode_text(data.read_bytes().decode("utf-8"))
        source = str(data.relative_to(shakespeare.ROOT))
    else:
        text_ids = np.random.default_rng(0).integers(32, 127, 200_000).astype(np.int32)
        source = "synthetic: uniform printable ASCII (data/shakespeare.txt is missing: scripts/fetch_shakespeare)"
    feed = shakespeare.make_dataset(comm.rank, comm.size, text_ids=text_ids, seq_len=seq_len, batch_size=batch,
                                    seed=0)
    steps = []
    for _ in range(BATCHES):
        ids = next(feed)["ids"]
        steps.append(({sj.FEATURE: ids[:, :-1]}, ids[:, 1:]))
    model = sj.CharModel(hidden=shakespeare.HIDDEN, outputs=shakespeare.OUTPUTS, mode="next")
    init = sj.from_char_model(char_model.init_params(np.random.default_rng([0, comm.rank]),
                                                     vocab=shakespeare.OUTPUTS, emb_dim=shakespeare.TABLE_SHAPE[1],
                                                     hidden=shakespeare.HIDDEN, seq_len=seq_len))

    def job(name: str, path: str, clip_norm: float):
        table = plj.TableSpec(name, *shakespeare.TABLE_SHAPE, optimizer=pl.HostEmbeddingOptimizerSpec(10.0))
        feature = plj.FeatureSpec(sj.FEATURE, table, (batch, seq_len), (batch, seq_len, shakespeare.TABLE_SHAPE[1]))
        args = SimpleNamespace(path=path, lr=1.0, momentum=0.9, clip_norm=clip_norm)
        return sj.Job(args, model, init, plj.EmbeddingCollection([feature]))

    class Dense:
        """The split job's jitted step (TrainStep's own functions) on fixed activations."""

        def __init__(self):
            self.job = job("bench_dense", "split", 1.0)
            self.acts = self.job.embeddings.lookup(steps[0][0])

        def step(self, s):
            train, job = self.job.train, self.job
            _, g_params, _ = train._grads(job.params, self.acts, steps[s % BATCHES][1])
            job.params, job.opt_state = train._update(job.params, job.opt_state,
                                                      plj.all_reduce_gradients(g_params, comm=job.embeddings.comm))

    class Full:
        def __init__(self, name, path, clip_norm):
            self.job = job(name, path, clip_norm)
            self.in_jit = path == "in-jit"

        def step(self, s):
            features, labels = steps[s % BATCHES]
            self.job.step(features, labels, next_features=steps[(s + 1) % BATCHES][0])
            if self.in_jit:
                # Its lookups and updates are host callbacks of a step still running after
                # dispatch returns, on the tables' communicator, which the next variant's
                # jobs share: they must be over before another variant's collectives start,
                # or the replicas issue the two in different orders (collective mismatch).
                jax.block_until_ready(self.job.params)

    variants = {"split": Full("bench_split", "split", 1.0), "dense": Dense(),
                "split_noclip": Full("bench_noclip", "split", 0.0), "in_jit": Full("bench_in_jit", "in-jit", 0.0)}
    times = interleaved(comm, variants, opts.steps, opts.blocks, lambda v, s: v.step(s))
    for v in variants.values():
        jax.block_until_ready(v.job.params)
    pl.reset_stats()
    for s in range(8):
        variants["split"].step(s)
    phases = {p: round(x["seconds"] / 8 * 1e3, 3) for p, x in pl.stats()["phases"].items()}
    report = {name: across(comm, float(np.median(t))) for name, t in times.items()}
    paired = {"dense_over_split": paired_ratio(comm, times["dense"], times["split"]),
              "in_jit_over_split_noclip": paired_ratio(comm, times["in_jit"], times["split_noclip"])}
    return {"data": source, "batch_per_replica": [batch, seq_len], "ms_per_step": report, "paired": paired,
            "split_phase_ms_per_step": phases}


def recsys_worker(opts) -> dict:
    import jax.numpy as jnp

    import popdist_lite as pl
    import popdist_lite.jax as plj

    pl.init()
    comm = pl.replica_comm()
    w = WORKLOADS["recsys"]
    idx = batches(w, comm.rank)
    spec = pl.HostEmbeddingOptimizerSpec(0.01)
    numpy_table = pl.create_host_embedding("bench_numpy", shape=[w["t"], w["e"]], optimizer_spec=spec)
    jax_table = plj.create_host_embedding("bench_jax", shape=[w["t"], w["e"]], optimizer_spec=spec)
    np_grads = [np.full(i.shape + (w["e"],), 1e-3, np.float32) for i in idx]
    jax_grads = [jnp.full(i.shape + (w["e"],), 1e-3, jnp.float32) for i in idx]

    lengths = np.ones(w["shape"][0], np.int64)

    def step(v, s):
        table, grads, bags = v
        if bags:
            table.lookup_bags(idx[s % BATCHES], lengths)
            table.apply_bag_gradients(idx[s % BATCHES], grads[s % BATCHES], lengths)
        else:
            table.lookup(idx[s % BATCHES])
            table.apply_gradients(idx[s % BATCHES], grads[s % BATCHES])

    variants = {"numpy": (numpy_table, np_grads, False), "jax": (jax_table, jax_grads, False),
                "numpy_bag": (numpy_table, np_grads, True), "jax_bag": (jax_table, jax_grads, True)}
    times = interleaved(comm, variants, opts.steps, opts.blocks, step)
    return {"ms_per_step": {name: across(comm, float(np.median(t))) for name, t in times.items()},
            "paired": {"jax_over_numpy": paired_ratio(comm, times["jax"], times["numpy"]),
                       "jax_bag_over_numpy_bag": paired_ratio(comm, times["jax_bag"], times["numpy_bag"])}}


def worker(opts) -> None:
    result = (shakespeare_worker if opts.workload == "shakespeare" else recsys_worker)(opts)
    import popdist_lite as pl

    if pl.replica_id() == 0:
        print("JSON " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps-char", type=int, default=96, help="timed Shakespeare steps per variant")
    parser.add_argument("--steps-recsys", type=int, default=160, help="timed recommender steps per variant")
    parser.add_argument("--blocks", type=int, default=16, help="timed blocks per variant (median kept)")
    parser.add_argument("--batch-size", type=int, default=16, help="Shakespeare sequences per replica")
    parser.add_argument("--seq-len", type=int, default=100, help="Shakespeare characters per sequence")
    parser.add_argument("--workloads", default="shakespeare,recsys")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker or under_mpi():
        worker(opts)
        return
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    results = {}
    for workload in opts.workloads.split(","):
        steps = opts.steps_char if workload == "shakespeare" else opts.steps_recsys
        args = ["--workload", workload, "--steps", str(steps), "--blocks", str(opts.blocks),
                "--batch-size", str(opts.batch_size), "--seq-len", str(opts.seq_len)]
        results[workload] = run_ranks(os.path.abspath(__file__), args, opts.ranks, opts.timeout)[0]
    summary, targets = {}, {}
    if "shakespeare" in results:
        ms = results["shakespeare"]["ms_per_step"]
        overhead = (ms["split"]["max"] - ms["dense"]["max"]) / ms["split"]["max"]
        summary["shakespeare"] = {"binding_overhead_fraction_of_step": round(overhead, 3),
                                  "in_jit_over_split_noclip": round(ms["in_jit"]["max"] / ms["split_noclip"]["max"], 2),
                                  **{k + "_paired": v for k, v in results["shakespeare"]["paired"].items()}}
        targets["binding_overhead_fraction_at_most"] = 0.10
        targets["binding_overhead_met"] = bool(overhead <= 0.10)
    if "recsys" in results:
        ms = results["recsys"]["ms_per_step"]
        ratio = ms["jax"]["max"] / ms["numpy"]["max"]
        summary["recsys"] = {"jax_over_numpy": round(ratio, 3),
                             "jax_bag_over_numpy_bag": round(ms["jax_bag"]["max"] / ms["numpy_bag"]["max"], 3),
                             **{k + "_paired": v for k, v in results["recsys"]["paired"].items()}}
        targets["recsys_jax_over_numpy_at_most"] = 1.1
        targets["recsys_met"] = bool(ratio <= 1.1)
    summary["targets"] = targets
    import jax

    print(json.dumps({"benchmark": "jax", "replicas": opts.ranks, "jax": jax.__version__,
                      "seconds": round(time.perf_counter() - start, 1),
                      "machine": {"cpus": os.cpu_count(), "load_avg_1min_before": round(load_before, 2),
                                  "load_avg_1min_after": round(os.getloadavg()[0], 2)},
                      "summary": summary, "results": results}, indent=1))


if __name__ == "__main__":
    main()
