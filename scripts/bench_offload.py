#!/usr/bin/env python3
"""Disk-backed embedding tables (``DiskStorage``) against the in-memory table: lookup +
update per step, cache hit rate and disk bytes per step, LRU against LFU on the same
trace; and (``--large``) a table larger than the machine's RAM trained with each
replica's resident memory measured against its cache.

    python scripts/bench_offload.py [--ranks 2] [--rows 1000000] [--steps 160] [--dir /var/tmp] [--timeout 900]
    python scripts/bench_offload.py --large [--large-rows 36000000] [--large-steps 1000] [--cache-mib 256]

prints one JSON object on stdout. Without ``--worker`` it launches itself on ``--ranks``
replicas with ``poprun-lite`` (under ``--timeout``). The partition files go to a fresh
directory under ``--dir`` (a local disk: on a tmpfs the "disk" is RAM), removed when the
job ends, also when it fails or times out.

Workload (the recommender's): a ``rows x 64`` float32 TOKEN table (sparse exchange)
with Adam (a 776-byte record per row on disk: weights, ``m``, ``v``, the row's step
count), 8192 IDs per replica and step from Zipf(1.1) (minus 1, clipped to the table),
drawn per replica and step from a fixed seed: every variant sees the same trace, a
fresh batch every step (no batch repeats, so the cache is not flattered). A step is
``lookup`` then ``apply_gradients`` (gradients 1e-3).

Variants (all in one job, each its own table):
    memory    the in-memory table (``storage=None``)
    lru10     DiskStorage, LRU, a cache of 10 % of the replica's partition (the table 10x its cache)
    lfu10     the same with LFU
    lru5      LRU, a 5 % cache
    lfu5      LFU, a 5 % cache
    lru10p, lru5p, lfu5p
              the same with prefetch: every step first calls ``table.prefetch`` with the
              next step's IDs (``ahead=1``), so their rows are read while this step's
              lookup and update run (TorchRec's prefetch pipeline, one batch ahead)
A cache fraction is of the partition's records plus the cache's bookkeeping per row
(``SLOT_OVERHEAD`` bytes). Each variant first runs ``--warmup`` steps (the cache fills; the counters are
then read), then the timed steps in ``--blocks`` interleaved blocks (block 1 of every
variant, then block 2, ..., each after a barrier), so load from other processes on a
shared machine hits every variant alike; a variant's time is its median block.

Reported per variant: ms per step (per replica the median block's mean step time, then
avg and max across replicas), ``over_memory`` (max / the in-memory table's max) and
``over_memory_paired`` (the median over blocks of the ratio to the in-memory table's
block of the same round, each block the slowest replica's), and over the timed steps
from ``table.storage_stats``: the hit rate (distinct rows per call found in the cache),
MiB read from and written to the partition file per step, evictions per step, seconds
in file reads and writes per step (per replica: avg and max). The goal the project set:
within 1.5x of the in-memory table at a 5 % cache with prefetch (the ``p`` variants;
without it each miss is waited for). ``wait_ms_per_step`` is the training loop's own wait
for the file (``storage_stats``' ``wait_seconds``), the part of the time in the file that
prefetch does not hide.

``--large``: one disk table only (LRU), ``--large-rows`` x 64 float32 with Adam, by
default 36,000,000 rows: 26 GiB of rows and state across 2 replicas, more than this
machine's 23 GiB of RAM; a cache of ``--cache-mib`` per replica (256 MiB: 338,000 rows,
full after about 400 steps, so most steps evict and write rows back); ``--large-steps``
steps of the same workload. Reported per replica: the peak resident set size (``VmHWM`` of
``/proc/self/status``) before the table was made, after it was made, and after
training, and the resident set after training; the cache's bytes; the overhead (peak
minus cache) and the parts of it that grow with the table (the cache's row -> slot
index, 4 bytes per partition row; the sparse exchange's position array, 4 bytes per
row of the whole table); the seconds to make the table, ms per step, hit rate and disk
traffic per step as above. The driver
refuses a ``--dir`` without room for the files (its free space is checked first).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402

from _launch import run_ranks, under_mpi  # noqa: E402

E, IDS, SEED = 64, 8192, 2030
#: variant -> ``None`` (the in-memory table) or ``cache`` (the cache's fraction of the
#: partition) and the other arguments of its DiskStorage.
VARIANTS = {"memory": None,
            "lru10": {"cache": 0.10, "cache_policy": "lru"}, "lfu10": {"cache": 0.10, "cache_policy": "lfu"},
            "lru5": {"cache": 0.05, "cache_policy": "lru"}, "lfu5": {"cache": 0.05, "cache_policy": "lfu"},
            "lru10p": {"cache": 0.10, "cache_policy": "lru", "prefetch": True},
            "lru5p": {"cache": 0.05, "cache_policy": "lru", "prefetch": True},
            "lfu5p": {"cache": 0.05, "cache_policy": "lfu", "prefetch": True}}
MIB = 2 ** 20


def ids(rows: int, replica: int, step: int, n: int = IDS) -> np.ndarray:
    """The trace: replica ``replica``'s ``n`` IDs of step ``step`` (the same for every variant)."""
    rng = np.random.default_rng([SEED, replica, step])
    return np.minimum(rng.zipf(1.1, size=n) - 1, rows - 1)


