#!/usr/bin/env python3
"""Benchmark checkpoints: save and load throughput per replica against raw
``np.save``/``np.load`` of the same bytes on the same disk, in the same job, and the
training step's stall with ``blocking=False`` against a memcpy of the replica's state.

Usage::

    python scripts/bench_checkpoint.py [--rows 1000000] [--dim 64] [--rounds 3] [--dir /tmp] [--timeout 500]

One job of 2 replicas (poprun-lite, under a timeout) holds a ``rows x dim`` float32
TOKEN table with Adam state (weights, m, v: ``(rows/2, dim)`` float32 each and the
per-row int64 step counts on each replica) and 4 MiB of replicated dense parameters.
Each round, in this order, every replica timed between barriers (the slowest replica's
time counts, as a save is done when every replica is):

- ``raw_save``: ``np.save`` of the replica's arrays (replica 0 also the dense ones)
  into files of its own, then ``os.fsync`` of each (``raw_save_nosync``: without);
- ``save``: ``save_checkpoint`` (crc32, fsync, commit);
- ``raw_load``: ``np.load`` of the raw files;
- ``load``: ``load_checkpoint`` into the same state (verify, copy in place);
- ``resharded_load``: ``load_checkpoint`` into an ENCODING table of the same shape: every
  replica takes its half of the columns of every row, so it reads every writer's files
  (twice the bytes it ends up holding), and checksums its share of them;
- ``raw_resharded_load``: the same reshard by hand with numpy: ``np.load`` of the same
  raw files (every writer's) and slicing each one's rows and this replica's columns
  into ENCODING-shaped arrays (no checksums);
- ``async_stall``: the time ``save_checkpoint(..., blocking=False)`` takes to return,
  against ``memcpy``, copying the replica's arrays (``np.copyto``); then the background
  save is waited for (``async_total``).

After the rounds, ``peak_extra_MB`` gives the most memory each load needed beyond what the
replica held before it (the largest over replicas of the peak resident set size, reset
through ``/proc/self/clear_refs``, minus the resident size before): a load maps one
chunk of a file at a time (``CHUNK_BYTES``, 16 MiB), ``np.load`` reads whole files.

Throughputs are the replica's bytes (what it writes / what it ends up holding) over the
median time; ratios compare medians. The resharded load is compared with the raw reshard
of the same files (``resharded_load_vs_raw_resharded_load``, the target's ratio) and, for
scale, with the raw load of the replica's own files (``resharded_load_vs_raw_load``),
which reads half as many bytes. Every file is in the page cache when read (both
sides alike); saves go to the disk through fsync.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import run_ranks  # noqa: E402


def driver(args) -> int:
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    try:
        found = run_ranks(str(Path(__file__).resolve()), ["--rows", str(args.rows), "--dim", str(args.dim),
                                                          "--rounds", str(args.rounds), "--dir", args.dir],
                          2, args.timeout)[-1]
    except (RuntimeError, IndexError) as exc:
        print(json.dumps({"benchmark": "checkpoint", "error": str(exc)[-3000:]}, indent=2))
        return 1
    print(json.dumps({"benchmark": "checkpoint", "wall_seconds": round(time.perf_counter() - started, 1),
                      "load_avg_1min_before": round(load_before, 2),
                      "load_avg_1min_after": round(os.getloadavg()[0], 2), **found}, indent=2))
    return 0


def worker(args) -> None:
    import numpy as np
    from mpi4py import MPI

    import popdist_lite as pl

    pl.init()
    comm = pl.replica_comm()
    k = comm.rank
    base = Path(comm.bcast(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=args.dir) if k == 0 else None))
    spec = pl.HostEmbeddingAdamOptimizerSpec(1e-3)
    table = pl.create_host_embedding("table", [args.rows, args.dim], optimizer_spec=spec, seed=1)
    arrays = table.state().arrays
    rng = np.random.default_rng(k)
    for key in ("optimizer/m", "optimizer/v"):
        arrays[key][...] = rng.random(arrays[key].shape, dtype=np.float32)
    arrays["optimizer/steps"][...] = rng.integers(0, 100, arrays["optimizer/steps"].shape)
    params = {"w": np.random.default_rng(0).random((1024, 1024), dtype=np.float32)}  # 4 MiB, replicated
    state = {"table": table, "params": params, "step": 0}
    mine = dict(arrays, **({"params/w": params["w"]} if k == 0 else {}))
    held = int(sum(a.nbytes for a in arrays.values())) + params["w"].nbytes  # what the replica holds
    written = int(sum(a.nbytes for a in mine.values()))                      # what it writes
    encoding = pl.create_host_embedding("table", [args.rows, args.dim], optimizer_spec=spec, seed=1,
                                        partition_strategy="ENCODING")
    other = {"table": encoding, "params": {"w": np.zeros_like(params["w"])}, "step": 0}
    held_encoding = int(sum(a.nbytes for a in encoding.state().arrays.values())) + params["w"].nbytes
    by_hand = {n: np.zeros_like(a) for n, a in encoding.state().arrays.items()}
    by_hand["params/w"] = np.zeros_like(params["w"])
    layouts = encoding.state().layouts
    copies = {n: np.empty_like(a) for n, a in mine.items()}
    raw = base / f"raw-{k}"
    raw.mkdir()
    times: dict[str, list[float]] = {}

    def timed(name, fn):
        comm.Barrier()
        start = time.perf_counter()
        fn()
        mine_s = time.perf_counter() - start
        times.setdefault(name, []).append(comm.allreduce(mine_s, op=MPI.MAX))

    def raw_save(sync):
        for n, a in mine.items():
            with open(raw / (n.replace("/", ".") + ".npy"), "wb") as f:
                np.save(f, a)
                if sync:
                    f.flush()
                    os.fsync(f.fileno())

    def raw_load():
        for n in mine:
            np.load(raw / (n.replace("/", ".") + ".npy"), allow_pickle=False)

    def raw_resharded_load():
        r, t, e = comm.size, args.rows, args.dim
        columns = slice(k * -(-e // r), min(e, (k + 1) * -(-e // r)))
        for writer in range(r):
            rows = len(range(writer, t, r))
            for n, dest in by_hand.items():
                if n == "params/w":
                    if writer == 0:
                        dest[...] = np.load(base / "raw-0" / "params.w.npy", allow_pickle=False)
                    continue
                a = np.load(base / f"raw-{writer}" / (n.replace("/", ".") + ".npy"), allow_pickle=False)[:rows]
                if layouts[n] == "table":
                    dest[writer::r, :columns.stop - columns.start] = a[:, columns]  # ENCODING pads columns
                else:
                    dest[writer::r] = a

    def memcpy():
        for n, a in mine.items():
            np.copyto(copies[n], a)

    def peak_extra(fn):
        """MB of resident memory ``fn`` needed beyond what was resident before (Linux)."""
        def status(field):
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
        comm.Barrier()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak resident set size (VmHWM)
        before = status("VmRSS")
        fn()
        return comm.allreduce((status("VmHWM") - before) / 1024, op=MPI.MAX)

    ckpt = base / "ckpt"
    for round_ in range(args.rounds):
        step = 10 * round_
        timed("raw_save_nosync", lambda: raw_save(False))
        timed("raw_save", lambda: raw_save(True))
        timed("save", lambda: pl.save_checkpoint(ckpt, state, step=step + 1, keep=1))
        timed("raw_load", raw_load)
        latest = pl.latest_checkpoint(ckpt)
        timed("load", lambda: pl.load_checkpoint(latest, state))
        timed("resharded_load", lambda: pl.load_checkpoint(latest, other))
        timed("raw_resharded_load", raw_resharded_load)
        timed("memcpy", memcpy)
        timed("async_stall", lambda: pl.save_checkpoint(ckpt, state, step=step + 2, keep=1, blocking=False))
        timed("async_total", pl.wait_checkpoint)
    latest = pl.latest_checkpoint(ckpt)
    peaks = {"load": peak_extra(lambda: pl.load_checkpoint(latest, state)),
             "resharded_load": peak_extra(lambda: pl.load_checkpoint(latest, other)),
             "raw_load": peak_extra(raw_load), "raw_resharded_load": peak_extra(raw_resharded_load)}
    np.testing.assert_array_equal(other["params"]["w"], params["w"])  # the loads did load, and alike
    for n, a in encoding.state().arrays.items():
        np.testing.assert_array_equal(by_hand[n], a, err_msg=n)

    def med(name):
        return float(np.median(times[name]))

    mb = 1e6
    result = {
        "replicas": comm.size, "rows": args.rows, "dim": args.dim, "rounds": args.rounds, "dir": args.dir,
        "bytes_written_per_replica": written, "bytes_held_per_replica": held,
        "seconds": {n: [round(t, 4) for t in v] for n, v in times.items()},
        "MB_per_s_per_replica": {
            "raw_save": round(written / med("raw_save") / mb), "raw_save_nosync": round(written / med("raw_save_nosync") / mb),
            "save": round(written / med("save") / mb), "raw_load": round(written / med("raw_load") / mb),
            "load": round(held / med("load") / mb), "resharded_load": round(held_encoding / med("resharded_load") / mb),
            "raw_resharded_load": round(held_encoding / med("raw_resharded_load") / mb)},
        "save_vs_raw_save": round(med("raw_save") / med("save"), 3),
        "save_vs_raw_save_nosync": round(med("raw_save_nosync") / med("save"), 3),
        "load_vs_raw_load": round((held / med("load")) / (written / med("raw_load")), 3),
        "resharded_load_vs_raw_resharded_load": round(med("raw_resharded_load") / med("resharded_load"), 3),
        "resharded_load_vs_raw_load": round((held_encoding / med("resharded_load")) / (written / med("raw_load")), 3),
        "async_stall_vs_memcpy": round(med("async_stall") / med("memcpy"), 3),
        "peak_extra_MB": {n: round(v, 1) for n, v in peaks.items()},
        "targets": {"save_vs_raw_save": ">= 0.8", "resharded_load_vs_raw_resharded_load": ">= 0.7",
                    "async_stall_vs_memcpy": "<= 1.5"},
    }
    comm.Barrier()
    if k == 0:
        shutil.rmtree(base, ignore_errors=True)
        print("JSON " + json.dumps(result), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the files go (one disk for both sides)")
    p.add_argument("--timeout", type=float, default=500)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
