#!/usr/bin/env python3
"""A step of 26 tables in one collection against one table with the same IDs, in one
job with the variants' timed blocks interleaved (bench_torch.py's method).

    python scripts/bench_collection.py [--ranks 2] [--steps 160] [--blocks 16] [--timeout 600]
    python scripts/bench_collection.py --hosts 2 --ranks 2    # 2 test hosts x 1 replica, TCP (root)

prints one JSON object on stdout. Without ``--worker`` it launches itself on
``--ranks`` replicas with ``poprun-lite`` (under ``--timeout``); with ``--hosts H``
(root: network-namespace test hosts, ``_launch.on_test_hosts``) the replicas are spread
over H test hosts, every byte between them over TCP. Block ``b`` of every variant runs
before block ``b + 1`` of any (``--blocks``), after a barrier, so load from other
processes hits every variant alike; a variant's time is its median block's mean step,
per replica, then the average and the maximum over replicas. Quote figures only from
a quiet machine: ``flock /tmp/popdist-bench.lock python scripts/bench_collection.py``
(the JSON records the load average before and after).

Workload (DLRM's embeddings on Criteo-format data): 26 categorical features, one per
table, of Criteo Kaggle's cardinalities capped at ``--max-rows`` (default 200,000; 1.34
million rows in all), ``--dim`` 64 float32 columns, ``--batch`` 512 samples per replica
and step with one ID per feature (Zipf(1.1) over each table, drawn per replica and
step from a fixed seed, 4 batches cycled), SGD; a step is the lookup of every
feature's pooled row and the update in backward (``forward`` + ``backward`` with the
lookup's context, ``loss_scale`` = the replica count).

Variants:
    collection26  an EmbeddingBagCollection of the 26 tables, all row-wise (the placement
                  of the one table below, so the difference is the number of tables)
    stacked1      one table of all 26 tables' rows (each feature's IDs offset into it),
                  the same 26 features and IDs: the goal's reference
    host1         that one table as a HostEmbedding (lookup_bags / apply_bag_gradients of the
                  26 x 512 IDs, one per bag): the numpy API's one-table step
    planned26     the 26 tables placed by the planner (replicated, table-wise, row-wise)
    loop26        26 HostEmbedding tables looked up and updated one after another
                  (lookup_bags / apply_bag_gradients): the numpy API before collections
Summary: ``collection26_over_stacked1`` (goal: at most 1.1) and its paired form (the
median over rounds of the two variants' block ratios), the other ratios for context
(``collection26_over_host1``, ``planned26_over_stacked1``, ``loop26_over_collection26``),
the collectives per step of each variant (``pl.stats()``), and per variant the step
split into its phases (``profile_ms_per_step``: ``lookup.route``, ``lookup.header``,
``lookup.ids``, ``lookup.gather``, ``lookup.rows``, ``lookup.pool``,
``update.coalesce``, ``update.header``, ``update.exchange``, ``update.sum``,
``update.apply`` and ``outside`` the calls).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import numpy as np  # noqa: E402

from _launch import on_test_hosts, run_ranks, test_hosts_setup, under_mpi  # noqa: E402
from bench_lookup import across, interleaved, paired_ratio  # noqa: E402
from bench_torch import phase_profile  # noqa: E402  (torch is imported by its variants only)

#: Criteo Kaggle's 26 categorical cardinalities (as DLRM's and TorchRec's examples use them).
CRITEO_ROWS = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
               5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)
VARIANTS = ("collection26", "stacked1", "host1", "planned26", "loop26")
GOAL = {"collection26_over_stacked1_at_most": 1.1}
#: The ratios reported: the goal's, then context.
PAIRS = (("collection26", "stacked1"), ("collection26", "host1"), ("planned26", "stacked1"),
         ("loop26", "collection26"))
BATCHES = 4


def workload(opts, replica: int):
    """``(sizes, batches)``: the tables' rows and, per batch, each feature's IDs."""
    sizes = [min(t, opts.max_rows) for t in CRITEO_ROWS]
    rng = np.random.default_rng([2040, replica])
    batches = [[np.minimum(rng.zipf(1.1, size=opts.batch) - 1, t - 1).astype(np.int64) for t in sizes]
               for _ in range(BATCHES)]
    return sizes, batches


def variants(opts, comm, names, plans: dict | None = None) -> dict:
    """Step functions ``step(s)`` of the variants (``plans``: gets the planner's plan)."""
    import popdist_lite as pl

    r, e, b = comm.size, opts.dim, opts.batch
    sizes, batches = workload(opts, comm.rank)
    spec = pl.HostEmbeddingOptimizerSpec(0.01)
    keys = [f"f{i}" for i in range(26)]
    lengths = np.ones(26 * b, np.int64)
    grad = np.full((b, 26 * e), 1e-3, np.float32)
    offsets = np.cumsum([0] + sizes[:-1])
    by_table = [pl.KeyedJaggedArray(keys, np.concatenate(ids), lengths) for ids in batches]
    stacked = [pl.KeyedJaggedArray(keys, np.concatenate([i + o for i, o in zip(ids, offsets)]), lengths)
               for ids in batches]
    tables = [pl.EmbeddingBagConfig(t, e, f"t{i}", feature_names=[keys[i]], optimizer=spec)
              for i, t in enumerate(sizes)]
    out = {}

    def collection_step(coll, inputs):
        def step(s):
            values, context = coll.forward(inputs[s % BATCHES])
            coll.backward(context, grad, loss_scale=r)
        return step

    if "collection26" in names:
        coll = pl.EmbeddingBagCollection(tables, plan={t.name: "row_wise" for t in tables})
        out["collection26"] = collection_step(coll, by_table)
    if "stacked1" in names:
        one = pl.EmbeddingBagConfig(sum(sizes), e, "stacked", feature_names=keys, optimizer=spec)
        out["stacked1"] = collection_step(pl.EmbeddingBagCollection([one], plan={"stacked": "row_wise"}), stacked)
    if "planned26" in names:
        planned = pl.EmbeddingBagCollection(tables, planner=pl.EmbeddingShardingPlanner(batch_size=b))
        if plans is not None:
            plans["planned26"] = {"record": planned.plan.record(), "printed": str(planned.plan).splitlines()}
        out["planned26"] = collection_step(planned, by_table)
    if "host1" in names:
        host = pl.create_host_embedding("host1", [sum(sizes), e], optimizer_spec=spec)
        flat_grad = np.full((26 * b, e), 1e-3, np.float32)

        def host_step(s):
            ids = stacked[s % BATCHES].values
            host.lookup_bags(ids, lengths)
            host.apply_bag_gradients(ids, flat_grad, lengths, loss_scale=r)
        out["host1"] = host_step
    if "loop26" in names:
        hosts = [pl.create_host_embedding(f"loop{i}", [t, e], optimizer_spec=spec) for i, t in enumerate(sizes)]
        ones = np.ones(b, np.int64)
        grads = np.full((b, e), 1e-3, np.float32)

        def loop_step(s):
            for table, ids in zip(hosts, batches[s % BATCHES]):
                table.lookup_bags(ids, ones)
            for table, ids in zip(hosts, batches[s % BATCHES]):
                table.apply_bag_gradients(ids, grads, ones, loss_scale=r)
        out["loop26"] = loop_step
    return out


def calls_per_step(comm, step, steps: int) -> dict:
    """Collective calls per step of ``step`` (this replica's ``pl.stats()``)."""
    import popdist_lite as pl

    comm.Barrier()
    pl.reset_stats()
    for s in range(steps):
        step(s)
    return {name: x["calls"] / steps for name, x in pl.stats()["collectives"].items()}


def worker(opts) -> None:
    import popdist_lite as pl

    pl.init()
    comm = pl.replica_comm()
    names = opts.variants.split(",")
    plans = {}
    steps = variants(opts, comm, names, plans)
    times = interleaved(comm, steps, opts.steps, opts.blocks, lambda v, s: v(s))
    report = {name: {"variant": name, "steps": opts.steps, "blocks": opts.blocks,
                     "step_ms": across(comm, float(np.median(times[name])))} for name in steps}
    paired = {f"{a}_over_{b}": paired_ratio(comm, times[a], times[b])
              for a, b in PAIRS if a in times and b in times}
    count = max(opts.steps // opts.blocks, 4)
    profile = {name: phase_profile(comm, step, count) for name, step in steps.items()}
    collectives = {name: calls_per_step(comm, step, 4) for name, step in steps.items()}
    if comm.rank == 0:
        print("JSON " + json.dumps({"variants": report, "paired": paired, "profile": profile,
                                    "collectives_per_step": collectives, "plans": plans}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hosts", type=int, default=0,
                        help="spread the replicas over this many network-namespace test hosts, TCP only (root)")
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--blocks", type=int, default=16, help="timed blocks per variant (median kept)")
    parser.add_argument("--batch", type=int, default=512, help="samples per replica and step")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--max-rows", type=int, default=200_000, help="cap on a table's rows")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker or under_mpi():
        worker(opts)
        return
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    args = ["--steps", str(opts.steps), "--blocks", str(opts.blocks), "--batch", str(opts.batch), "--dim",
            str(opts.dim), "--max-rows", str(opts.max_rows), "--variants", opts.variants]
    with on_test_hosts(opts.hosts, opts.ranks) as launcher_args:
        got = run_ranks(os.path.abspath(__file__), args, opts.ranks, opts.timeout, launcher_args)[0]
    ms = {name: r["step_ms"]["max"] for name, r in got["variants"].items()}
    summary = {}
    for a, b in PAIRS:
        if a in ms and b in ms:
            summary[f"{a}_over_{b}"] = round(ms[a] / ms[b], 3)
    summary.update({k + "_paired": v for k, v in got["paired"].items()})
    if "collection26_over_stacked1" in summary:
        summary["goal"] = {**GOAL, "met": summary["collection26_over_stacked1"]
                           <= GOAL["collection26_over_stacked1_at_most"]}
    sizes = [min(t, opts.max_rows) for t in CRITEO_ROWS]
    where = test_hosts_setup(opts.hosts, opts.ranks) if opts.hosts else {}
    print(json.dumps({"benchmark": "collection", "replicas": opts.ranks, **where,
                      "workload": {"tables": 26, "rows": sizes, "total_rows": sum(sizes), "dim": opts.dim,
                                   "batch_per_replica": opts.batch, "ids": "Zipf(1.1) per table, one per feature",
                                   "optimizer": "SGD, update in backward"},
                      "seconds": round(time.perf_counter() - start, 1),
                      "machine": {"cpus": os.cpu_count(), "load_avg_1min_before": round(load_before, 2),
                                  "load_avg_1min_after": round(os.getloadavg()[0], 2)},
                      "summary": summary, "results": got["variants"], "profile_ms_per_step": got["profile"],
                      "collectives_per_step": got["collectives_per_step"], "plans": got["plans"]}, indent=1))


if __name__ == "__main__":
    main()
