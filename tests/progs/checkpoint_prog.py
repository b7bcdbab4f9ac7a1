"""Multi-rank program of the checkpoint tests (run under mpirun by test_checkpoint_*.py).

    checkpoint_prog.py save DIR OUT STRATEGY      train 4 steps, save, dump, train 3 more, dump
    checkpoint_prog.py load DIR OUT STRATEGY      load the newest checkpoint, dump, train 3 more, dump
    checkpoint_prog.py torn DIR OUT STRATEGY      save at step 4, dump, then a save at 7 that waits 600 s
                                                  after each block (the test kills a replica during it)
    checkpoint_prog.py disk DIR OUT STRATEGY      save at step 4, dump, then a save too big for the disk:
                                                  write its error, load step 4 back, dump

Training is a pure function of the global step, whatever the replica count: every
step has a global batch of B = 12 ids and gradients (from a generator seeded by the
step); replica k takes samples k, k + r, ... (12 divides evenly for r = 1, 2, 3, 4), the
tables sum every replica's rows and the dense optimizer sums the replicas' gradients.

Dumps (``OUT/<tag>.r<k>.npz``) hold each replica's local arrays as its objects keep
them; the tests assemble full arrays from them with numpy, independently of the
checkpoint code. ``OUT/<tag>.full.npz`` (replica 0) holds the full tables
(get_embedding_tensor) and dense parameters.
"""

import json
import os
import sys

import numpy as np

import popdist_lite as pl
from popdist_lite.checkpoint.save import SLOW_WRITE_ENV

T, E, B = 37, 6, 12
SAVE_AT, END = 4, 7
TABLES = {
    "adam": lambda: pl.HostEmbeddingAdamOptimizerSpec(0.05),
    "sgdga": lambda: pl.HostEmbeddingSGDGAOptimizerSpec(0.1, accumulation_factor=3),
    "rowwise": lambda: pl.HostEmbeddingAdagradOptimizerSpec(0.1, rowwise=True),
    "momentum": lambda: pl.HostEmbeddingMomentumOptimizerSpec(0.1, momentum=0.5),
}


def build(strategy: str) -> dict:
    tables = {name: pl.create_host_embedding(name, [T, E], partition_strategy=strategy, optimizer_spec=spec(),
                                             seed=3, exchange="dense" if strategy == "TOKEN" else None)
              for name, spec in TABLES.items()}
    params = {"w": np.linspace(-1, 1, 50, dtype=np.float32).reshape(5, 10), "b": np.zeros(7, np.float32)}
    return {"step": 0, "tables": tables, "params": params,
            "opt": pl.CrossReplicaOptimizer(pl.Adam(0.01), op="sum", shard_optimizer_state=True),
            "scaler": pl.DynamicLossScaler(8.0, growth_interval=3)}


def train(state: dict, first: int, last: int) -> None:
    r, k = pl.num_replicas(), pl.replica_id()
    mine = slice(k, B, r)
    for step in range(first, last):
        rng = np.random.default_rng([7, step])
        ids = rng.integers(0, T, B)
        grads = rng.standard_normal((B, E)).astype(np.float32)
        dense = {n: rng.standard_normal((B,) + v.shape).astype(np.float32) for n, v in sorted(state["params"].items())}
        for table in state["tables"].values():
            table.apply_gradients(ids[mine].copy(), grads[mine])
        state["opt"].step(state["params"], {n: d[mine].sum(axis=0) for n, d in dense.items()})
        state["scaler"].update(False)
    state["step"] = last


def dump(state: dict, out: str, tag: str) -> None:
    k = pl.replica_id()
    arrays = {}
    for name, table in state["tables"].items():
        for key, a in table.state().arrays.items():
            arrays[f"{name}/{key}"] = a
    for key, slots in state["opt"].optimizer.state.items():
        for slot, a in slots.items():
            arrays[f"opt/{key}/{slot}"] = a
    for key, a in state["params"].items():
        arrays[f"params/{key}"] = a
    np.savez(f"{out}/{tag}.r{k}.npz", **arrays)
    values = {"step": state["step"], "opt_steps": state["opt"].optimizer.steps, "scale": state["scaler"].scale,
              "clean_steps": state["scaler"].clean_steps, "replicas": pl.num_replicas(),
              "shard_sizes": state["opt"].shard_sizes}
    with open(f"{out}/{tag}.r{k}.json", "w") as f:
        json.dump(values, f)


def dump_full(state: dict, out: str, tag: str) -> None:
    full = {name: table.get_embedding_tensor(master=True) for name, table in state["tables"].items()}
    if pl.replica_id() == 0:
        np.savez(f"{out}/{tag}.full.npz", **full, **{f"params/{k}": v for k, v in state["params"].items()})


def main() -> None:
    command, directory, out, strategy = sys.argv[1:5]
    pl.init()
    state = build(strategy)
    if command in ("torn", "disk"):
        train(state, 0, SAVE_AT)
        pl.save_checkpoint(directory, state, step=SAVE_AT)
        dump(state, out, "saved")
        train(state, SAVE_AT, END)
        if command == "torn":
            with open(f"{out}/pid.r{pl.replica_id()}", "w") as f:
                f.write(str(os.getpid()))
            os.environ[SLOW_WRITE_ENV] = "600"  # it never ends by itself, however slow the test is to kill
            pl.save_checkpoint(directory, state, step=END)
            raise SystemExit("the test should have killed a replica during the save")
        state["big"] = np.ones(400_000, np.float32)  # 1.6 MB, on a 1 MiB filesystem
        try:
            pl.save_checkpoint(directory, state, step=END)
            raise SystemExit("the save on a full disk did not fail")
        except pl.CheckpointError as exc:
            with open(f"{out}/error.r{pl.replica_id()}", "w") as f:
                f.write(str(exc))
        state = build(strategy)
        pl.load_checkpoint(pl.latest_checkpoint(directory), state)
        dump(state, out, "loaded")
        return
    if command == "save":
        train(state, 0, SAVE_AT)
        pl.save_checkpoint(directory, state, step=SAVE_AT)
        dump(state, out, "saved")
    else:
        pl.load_checkpoint(pl.latest_checkpoint(directory), state)
        assert state["step"] == SAVE_AT, state["step"]
        dump(state, out, "loaded")
    train(state, SAVE_AT, END)
    dump_full(state, out, "continued")


if __name__ == "__main__":
    main()
