"""Feed-position program of tests/test_checkpoint_feed.py, under poprun-lite.

    checkpoint_feed_prog.py save|load CKPT OUT STEPS VARIANT

The dataset is one global sequence of batches ``g = 0, 1, 2, ...`` sharded as
``tf.data``'s ``shard``: shard ``i`` of ``n`` yields ``i, i + n, ...`` (VARIANT ``start``:
its ``make_dataset`` takes ``start=`` and jumps there; VARIANT ``offset``: it takes
``offset=P`` and yields ``P + i, P + i + n, ...``, the exact contract). Each replica takes STEPS batches
(after loading the checkpoint with ``load``; saving one after them with ``save``) and
replica 0 writes every replica's batch numbers to OUT as JSON.
"""

import json
import sys

import numpy as np

import popdist_lite as pl

N = 10_000


def make_dataset(shard, shards):
    for g in range(shard, N, shards):
        yield {"g": np.array([g])}


def make_dataset_start(shard, shards, start=0):
    for g in range(shard + start * shards, N, shards):
        yield {"g": np.array([g])}


def make_dataset_offset(shard, shards, offset=0):
    for g in range(offset + shard, N, shards):
        yield {"g": np.array([g])}


DATASETS = {"iterate": make_dataset, "start": make_dataset_start, "offset": make_dataset_offset}


def main():
    command, ckpt, out, steps, variant = sys.argv[1:6]
    pl.init()
    feed = pl.infeed(DATASETS[variant])
    state = {"feed": feed}
    if command == "load":
        pl.load_checkpoint(pl.latest_checkpoint(ckpt), state)
    taken = [int(next(feed)["g"][0]) for _ in range(int(steps))]
    if command == "save":
        pl.save_checkpoint(ckpt, state, step=int(steps))
    everyone = pl.replica_comm().gather(taken, root=0)
    if pl.replica_id() == 0:
        with open(out, "w") as f:
            json.dump(everyone, f)


if __name__ == "__main__":
    main()