def spec():
    import popdist_lite as pl

    return pl.HostEmbeddingAdamOptimizerSpec(0.001)


def record_bytes() -> int:
    """Bytes of one row's record in the partition file (weights and Adam's state)."""
    return 4 * E + sum(a.nbytes for a in spec().init_state((1, E)).values())


def cache_bytes(rows: int, replicas: int, fraction: float) -> int:
    """``fraction`` of a TOKEN partition's rows as DiskStorage's ``cache_bytes``."""
    from popdist_lite.embedding.storage.cache import SLOT_OVERHEAD

    return int(fraction * -(-rows // replicas)) * (record_bytes() + SLOT_OVERHEAD)


def make(name: str, rows: int, directory: str, replicas: int):
    import popdist_lite as pl

    storage = None
    if VARIANTS[name] is not None:
        kwargs = dict(VARIANTS[name])
        fraction = kwargs.pop("cache")
        kwargs.pop("prefetch", None)
        storage = pl.DiskStorage(cache_bytes(rows, replicas, fraction), directory=directory, **kwargs)
    return pl.create_host_embedding(f"offload_{name}", [rows, E], optimizer_spec=spec(), exchange="sparse",
                                    storage=storage)


def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmHWM: peak resident set size; VmRSS: now)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def across(comm, value: float, digits: int = 4) -> dict:
    values = comm.allgather(value)  # once per report: pickling is fine here
    return {"avg": round(float(np.mean(values)), digits), "max": round(float(np.max(values)), digits),
            "per_replica": [round(v, digits) for v in values]}


def counters(table) -> dict:
    return dict(table.storage_stats or {})


def per_step(comm, before: dict, after: dict, steps: int) -> dict:
    """Hit rate and disk traffic per step between two ``storage_stats`` snapshots."""
    d = {key: after[key] - before[key] for key in ("hits", "misses", "evictions", "bytes_read",
                                                 "bytes_written", "disk_seconds", "wait_seconds")}
    lookups = d["hits"] + d["misses"]
    return {"hit_rate": across(comm, d["hits"] / lookups if lookups else 0.0),
            "disk_read_mib_per_step": across(comm, d["bytes_read"] / steps / MIB, 3),
            "disk_written_mib_per_step": across(comm, d["bytes_written"] / steps / MIB, 3),
            "evictions_per_step": across(comm, d["evictions"] / steps, 1),
            "disk_ms_per_step": across(comm, d["disk_seconds"] / steps * 1e3, 3),
            "wait_ms_per_step": across(comm, d["wait_seconds"] / steps * 1e3, 3),
            "cache_rows": after["cache_rows"], "file_bytes": after["file_bytes"]}


def worker(opts) -> None:
    import popdist_lite as pl
    from mpi4py import MPI

    pl.init()
    comm = pl.replica_comm()
    k, r = comm.rank, comm.size
    if opts.large:
        large(opts, comm)
        return
    names = opts.variants.split(",")
    grads = np.full((opts.ids, E), 1e-3, np.float32)
    trace = [ids(opts.rows, k, s, opts.ids) for s in range(opts.warmup + opts.steps)]

    def step(name, s):
        table = tables[name]
        if (VARIANTS[name] or {}).get("prefetch") and s + 1 < len(trace):
            table.prefetch(trace[s + 1], ahead=1)
        table.lookup(trace[s])
        table.apply_gradients(trace[s], grads)

    tables, warm = {}, {}
    for name in names:
        tables[name] = make(name, opts.rows, opts.dir, r)
        for s in range(opts.warmup):
            step(name, s)
        warm[name] = counters(tables[name])
    per_block = max(opts.steps // opts.blocks, 1)
    times = {name: [] for name in names}
    for b in range(opts.blocks):
        for name in names:
            comm.Barrier()
            start = time.perf_counter()
            for s in range(opts.warmup + b * per_block, opts.warmup + (b + 1) * per_block):
                step(name, s)
            times[name].append((time.perf_counter() - start) / per_block * 1e3)
    timed = per_block * opts.blocks
    blocks = np.array([times[name] for name in names])
    slowest = np.empty_like(blocks)
    comm.Allreduce(blocks, slowest, op=MPI.MAX)
    report = {}
    for i, name in enumerate(names):
        variant = VARIANTS[name] or {}
        fraction, policy = variant.get("cache"), variant.get("cache_policy")
        entry = {"storage": "memory" if fraction is None else "disk", "policy": policy, "cache_fraction": fraction,
                 "prefetch": bool(variant.get("prefetch")),
                 "lookup_update_ms": across(comm, float(np.median(times[name])))}
        if "memory" in names and name != "memory":
            entry["over_memory_paired"] = round(float(np.median(slowest[i] / slowest[names.index("memory")])), 2)
        if fraction is not None:
            entry["cache_bytes"] = cache_bytes(opts.rows, r, fraction)
            entry.update(per_step(comm, warm[name], counters(tables[name]), timed))
        report[name] = entry
    if "memory" in report:
        base = report["memory"]["lookup_update_ms"]["max"]
        for name, entry in report.items():
            if name != "memory":
                entry["over_memory"] = round(entry["lookup_update_ms"]["max"] / base, 2)
    peak = across(comm, status_kib("VmHWM") / 1024, 1)
    for table in tables.values():
        if table._disk is not None:
            table._disk.close()  # the files go now, not at exit
    if k == 0:
        print("JSON " + json.dumps({"variants": report, "timed_steps": timed, "job_peak_rss_mib": peak}), flush=True)


def large(opts, comm) -> None:
    """The table larger than RAM (see the module doc)."""
    import popdist_lite as pl

    from popdist_lite.embedding.storage.cache import SLOT_OVERHEAD

    k, r, rows = comm.rank, comm.size, opts.large_rows
    cache = opts.cache_mib * MIB
    grads = np.full((opts.ids, E), 1e-3, np.float32)
    comm.Barrier()
    hwm_before = status_kib("VmHWM") * 1024
    start = time.perf_counter()
    table = pl.create_host_embedding("offload_large", [rows, E], optimizer_spec=spec(), exchange="sparse",
                                     storage=pl.DiskStorage(cache, cache_policy="lru", directory=opts.dir))
    comm.Barrier()
    created = time.perf_counter() - start
    hwm_created = status_kib("VmHWM") * 1024
    stats0 = counters(table)
    step_seconds, start = [], time.perf_counter()
    for s in range(opts.large_steps):
        batch = ids(rows, k, s, opts.ids)
        t0 = time.perf_counter()
        table.lookup(batch)
        table.apply_gradients(batch, grads)
        step_seconds.append(time.perf_counter() - t0)
    comm.Barrier()
    trained = time.perf_counter() - start
    stats1 = counters(table)
    hwm = status_kib("VmHWM") * 1024
    partition_rows = -(-rows // r)
    cache_held = stats1["cache_rows"] * (record_bytes() + SLOT_OVERHEAD)
    result = {
        "rows": rows, "dim": E, "record_bytes": record_bytes(), "steps": opts.large_steps,
        "table_bytes_all_replicas": comm.allreduce(stats1["file_bytes"]),
        "file_bytes_per_replica": stats1["file_bytes"],
        "cache_bytes_per_replica": cache, "cache_rows_per_replica": stats1["cache_rows"],
        "cache_records_bytes_per_replica": cache_held,
        "index_bytes_per_replica": 4 * partition_rows,
        "exchange_position_array_bytes_per_replica": 4 * rows,
        "create_seconds": round(created, 1), "train_seconds": round(trained, 1),
        "step_ms": across(comm, float(np.median(step_seconds)) * 1e3, 2),
        "step_ms_mean": across(comm, float(np.mean(step_seconds)) * 1e3, 2),
        "peak_rss_mib_before_table": across(comm, hwm_before / MIB, 1),
        "peak_rss_mib_after_create": across(comm, hwm_created / MIB, 1),
        "peak_rss_mib": across(comm, hwm / MIB, 1),
        "rss_mib_after_training": across(comm, status_kib("VmRSS") / 1024, 1),
        "overhead_mib": across(comm, (hwm - cache) / MIB, 1),
        **per_step(comm, stats0, stats1, opts.large_steps),
    }
    table._disk.close()
    if k == 0:
        print("JSON " + json.dumps(result), flush=True)


def filesystem(path: str) -> str:
    """The type of the filesystem ``path`` is on (the longest mount point of /proc/mounts)."""
    path, best, kind = os.path.realpath(path), "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                point = fields[1].replace("\\040", " ")
                if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        pass
    return kind


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rows", type=int, default=1_000_000, help="table rows (variants)")
    parser.add_argument("--steps", type=int, default=160, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=40, help="untimed steps per variant before the timed ones")
    parser.add_argument("--blocks", type=int, default=16, help="timed blocks per variant (median kept)")
    parser.add_argument("--ids", type=int, default=IDS, help="IDs per replica and step")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--large", action="store_true", help="the table larger than RAM instead of the variants")
    parser.add_argument("--large-rows", type=int, default=36_000_000)
    parser.add_argument("--large-steps", type=int, default=1000)
    parser.add_argument("--cache-mib", type=int, default=256, help="--large: each replica's cache (MiB)")
    parser.add_argument("--dir", default="/var/tmp", help="where the partition files go (local disk)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker or under_mpi():
        worker(opts)
        return 0
    unknown = set(opts.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; expected some of {list(VARIANTS)}")
    rows = opts.large_rows if opts.large else opts.rows
    tables = 1 if opts.large else sum(v is not None for n, v in VARIANTS.items() if n in opts.variants.split(","))
    need = tables * rows * record_bytes()
    os.makedirs(opts.dir, exist_ok=True)
    free = shutil.disk_usage(opts.dir).free
    if need > free - (1 << 30):
        print(json.dumps({"benchmark": "offload", "error": f"--dir {opts.dir}: {free} bytes free, the partition "
                          f"files need {need} and 1 GiB to spare"}))
        return 1
    directory = tempfile.mkdtemp(prefix="bench-offload-", dir=opts.dir)
    args = ["--dir", directory, "--ids", str(opts.ids), "--rows", str(opts.rows), "--steps", str(opts.steps),
            "--warmup", str(opts.warmup), "--blocks", str(opts.blocks), "--variants", opts.variants,
            "--large-rows", str(opts.large_rows), "--large-steps", str(opts.large_steps),
            "--cache-mib", str(opts.cache_mib)]
    args += ["--large"] * opts.large
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    try:
        found = run_ranks(os.path.abspath(__file__), args, opts.ranks, opts.timeout)[-1]
    except (RuntimeError, IndexError) as exc:
        print(json.dumps({"benchmark": "offload", "error": str(exc)[-3000:]}, indent=1))
        return 1
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    setup = {"replicas": opts.ranks, "ids_per_replica_and_step": opts.ids, "zipf_a": 1.1, "dim": E,
             "optimizer": "adam", "record_bytes": record_bytes(), "dir": opts.dir, "filesystem": filesystem(opts.dir)}
    if not opts.large:
        setup.update(rows=opts.rows, warmup_steps=opts.warmup, blocks=opts.blocks)
    print(json.dumps({"benchmark": "offload_large" if opts.large else "offload", **setup,
                      "seconds": round(time.perf_counter() - started, 1),
                      "machine": {"cpus": os.cpu_count(), "load_avg_1min_before": round(load_before, 2),
                                  "load_avg_1min_after": round(os.getloadavg()[0], 2),
                                  "mem_total_gib": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
                                                         / 2 ** 30, 1)},
                      **({"large": found} if opts.large else found)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
