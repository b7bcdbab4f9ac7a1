#!/usr/bin/env python3
"""Embedding lookup and lookup + update per step: dense TOKEN and ENCODING (the
algorithms of the TensorFlow-IPU host-embedding guide), sparse TOKEN, against
single-process ``np.take`` and a plain mpi4py sparse exchange.

    python scripts/bench_lookup.py [--ranks 2] [--steps-char 200] [--steps-recsys 160] [--timeout 300]
    python scripts/bench_lookup.py --hosts 2 --ranks 4     # 2 test hosts x 2 replicas, TCP

prints one JSON object on stdout. Without ``--worker`` it launches itself once per
workload on ``--ranks`` replicas with ``poprun-lite`` (under ``--timeout``). Every
variant runs in that same job and their timed blocks are interleaved (block 1 of every
variant, then block 2, ...; ``--blocks``, default 16), so load from other processes on a
shared machine hits all of them alike; a variant's time is its median block.

With ``--hosts H`` (root: network-namespace test hosts, popdist_lite_launcher.testing.netns_hosts)
the replicas are spread evenly over H test hosts, every byte between ranks over TCP;
with more replicas than cores they yield the processor while waiting
(``mpi_yield_when_idle``: the test hosts share this machine's cores, see
``_launch.on_test_hosts``).

Workloads (indices per replica, drawn per replica and step from a fixed seed, the same
for every variant):
    char    vocab 256, dim 256, 16 x 99 indices (printable ASCII, uniform)
    recsys  1,000,000 x 64 float32, 8192 indices from Zipf(1.1), minus 1, clipped to the table
Variants:
    dense     create_host_embedding(..., "TOKEN", exchange="dense"): the guide's TOKEN algorithm
    encoding  create_host_embedding(..., "ENCODING"): the guide's ENCODING algorithm
    sparse    create_host_embedding(..., "TOKEN", exchange="sparse")
    mpi4py    plain mpi4py sparse exchange written as simply as possible (np.unique,
              Alltoall of counts, Alltoallv of ids and rows; update with np.add.at): the floor
    np_take   np.take on the whole table in one process, no communication
Reported per variant: ms per step (per replica the median block's mean step time, then
avg and max across replicas) for lookup and lookup + update, payload bytes moved per
replica and lookup step (sent + received, popdist_lite.stats()), unique-index ratio,
resident memory the variant added (its table, state and scratch, after warm-up) and the
job's peak RSS per replica (ru_maxrss), and the time per lookup phase. The summary gives
dense / sparse, sparse / mpi4py and sparse / np_take (recommender lookup: at most
1.5) as ratios of those medians (the targets) and, as a
check on drift, ``*_paired``: the median over rounds of the ratio of the two variants'
blocks in the same round (each block the slowest replica's).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402

from _launch import on_test_hosts, run_ranks, test_hosts_setup, under_mpi  # noqa: E402

WORKLOADS = {
    "char": {"t": 256, "e": 256, "shape": (16, 99), "kind": "ascii"},
    "recsys": {"t": 1_000_000, "e": 64, "shape": (8192,), "kind": "zipf"},
}
VARIANTS = ("dense", "encoding", "sparse", "mpi4py", "np_take")
BATCHES = 4  # distinct index batches per replica, cycled
WARMUP = 3


def batches(workload: dict, replica: int) -> list[np.ndarray]:
    rng = np.random.default_rng([2024, replica])
    out = []
    for _ in range(BATCHES):
        if workload["kind"] == "zipf":
            out.append(np.minimum(rng.zipf(1.1, size=workload["shape"]) - 1, workload["t"] - 1))
        else:
            out.append(rng.integers(32, 127, size=workload["shape"]))
    return out


class PlainSparse:
    """The floor: a sparse exchange with plain mpi4py, as simply as possible."""

    def __init__(self, t: int, e: int, comm):
        self.comm, self.r, self.e = comm, comm.size, e
        self.shard = np.random.default_rng(comm.rank).random((-(-t // comm.size), e), dtype=np.float32)
        self.moved = 0

    def _send(self, uniq):
        owner = uniq % self.r
        order = np.argsort(owner, kind="stable")
        send_counts = np.bincount(owner, minlength=self.r)
        recv_counts = np.empty(self.r, np.int64)
        self.comm.Alltoall(send_counts, recv_counts)
        ids = np.empty(recv_counts.sum(), np.int64)
        self.comm.Alltoallv([uniq[order] // self.r, send_counts], [ids, recv_counts])
        return order, send_counts, recv_counts, ids

    def lookup(self, idx):
        uniq, inverse = np.unique(idx.reshape(-1), return_inverse=True)
        order, send_counts, recv_counts, ids = self._send(uniq)
        got = np.empty((uniq.size, self.e), np.float32)
        self.comm.Alltoallv([self.shard[ids], recv_counts * self.e], [got, send_counts * self.e])
        rows = np.empty_like(got)
        rows[order] = got
        k = self.comm.rank
        self.moved = int(8 * (send_counts.sum() - send_counts[k] + recv_counts.sum() - recv_counts[k]) * (1 + self.e / 2))
        return rows[inverse].reshape(idx.shape + (self.e,))

    def apply_gradients(self, idx, grads, lr=0.01):
        uniq, inverse = np.unique(idx.reshape(-1), return_inverse=True)
        sums = np.zeros((uniq.size, self.e), np.float32)
        np.add.at(sums, inverse, grads.reshape(-1, self.e))
        order, send_counts, recv_counts, ids = self._send(uniq)
        got = np.empty((ids.size, self.e), np.float32)
        self.comm.Alltoallv([sums[order], send_counts * self.e], [got, recv_counts * self.e])
        np.subtract.at(self.shard, ids, lr * got)


class Take:
    """No communication: np.take on the whole table in this process."""

    def __init__(self, t: int, e: int):
        self.table = np.random.default_rng(0).random((t, e), dtype=np.float32)
        self.moved = 0

    def lookup(self, idx):
        return np.take(self.table, idx, axis=0)

    def apply_gradients(self, idx, grads, lr=0.01):
        uniq, inverse = np.unique(idx.reshape(-1), return_inverse=True)
        sums = np.zeros((uniq.size, grads.shape[-1]), np.float32)
        np.add.at(sums, inverse, grads.reshape(uniq.size and -1, grads.shape[-1]))
        self.table[uniq] -= lr * sums


def make(variant: str, w: dict, comm):
    import popdist_lite as pl

    spec = pl.HostEmbeddingOptimizerSpec(0.01)
    if variant in ("dense", "sparse"):
        return pl.create_host_embedding(f"bench_{variant}", shape=[w["t"], w["e"]], optimizer_spec=spec,
                                        exchange=variant)
    if variant == "encoding":
        return pl.create_host_embedding("bench_encoding", shape=[w["t"], w["e"]], partition_strategy="ENCODING",
                                        optimizer_spec=spec)
    if variant == "mpi4py":
        return PlainSparse(w["t"], w["e"], comm)
    return Take(w["t"], w["e"])


def across(comm, value: float) -> dict:
    from mpi4py import MPI

    values = comm.allgather(value)  # once per report: pickling is fine here
    del MPI
    return {"avg": round(float(np.mean(values)), 4), "max": round(float(np.max(values)), 4),
            "per_replica": [round(v, 4) for v in values]}


def rss_mib() -> float:
    """This process's resident memory now (MiB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def interleaved(comm, variants: dict, steps: int, blocks: int, body) -> dict:
    """ms per step of each block of each variant (this replica): block ``b`` of every
    variant runs before block ``b + 1`` of any, each after a barrier."""
    per_block, means = max(steps // blocks, 1), {name: [] for name in variants}
    for s in range(WARMUP):
        for v in variants.values():
            body(v, s)
    for b in range(blocks):
        for name, v in variants.items():
            comm.Barrier()
            start = time.perf_counter()
            for s in range(b * per_block, (b + 1) * per_block):
                body(v, s)
            means[name].append((time.perf_counter() - start) / per_block * 1e3)
    return means


def paired_ratio(comm, slow: list, fast: list) -> float:
    """Median over rounds of slow / fast, each block the slowest replica's: the two
    blocks of a round ran seconds apart, so drifts of the machine cancel out (as
    bench_collectives.py's ratios)."""
    from mpi4py import MPI

    both = np.array([slow, fast], np.float64)
    slowest = np.empty_like(both)
    comm.Allreduce(both, slowest, op=MPI.MAX)
    return round(float(np.median(slowest[0] / slowest[1])), 2)


def worker(opts) -> None:
    import popdist_lite as pl

    pl.init()
    comm = pl.replica_comm()
    w = WORKLOADS[opts.workload]
    idx = batches(w, comm.rank)
    grads = [np.full(i.shape + (w["e"],), 1e-3, np.float32) for i in idx]
    unique_ratio = float(np.mean([np.unique(i).size / i.size for i in idx]))
    variants, added, moved, phases = {}, {}, {}, {}
    for name in opts.variants.split(","):
        before = rss_mib()
        v = variants[name] = make(name, w, comm)
        pl.reset_stats()
        for s in range(WARMUP + BATCHES):  # warm-up (scratch sized), then one counted pass
            if s == WARMUP:
                pl.reset_stats()
            v.lookup(idx[s % BATCHES])
        stats = pl.stats()
        moved[name] = v.moved if name == "mpi4py" else (stats["bytes_sent"] + stats["bytes_received"]) / BATCHES
        phases[name] = {p: round(x["seconds"] / BATCHES * 1e3, 4) for p, x in stats["phases"].items()}
        added[name] = rss_mib() - before
    lookup = interleaved(comm, variants, opts.steps, opts.blocks, lambda v, s: v.lookup(idx[s % BATCHES]))

    def step(v, s):
        v.lookup(idx[s % BATCHES])
        v.apply_gradients(idx[s % BATCHES], grads[s % BATCHES])

    update = interleaved(comm, variants, opts.steps, opts.blocks, step)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    report = {name: {"workload": opts.workload, "variant": name, "steps": opts.steps, "blocks": opts.blocks,
                     "lookup_ms": across(comm, float(np.median(lookup[name]))),
                     "lookup_update_ms": across(comm, float(np.median(update[name]))),
                     "bytes_per_lookup_per_replica": across(comm, float(moved[name])),
                     "unique_ratio": across(comm, unique_ratio), "rss_added_mib": across(comm, added[name]),
                     "lookup_phase_ms": phases[name]}
              for name in variants}
    peak = across(comm, peak)
    paired = {}
    if "dense" in lookup and "sparse" in lookup:
        paired["dense_over_sparse_lookup"] = paired_ratio(comm, lookup["dense"], lookup["sparse"])
    if "sparse" in lookup and "np_take" in lookup:
        paired["sparse_over_np_take_lookup"] = paired_ratio(comm, lookup["sparse"], lookup["np_take"])
    if "sparse" in lookup and "mpi4py" in lookup:
        paired["sparse_over_mpi4py_lookup"] = paired_ratio(comm, lookup["sparse"], lookup["mpi4py"])
    if comm.rank == 0:
        print("JSON " + json.dumps({"variants": report, "job_peak_rss_mib": peak, "paired": paired}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps-char", type=int, default=200)
    parser.add_argument("--steps-recsys", type=int, default=160)
    parser.add_argument("--blocks", type=int, default=16, help="timed blocks per variant (median kept)")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--hosts", type=int, default=0,
                        help="spread the replicas over this many network-namespace test hosts, TCP only (root)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker or under_mpi():
        worker(opts)
        return
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    results, peaks, paired = {}, {}, {}
    with on_test_hosts(opts.hosts, opts.ranks) as launcher_args:
        for workload in opts.workloads.split(","):
            steps = opts.steps_char if workload == "char" else opts.steps_recsys
            args = ["--workload", workload, "--variants", opts.variants, "--steps", str(steps),
                    "--blocks", str(opts.blocks)]
            got = run_ranks(os.path.abspath(__file__), args, opts.ranks, opts.timeout, launcher_args)[0]
            results[workload], peaks[workload], paired[workload] = got["variants"], got["job_peak_rss_mib"], got["paired"]
    summary = {}
    for workload, r in results.items():
        s = {}
        if "sparse" in r and "dense" in r:
            s["dense_over_sparse_lookup"] = round(r["dense"]["lookup_ms"]["max"] / r["sparse"]["lookup_ms"]["max"], 2)
        if "sparse" in r and "np_take" in r:
            s["sparse_over_np_take_lookup"] = round(r["sparse"]["lookup_ms"]["max"] / r["np_take"]["lookup_ms"]["max"],
                                                    3)
        if "sparse" in r and "mpi4py" in r:
            s["sparse_over_mpi4py_lookup"] = round(r["sparse"]["lookup_ms"]["max"] / r["mpi4py"]["lookup_ms"]["max"], 3)
        for name, ratio in paired[workload].items():
            s[name + "_paired"] = ratio
        summary[workload] = s
    rec = summary.get("recsys", {})
    summary["targets"] = {"dense_over_sparse_lookup_at_least": 5.0, "sparse_over_mpi4py_lookup_at_most": 1.25,
                          "sparse_over_np_take_lookup_at_most": 1.5,
                          "met": bool(rec.get("dense_over_sparse_lookup", 0) >= 5.0
                                      and rec.get("sparse_over_mpi4py_lookup", 99) <= 1.25),
                          "sparse_over_np_take_met": bool(rec.get("sparse_over_np_take_lookup", 99) <= 1.5)}
    where = test_hosts_setup(opts.hosts, opts.ranks) if opts.hosts else {}
    print(json.dumps({"benchmark": "lookup", "replicas": opts.ranks, **where, "seconds": round(time.perf_counter() - start, 1),
                      "machine": {"cpus": os.cpu_count(), "load_avg_1min_before": round(load_before, 2),
                                  "load_avg_1min_after": round(os.getloadavg()[0], 2)},
                      "summary": summary, "job_peak_rss_mib": peaks, "results": results}, indent=1))


if __name__ == "__main__":
    main()
