#!/usr/bin/env python3
"""OSU-style latency sweep: popdist-lite collectives against raw mpi4py buffer calls.

    python scripts/bench_collectives.py [--ranks 2] [--max-bytes 16777216] [--timeout 600]
    python scripts/bench_collectives.py --hosts 2 --ranks 4     # 2 test hosts x 2 replicas, TCP

prints one JSON object on stdout. Without ``--worker`` it launches itself on
``--ranks`` replicas with ``poprun-lite`` (under ``--timeout``) and prints what replica
0 reports.

Method (OSU micro-benchmarks, made robust to a shared machine): for every message size
from 8 B to ``--max-bytes`` (powers of two; the size is each replica's input array,
float32), a barrier and a warm-up, then ``--blocks`` rounds (default 31). Each round
times one block of calls of each variant, in a rotating order, each block after a
barrier and sized to about 1 ms from a calibration (at least 1 call, at most 200): raw
mpi4py, ours as shipped (every call starts with the cross-replica argument check) and
ours with ``popdist_lite.set_collective_checks(False)`` ("unchecked"), and the *checked
floor*: raw mpi4py preceded by a bare ``Allgather`` of one signature row (the 112 bytes
every checked call exchanges, with no Python around it), the least any implementation
that checks arguments across replicas before moving data can cost. Ours and raw use
the same preallocated arrays; ours passes ``out=`` (no allocation). A block's time is
the slowest replica's (one Allreduce MAX at the end). Per variant: ``*_us``, avg/min/max
across replicas of the per-replica mean (OSU's report), and ``*_median_block_us``. The
``ratio`` of ours to raw is the median over rounds of the ratio of the two blocks of the
same round (adjacent in time, so a burst of load from other processes cancels out);
``overhead_us`` is the median of their differences.
Stall inspector: under poprun-lite (whose stall inspector is on by default) every
collective call also records its op, call number and time for the inspector
(:mod:`popdist_lite.progress`). A fifth variant, "quiet", is ours with that recorder
paused; ``inspector_overhead_us`` is the median over rounds of ours minus quiet, and
``summary.inspector`` adds the recorder's own cost per call (``record_on_ns``,
``record_off_ns``: timeit, best of 5) against the target of 1 us per call.
Operations (ours / raw):
    all_gather          Allgather(x, out)                  out: (r, n)
    reduce_scatter_sum  Reduce_scatter_block(x, out, SUM)  x: (r, n/r)
    all_to_all          Alltoall(x, out)                   x: (n,)
    all_reduce          Allreduce(x, out, SUM)
    broadcast           Bcast(x, root=0)
With ``--hosts H`` (root: network-namespace test hosts, popdist_lite_launcher.testing.netns_hosts)
the replicas are spread evenly over H test hosts and every byte between ranks goes over
TCP (``--mca btl tcp,self``), for ours and raw alike; with more replicas than cores
they yield the processor while waiting (``mpi_yield_when_idle``: the test hosts share
this machine's cores, see ``_launch.on_test_hosts``).
Targets: ours / raw <= 1.10 for >= 64 KiB; ours - raw < 15 us below. ``floor_*``
fields report the checked floor the same way (a size where ``floor_ratio`` exceeds 1.10
is one where no checked collective can meet the ratio target on this machine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402

from _launch import on_test_hosts, run_ranks, test_hosts_setup, under_mpi  # noqa: E402

OPS = ("all_gather", "reduce_scatter_sum", "all_to_all", "all_reduce", "broadcast")
SMALL = 8192


def calls(op: str, n_bytes: int, comm):
    """(ours, raw): two zero-argument callables on the same preallocated arrays."""
    import popdist_lite as pl
    from mpi4py import MPI

    r = comm.size
    n = max(n_bytes // 4, r)
    n -= n % r
    x = np.ones(n, np.float32)
    if op == "all_gather":
        out = np.empty((r, n), np.float32)
        return (lambda: pl.all_gather(x, out=out)), (lambda: comm.Allgather(x, out))
    if op == "reduce_scatter_sum":
        x2, out = x.reshape(r, n // r), np.empty(n // r, np.float32)
        return (lambda: pl.reduce_scatter_sum(x2, out=out)), (lambda: comm.Reduce_scatter_block(x2, out, op=MPI.SUM))
    if op == "all_to_all":
        out = np.empty(n, np.float32)
        return (lambda: pl.all_to_all(x, out=out)), (lambda: comm.Alltoall(x, out))
    if op == "all_reduce":
        out = np.empty(n, np.float32)
        return (lambda: pl.all_reduce(x, out=out)), (lambda: comm.Allreduce(x, out, op=MPI.SUM))
    if op == "broadcast":
        return (lambda: pl.broadcast(x, root=0, out=x)), (lambda: comm.Bcast(x, root=0))
    raise ValueError(op)


def across(comm, value: float) -> dict:
    """avg/min/max of ``value`` (microseconds) across replicas (raw MPI, not counted)."""
    from mpi4py import MPI

    mine = np.array([value], np.float64)
    lo, hi, total = np.empty(1), np.empty(1), np.empty(1)
    comm.Allreduce(mine, lo, op=MPI.MIN)
    comm.Allreduce(mine, hi, op=MPI.MAX)
    comm.Allreduce(mine, total, op=MPI.SUM)
    return {"avg": round(total[0] / comm.size, 3), "min": round(lo[0], 3), "max": round(hi[0], 3)}


def measure(op: str, n_bytes: int, comm, blocks: int) -> dict:
    import popdist_lite as pl
    from mpi4py import MPI

    from popdist_lite import progress

    ours, raw = calls(op, n_bytes, comm)
    from popdist_lite.collectives.agreement import SIGNATURE

    sig, table = np.zeros(1, SIGNATURE).view(np.int64), np.zeros(comm.size, SIGNATURE).view(np.int64)  # one row each

    def floor():
        comm.Allgather(sig, table)
        raw()

    inspected = progress.set_recording(True)  # on when poprun-lite's stall inspector is
    # (name, call, checks, progress recorded); "quiet" is "ours" with the inspector's
    # recorder paused, measured only when the inspector is on
    variants = [("raw", raw, True, False), ("ours", ours, True, inspected),
                ("unchecked", ours, False, inspected), ("floor", floor, True, False)]
    if inspected:
        variants.append(("quiet", ours, True, False))
    comm.Barrier()
    for _, f, checks, recording in variants:  # warm-up, and a calibration of the block size
        pl.set_collective_checks(checks)
        progress.set_recording(recording)
        for _ in range(20 if n_bytes <= SMALL else 3):
            f()
    start = time.perf_counter()
    for _ in range(5):
        raw()
    guess = np.array([(time.perf_counter() - start) / 5], np.float64)
    comm.Allreduce(MPI.IN_PLACE, guess, op=MPI.MAX)  # the same block size on every replica
    per_block = int(min(200, max(1, 1e-3 // max(guess[0], 1e-9))))
    times = np.zeros((len(variants), blocks))
    for b in range(blocks):
        for i in range(len(variants)):
            j = (i + b) % len(variants)  # rotate the order: no variant always runs first
            _, f, checks, recording = variants[j]
            pl.set_collective_checks(checks)
            progress.set_recording(recording)
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(per_block):
                f()
            times[j, b] = (time.perf_counter() - start) / per_block * 1e6
    pl.set_collective_checks(True)
    progress.set_recording(inspected)
    mine = times.mean(axis=1)
    slowest = np.empty_like(times)
    comm.Allreduce(times, slowest, op=MPI.MAX)
    result = {"bytes": n_bytes, "calls_per_block": per_block, "blocks": blocks}
    for j, (name, _, _, _) in enumerate(variants):
        result[f"{name}_us"] = across(comm, float(mine[j]))
        result[f"{name}_median_block_us"] = round(float(np.median(slowest[j])), 3)
    for j, prefix in ((1, ""), (2, "unchecked_"), (3, "floor_")):
        result[f"{prefix}ratio"] = round(float(np.median(slowest[j] / slowest[0])), 3)
        result[f"{prefix}overhead_us"] = round(float(np.median(slowest[j] - slowest[0])), 3)
    if inspected:  # the stall inspector's cost per checked call: ours - quiet, same round
        result["inspector_overhead_us"] = round(float(np.median(slowest[1] - slowest[4])), 3)
    return result


def recorder_cost(repeat: int = 5, number: int = 200_000) -> dict:
    """Nanoseconds per ``progress.record`` call, recording and paused (best of ``repeat``
    timings of ``number`` calls; only meaningful when the inspector is on)."""
    import timeit

    from popdist_lite import progress

    was = progress.set_recording(True)
    costs = {}
    for name, on in (("on", True), ("off", False)):
        progress.set_recording(on)
        best = min(timeit.repeat(lambda: progress.record("all_reduce", 7), number=number, repeat=repeat))
        costs[f"record_{name}_ns"] = round(best / number * 1e9, 1)
    progress.set_recording(was)
    return costs


def worker(opts) -> None:
    import popdist_lite as pl

    pl.init()
    comm = pl.replica_comm()
    sizes = [1 << p for p in range(3, 64) if (1 << p) <= opts.max_bytes]
    results, start = {}, time.perf_counter()
    for op in OPS:
        results[op] = [measure(op, s, comm, opts.blocks) for s in sizes]
    large = [m for op in OPS for m in results[op] if m["bytes"] >= 65536]
    small = [m for op in OPS for m in results[op] if m["bytes"] < 65536]
    summary = {
        "max_ratio_at_or_above_64KiB": max((m["ratio"] for m in large), default=None),
        "max_overhead_us_below_64KiB": max((m["overhead_us"] for m in small), default=None),
        "target_ratio": 1.10, "target_overhead_us": 15.0,
    }
    summary["met"] = bool((summary["max_ratio_at_or_above_64KiB"] or 0) <= 1.10
                          and (summary["max_overhead_us_below_64KiB"] or 0) < 15.0)
    # set_collective_checks(False): the same calls without the cross-replica argument check.
    summary["unchecked_max_ratio_at_or_above_64KiB"] = max((m["unchecked_ratio"] for m in large), default=None)
    summary["unchecked_max_overhead_us_below_64KiB"] = max((m["unchecked_overhead_us"] for m in small), default=None)
    summary["unchecked_met"] = bool((summary["unchecked_max_ratio_at_or_above_64KiB"] or 0) <= 1.10
                                    and (summary["unchecked_max_overhead_us_below_64KiB"] or 0) < 15.0)
    summary["floor_max_ratio_at_or_above_64KiB"] = max((m["floor_ratio"] for m in large), default=None)
    for prefix in ("", "unchecked_", "floor_"):
        # the smallest size from which every operation, at every larger size too, is within 1.10x
        ok = [all(m[f"{prefix}ratio"] <= 1.10 for op in OPS for m in results[op] if m["bytes"] >= s) for s in sizes]
        summary[f"{prefix}within_1.10_from_bytes"] = next((s for s, good in zip(sizes, ok) if good), None)
        summary[f"{prefix}max_overhead_us_at_or_above_64KiB"] = max(
            (m[f"{prefix}overhead_us"] for m in large), default=None)
    from popdist_lite import progress

    if progress.set_recording(True):  # the stall inspector is on (poprun-lite's default)
        overheads = [m["inspector_overhead_us"] for op in OPS for m in results[op]]
        summary["inspector"] = {
            **recorder_cost(),
            "median_overhead_us_per_checked_call": round(float(np.median(overheads)), 3),
            "max_overhead_us_below_64KiB": max(m["inspector_overhead_us"] for m in small) if small else None,
            "target_us": 1.0,
        }
    if comm.rank == 0:
        report = {"benchmark": "collectives", "replicas": comm.size, "dtype": "float32",
                  "seconds": round(time.perf_counter() - start, 1), "summary": summary, "results": results}
        print("JSON " + json.dumps(report), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--max-bytes", type=int, default=16 << 20)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--blocks", type=int, default=31, help="timed rounds per size (default 31)")
    parser.add_argument("--hosts", type=int, default=0,
                        help="spread the replicas over this many network-namespace test hosts, TCP only (root)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker or under_mpi():
        worker(opts)
        return
    load_before = os.getloadavg()[0]
    with on_test_hosts(opts.hosts, opts.ranks) as launcher_args:
        reports = run_ranks(os.path.abspath(__file__), ["--max-bytes", str(opts.max_bytes), "--blocks", str(opts.blocks)],
                            opts.ranks, opts.timeout, launcher_args)
    if opts.hosts:
        reports[0].update(test_hosts_setup(opts.hosts, opts.ranks))
    reports[0]["machine"] = {"cpus": os.cpu_count(), "load_avg_1min_before": round(load_before, 2),
                             "load_avg_1min_after": round(os.getloadavg()[0], 2)}
    print(json.dumps(reports[0], indent=1))


if __name__ == "__main__":
    main()
