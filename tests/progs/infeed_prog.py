"""A program for the infeed tests, run on every rank by poprun-lite or mpirun.

    python tests/progs/infeed_prog.py N [--depth D] [--log DIR [--patient]]
           [--fail-at REPLICA:FEEDER:BATCH] [--kill-at REPLICA:FEEDER:BATCH]
           [--exit-at REPLICA:FEEDER:BATCH] [--mixed]

The dataset has N batches of known items: batch b is ``{"item": int64 [4b..4b+3],
"b": float32 (2, 3) filled with b}``; ``make_dataset(i, n)`` yields batches i, i+n, ...
Each replica prints ``GOT {"replica": r, "items": [...], "steps": s}``. With --log,
dataset (feeder or thread) and replica write timestamped events for the prefetch test:
``sent-R-F-PID`` one line per batch handed over, ``released-R`` one per batch released.
With --patient (one replica), the replica releases a batch only once the feed has run
ahead by the whole depth (D batches sent and not yet released, or the end of the data),
seen in those files; it gives up with an error after PATIENCE_SECONDS.
"""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

import popdist_lite as pl

parser = argparse.ArgumentParser()
parser.add_argument("n", type=int)
parser.add_argument("--depth", type=int, default=3)
parser.add_argument("--log")
parser.add_argument("--patient", action="store_true", help="see above (needs --log and one replica)")
parser.add_argument("--fail-at")
parser.add_argument("--kill-at")
parser.add_argument("--exit-at", help="make_dataset calls sys.exit(0) there")
parser.add_argument("--mixed", action="store_true", help="feeder 1 yields float64 items")
args = parser.parse_args()

PATIENCE_SECONDS = 120.0

pl.init()
me = (pl.replica_id(), pl.feeder_index() if pl.role() == "feeder" else 0)


def at(spec):
    return spec and tuple(int(x) for x in spec.split(":"))


def make_dataset(shard_index, num_shards):
    log = open(os.path.join(args.log, f"sent-{pl.replica_id()}-{me[1]}-{os.getpid()}"), "w") \
        if args.log else None
    for count, b in enumerate(range(shard_index, args.n, num_shards)):
        if at(args.fail_at) == (*me, count):
            raise RuntimeError(f"dataset failure in shard {shard_index} at batch {b}")
        if at(args.exit_at) == (*me, count):
            sys.exit(0)
        if at(args.kill_at) == (*me, count):
            print("feeder about to be killed", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        dtype = np.float64 if args.mixed and me[1] == 1 else np.int64
        yield {"item": np.arange(4 * b, 4 * b + 4, dtype=dtype), "b": np.full((2, 3), b, np.float32)}
        if log:  # resumed: batch b has been handed over (sent / queued)
            log.write(f"{time.monotonic()}\n")
            log.flush()


def wait_until_sent(count):
    """Until the feed's sent-* files of this replica hold ``count`` events."""
    deadline = time.monotonic() + PATIENCE_SECONDS
    while sum(p.read_text().count("\n") for p in Path(args.log).glob(f"sent-{pl.replica_id()}-*")) < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"--patient: the feed did not send {count} batches within {PATIENCE_SECONDS} s")
        time.sleep(0.01)


feed = pl.infeed(make_dataset, prefetch_depth=args.depth)
assert pl.role() == "replica", "a feeder must not return from infeed"
if args.patient and (not args.log or pl.num_replicas() != 1):
    raise SystemExit("--patient needs --log and one replica")
log = open(os.path.join(args.log, f"released-{pl.replica_id()}"), "w") if args.log else None
items = []
it = iter(feed)
while True:
    if log and items:  # asking for the next batch releases the previous one
        if args.patient:  # batches 0 .. released + depth - 1 sent
            released = len(items) // 4 - 1
            wait_until_sent(min(args.n, released + args.depth))
        log.write(f"{time.monotonic()}\n")
        log.flush()
    try:
        batch = next(it)
    except StopIteration:
        break
    b = int(batch["item"][0]) // 4
    assert batch["b"].shape == (2, 3) and batch["b"].dtype == np.float32 and np.all(batch["b"] == b)
    items.extend(int(x) for x in batch["item"])
print("GOT " + json.dumps({"replica": pl.replica_id(), "items": items, "steps": feed.steps}), flush=True)
