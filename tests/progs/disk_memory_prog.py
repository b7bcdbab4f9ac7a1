"""Multi-rank program of tests/test_disk_memory.py: train one Adam table, in memory or
on disk, and write the SHA-256 of each of this replica's state arrays.

    disk_memory_prog.py memory OUT ROWS COLS                  the in-memory table
    disk_memory_prog.py disk OUT ROWS COLS CACHE_BYTES DIR [CGROUP]
                                        a DiskStorage table, its file in DIR; with CGROUP
                                        (a v1 memory cgroup's directory), replica 0 resets its
                                        memory.max_usage_in_bytes once both replicas created
                                        the table, and reads it and memory.failcnt once both
                                        have trained (before the final read)

Training is a pure function of the step: every step, each replica looks up and updates
``IDS`` IDs, half Zipf(1.1) (hot rows) and half uniform (so the steps touch most of the
table, far more rows than the cache holds), drawn from a generator seeded by (step,
replica). ``OUT/<storage>.r<k>.json`` holds ``{array name: sha256 hex}`` of the replica's
``table.state().arrays`` (weights and Adam's state), hashed in chunks of ``CHUNK`` rows so
that a disk table's memory maps are never copied whole into RAM, and the SHA-256 of
every step's lookup (and, with CGROUP, ``"trained": {"max_usage": bytes, "failcnt": n}``).
"""

import hashlib
import json
import sys

import numpy as np
from mpi4py import MPI

import popdist_lite as pl

STEPS, IDS, CHUNK = 12, 2048, 1024


def digest(array) -> str:
    h = hashlib.sha256()
    for first in range(0, array.shape[0], CHUNK):
        h.update(np.ascontiguousarray(array[first:first + CHUNK]).tobytes())
    return h.hexdigest()


def main() -> None:
    storage_name, out, rows, cols = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    pl.init()
    storage = (pl.DiskStorage(int(sys.argv[5]), cache_policy="lru", directory=sys.argv[6])
               if storage_name == "disk" else None)
    spec = pl.HostEmbeddingAdamOptimizerSpec(0.01, beta1=0.9, beta2=0.99, epsilon=1e-8)
    table = pl.create_host_embedding("big", [rows, cols], optimizer_spec=spec, seed=5,
                                     partition_strategy="TOKEN", storage=storage)
    k = pl.replica_id()
    if len(sys.argv) > 7:
        MPI.COMM_WORLD.Barrier()
        if k == 0:
            with open(f"{sys.argv[7]}/memory.max_usage_in_bytes", "w") as f:
                f.write("0")
        MPI.COMM_WORLD.Barrier()
    lookups = hashlib.sha256()
    for step in range(STEPS):
        rng = np.random.default_rng([step, k])
        ids = np.minimum(rng.zipf(1.1, size=IDS) - 1, rows - 1)
        ids[::2] = rng.integers(0, rows, size=IDS)[::2]
        grads = rng.standard_normal((IDS, cols)).astype(np.float32)
        lookups.update(table.lookup(ids).tobytes())
        table.apply_gradients(ids, grads)
    trained = None
    if len(sys.argv) > 7:
        MPI.COMM_WORLD.Barrier()
        if k == 0:
            with open(f"{sys.argv[7]}/memory.max_usage_in_bytes") as f, open(f"{sys.argv[7]}/memory.failcnt") as g:
                trained = {"max_usage": int(f.read()), "failcnt": int(g.read())}
    result = {name: digest(a) for name, a in sorted(table.state().arrays.items())}
    result["lookups"] = lookups.hexdigest()
    if storage is not None:
        result["storage_stats"] = table.storage_stats
    if trained is not None:
        result["trained"] = trained
    with open(f"{out}/{storage_name}.r{k}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
