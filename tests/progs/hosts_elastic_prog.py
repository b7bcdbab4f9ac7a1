"""The elastic job of tests/multihost/test_hosts_elastic.py: a
tiny model trained for one epoch of numbered samples, with the global batch kept fixed
at any replica count by gradient accumulation, resumable at any replica count, stopping
at a step boundary when the launcher asks for a resize.

    python tests/progs/hosts_elastic_prog.py CKPT --samples N --batch B --global-batch G [--hold A:S ...]

Samples are numbered 0..N-1; global batch ``g`` (of the feed's global sequence) holds
samples ``g*B .. g*B + B-1`` and the dataset takes ``offset=``, so the feed resumes
exactly at its global position (popdist_lite.infeed.position). A step at R replicas
takes ``M = G / (R*B)`` micro-batches per replica: G samples per step, N / G steps.

Model: a TOKEN host embedding ``table`` [N, 4] (row i: sample i's features, trained by
Adam), dense weights ``w`` [4] (momentum SGD across replicas), prediction ``table[i] @ w``
against the target ``sin(i)``, squared error averaged over the global batch; and a
second table ``seen`` [N, 1] that counts every sample's consumption (SGD, learning rate
1, gradient -1: exact in float32). Both updates follow the gradient of the global
batch's mean loss whatever R is, so a run at any replica count does the same math.

Every replica prints, per step, ``TOOK attempt step replica id id ...`` (the samples it
took); replica 0 prints ``RESUMED step replicas`` after loading a checkpoint,
``STOPPED step`` when it stopped for a resize and ``DONE steps`` at the end of the
epoch. A checkpoint is saved every 10 steps (keep 100) and at the end.

``--hold A:S`` (repeatable): in attempt A (``POPDIST_LITE_RESTART_COUNT``), after step
S (the step of its TOOK lines), the replicas wait at that step boundary until the
launcher asks for a resize, or until the attempt is torn down (a host lost), so that a
test meets the job at a known step however fast the steps run. They give up after
HOLD_POLLS polls (an error on every replica).

``--busy A:S`` (repeatable): in attempt A, after step S, replica 0 prints ``BUSY step``
and every replica stays in that step, not at a boundary (it never asks
``should_checkpoint()``), for HOLD_POLLS polls of its clock: a job that a signal cannot
checkpoint in time (tests/slurm/test_slurm_preempt.py ends it).
"""

import argparse
import os
import sys
import time

import numpy as np

import popdist_lite as pl

parser = argparse.ArgumentParser()
parser.add_argument("ckpt")
parser.add_argument("--samples", type=int, required=True)
parser.add_argument("--batch", type=int, required=True)
parser.add_argument("--global-batch", type=int, required=True)
parser.add_argument("--hold", action="append", default=[], metavar="A:S", help="see above")
parser.add_argument("--busy", action="append", default=[], metavar="A:S", help="see above")
parser.add_argument("--every", type=int, default=10)
args = parser.parse_args()
HOLD_POLLS, HOLD_POLL_SECONDS = 6000, 0.05  # a count, not a clock: every replica gives up at the same call


def make_dataset(shard_index, num_shards, offset=0):
    """Global batch g = samples g*B .. g*B+B-1; shard i of n from position offset."""
    for g in range(offset + shard_index, args.samples // args.batch, num_shards):
        yield {"ids": np.arange(g * args.batch, (g + 1) * args.batch, dtype=np.int64)}


pl.init()
feed = pl.infeed(make_dataset)
r, replicas = pl.replica_id(), pl.num_replicas()
attempt = int(os.environ.get("POPDIST_LITE_RESTART_COUNT", "0"))
micro, rest = divmod(args.global_batch, replicas * args.batch)
if rest or micro < 1:
    raise SystemExit(f"--global-batch {args.global_batch} is not a multiple of {replicas} replicas x "
                     f"batch {args.batch}")
steps = args.samples // args.global_batch

table = pl.create_host_embedding("table", shape=[args.samples, 4], partition_strategy="TOKEN",
                                 optimizer_spec=pl.HostEmbeddingAdamOptimizerSpec(0.01), seed=1)
seen = pl.create_host_embedding("seen", shape=[args.samples, 1], partition_strategy="TOKEN",
                                optimizer_spec=pl.HostEmbeddingOptimizerSpec(1.0),
                                initializer=lambda shape, dtype: np.zeros(shape, dtype))
params = {"w": np.linspace(0.5, 1.0, 4).astype(np.float32)}
optimizer = pl.CrossReplicaOptimizer(pl.MomentumSGD(0.05, momentum=0.9))
optimizer.init(params)
state = {"step": 0, "params": params, "optimizer": optimizer, "table": table, "seen": seen, "feed": feed}
latest = pl.latest_checkpoint(args.ckpt)
if latest is not None:
    pl.load_checkpoint(latest, state)
    if r == 0:
        print(f"RESUMED {state['step']} {replicas}", flush=True)

with table.register(), seen.register():
    for step in range(state["step"], steps):
        ids = np.concatenate([next(feed)["ids"] for _ in range(micro)])
        print(f"TOOK {attempt} {step} {r} " + " ".join(map(str, ids)), flush=True)
        rows = table.lookup(ids)                                   # (M*B, 4)
        err = rows @ params["w"] - np.sin(ids).astype(np.float32)  # (M*B,)
        # gradients of the global batch's mean squared error (G samples in all)
        grad_w = 2.0 * (err @ rows) / (micro * args.batch)         # this replica's mean; averaged over R
        d_rows = (2.0 / args.global_batch) * err[:, None] * params["w"][None, :]
        table.apply_gradients(ids, d_rows.astype(np.float32))      # summed over replicas
        seen.apply_gradients(ids, -np.ones((len(ids), 1), np.float32))
        optimizer.step(params, {"w": grad_w.astype(np.float32)})
        done = step + 1
        if f"{attempt}:{step}" in args.busy:
            if r == 0:
                print(f"BUSY {step}", flush=True)
            for _ in range(HOLD_POLLS):
                time.sleep(HOLD_POLL_SECONDS)
        if f"{attempt}:{step}" in args.hold:
            for _ in range(HOLD_POLLS):
                if pl.should_checkpoint():
                    break
                time.sleep(HOLD_POLL_SECONDS)
            else:
                raise SystemExit(f"--hold {attempt}:{step}: no resize asked after {HOLD_POLLS} polls")
        if pl.should_checkpoint():
            state["step"] = done
            pl.save_checkpoint(args.ckpt, state, step=done, keep=100)
            if r == 0:
                print(f"STOPPED {done}", flush=True)
            sys.exit(0)
        if done % args.every == 0 or done == steps:
            state["step"] = done
            pl.save_checkpoint(args.ckpt, state, step=done, keep=100)
if r == 0:
    print(f"DONE {steps}", flush=True)
