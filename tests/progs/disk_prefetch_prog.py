"""A program for tests/test_disk_prefetch_feeders.py, run on every rank by poprun-lite
(with host feeders or without): a disk-backed table fed by ``pl.infeed`` with
``prefetch_rows`` trains beside an in-memory table on the same batches.

    python tests/progs/disk_prefetch_prog.py DIRECTORY [--steps N] [--depth D]

Each replica checks every lookup against the in-memory table's and, once the step's
prefetch is waited for, that the lookup missed nothing; then prints
``PREFETCH {"replica": r, "steps": s, "prefetched_rows": p, "misses_after_wait": m,
"same": true}``.
"""

import argparse
import json

import numpy as np

import popdist_lite as pl

parser = argparse.ArgumentParser()
parser.add_argument("directory")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--depth", type=int, default=2)
args = parser.parse_args()
T, E, IDS = 600, 8, 12


def make_dataset(shard_index, num_shards):
    for b in range(shard_index, args.steps * num_shards, num_shards):
        rng = np.random.default_rng(b)
        ids = np.minimum(rng.zipf(1.1, size=IDS) - 1, T - 1)
        ids[::2] = rng.integers(0, T, size=IDS)[::2]
        yield {"ids": ids, "grads": rng.standard_normal((IDS, E)).astype(np.float32)}


pl.init()
feed = pl.infeed(make_dataset, prefetch_depth=args.depth)  # a feeder serves here and never returns
r = pl.num_replicas()
spec = pl.HostEmbeddingAdamOptimizerSpec(0.05)
memory = pl.create_host_embedding("m", [T, E], optimizer_spec=spec, seed=2)
record = E * 4 + sum(a.nbytes for a in spec.init_state((1, E)).values())  # float32 weights, Adam's state
disk = pl.create_host_embedding("d", [T, E], optimizer_spec=spec, seed=2, storage=pl.DiskStorage(
    ((args.depth + 1) * IDS * r + 4) * (record + 23), directory=args.directory))  # depth + 1 batches' rows
assert disk.storage_stats["cache_rows"] < T // r  # rows are evicted and read back
feed.prefetch_rows(disk, "ids")
same, steps, late = True, 0, 0
for batch in feed:
    assert disk.wait_prefetch(timeout=120)
    before = disk.storage_stats["misses"]
    a, b = memory.lookup(batch["ids"]), disk.lookup(batch["ids"])
    if steps:  # the first batch is not prefetched
        late += disk.storage_stats["misses"] - before
    same &= a.tobytes() == b.tobytes()
    memory.apply_gradients(batch["ids"], batch["grads"])
    disk.apply_gradients(batch["ids"], batch["grads"])
    steps += 1
same &= memory.get_embedding_tensor().tobytes() == disk.get_embedding_tensor().tobytes()
print("PREFETCH " + json.dumps({"replica": pl.replica_id(), "steps": steps, "same": bool(same),
                                "prefetched_rows": disk.storage_stats["prefetched_rows"],
                                "misses_after_wait": int(late)}), flush=True)
