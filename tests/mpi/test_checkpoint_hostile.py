"""load_checkpoint on a hostile checkpoint directory: every attack raises CheckpointError
on every replica, quickly, and leaves every live array bit-identical (docs/security.md).

Replica 0 tampers with a checkpoint the job saved (the directory is the project's
checkout, the one filesystem the multi-host test hosts share), then every replica loads
it into a state whose snapshot is compared before and after, with numpy.
"""

import json
import os
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest

import popdist_lite as pl

T, E = 13, 4


def _state(seed: int, opt=None):
    params = {"w": np.full(3, float(seed), np.float32)}
    if opt is None:
        opt = pl.CrossReplicaOptimizer(pl.Adam(0.1))
        opt.init(params)  # slot shapes from the live parameters
    return {"table": pl.create_host_embedding("t", [T, E], seed=seed,
                                              optimizer_spec=pl.HostEmbeddingAdamOptimizerSpec(0.1)),
            "params": params, "opt": opt, "scaler": pl.DynamicLossScaler(8.0), "step": seed}


def _snapshot(state):
    return {"table": state["table"].get_embedding_tensor(master=True),
            **{f"table/{k}": v.copy() for k, v in state["table"].state().arrays.items()},
            "params/w": state["params"]["w"].copy(),
            **{f"opt/{p}/{s}": a.copy() for p, slots in state["opt"].optimizer.state.items() for s, a in slots.items()},
            "scalars": (state["scaler"].scale, state["scaler"].clean_steps, state["step"])}


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(
        a[k] == b[k] if k == "scalars" else a[k].tobytes() == b[k].tobytes() and a[k].dtype == b[k].dtype for k in a)


def _manifest(path: Path, change) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    change(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def _record(manifest: dict, array: str, replica: int = 0) -> dict:
    return next(f for f in manifest["arrays"][array]["files"] if f["replica"] == replica)


def _rehash(path: Path, array: str):
    """After replacing a file: make the manifest's size and crc32 match it again."""
    def change(manifest):
        record = _record(manifest, array)
        data = (path / record["file"]).read_bytes()
        record["bytes"], record["crc32"] = len(data), zlib.crc32(data)
    _manifest(path, change)


def parent_name(path):
    _manifest(path, lambda m: _record(m, "params/w").update(file="../params.w.npy"))


def absolute_name(path):
    _manifest(path, lambda m: _record(m, "params/w").update(file=str(path / "params.w.npy")))


def symlink(path):
    outside = path.parent / f"{path.parent.name}-outside.npy"
    shutil.copy(path / "params.w.npy", outside)
    os.unlink(path / "params.w.npy")
    os.symlink(outside, path / "params.w.npy")


def fifo(path):
    os.unlink(path / "table.weights.r0.npy")
    os.mkfifo(path / "table.weights.r0.npy")


def short_file(path):
    data = (path / "params.w.npy").read_bytes()
    (path / "params.w.npy").write_bytes(data[:-4])  # one float32 short
    _rehash(path, "params/w")


def short_partition(path):
    """Replica 0's part of the TOKEN table one row short, file and manifest consistent."""
    rows = np.load(path / "table.weights.r0.npy")
    np.save(path / "table.weights.r0.npy", rows[:-1])
    _rehash(path, "table/weights")
    _manifest(path, lambda m: _record(m, "table/weights").update(shape=list(rows[:-1].shape)))


def object_dtype_in_manifest(path):
    _manifest(path, lambda m: m["arrays"]["params/w"].update(dtype="|O"))


def object_dtype_in_file(path):
    np.save(path / "params.w.npy", np.array([1, "x", None], dtype=object), allow_pickle=True)
    _rehash(path, "params/w")


def subtree_value(path):
    def change(manifest):
        manifest["values"]["table"] = 1  # would replace the table with a number
    _manifest(path, change)


def scaler_attribute(path):
    _manifest(path, lambda m: m["values"]["scaler"].update(_comm=None))


def negative_scale(path):
    _manifest(path, lambda m: m["values"]["scaler"].update(scale=-1.0))


def value_of_another_type(path):
    _manifest(path, lambda m: m["values"].update(step={"x": 1}))


ATTACKS = [parent_name, absolute_name, symlink, fifo, short_file, short_partition, object_dtype_in_manifest, object_dtype_in_file,
           subtree_value, scaler_attribute, negative_scale, value_of_another_type]


@pytest.mark.mpi
@pytest.mark.timeout(240)  # as test_multirank.TEST_SECONDS: ample for 4 ranks on one busy core
@pytest.mark.parametrize("attack", ATTACKS, ids=[a.__name__ for a in ATTACKS])
def test_hostile_checkpoint_changes_nothing(shared, comm, attack):
    path = pl.save_checkpoint(shared, _state(seed=1), step=1)
    if comm.rank == 0:
        attack(path)
    comm.Barrier()
    live = _state(seed=2)
    before = _snapshot(live)
    with pytest.raises(pl.CheckpointError):
        pl.load_checkpoint(path, live)
    assert _same(_snapshot(live), before)


@pytest.mark.mpi
@pytest.mark.timeout(240)  # as test_multirank.TEST_SECONDS: ample for 4 ranks on one busy core
def test_slot_bomb_is_refused(shared, comm):
    """A checkpoint whose optimizer slot for a 3-element parameter has 1 Mi elements:
    the live optimizer's slots come from its parameters, so the load is refused."""
    bomb = pl.CrossReplicaOptimizer(pl.Adam(0.1))
    bomb.optimizer.state = {"w": {"m": np.zeros(1 << 20, np.float32), "v": np.zeros(1 << 20, np.float32)}}
    path = pl.save_checkpoint(shared, _state(seed=1, opt=bomb), step=1)
    live = _state(seed=2)
    before = _snapshot(live)
    with pytest.raises(pl.CheckpointError, match=r"array 'opt/state/w/m': the checkpoint holds float32\[1048576\], "
                                                 r"the state being loaded has float32\[3\]"):
        pl.load_checkpoint(path, live)
    assert _same(_snapshot(live), before)


@pytest.mark.mpi
@pytest.mark.timeout(240)  # as test_multirank.TEST_SECONDS: ample for 4 ranks on one busy core
def test_slots_loaded_into_a_fresh_optimizer_are_checked_before_its_first_step(shared, comm):
    """An optimizer without state takes the checkpoint's slots: the load compares them
    with the live parameters of the state being loaded (refused, nothing allocated or
    changed: tests/mpi/test_checkpoint_slot_shapes.py); loaded without its parameters in
    the state, its first step compares them with the parameters and refuses, changing
    nothing."""
    bomb = pl.CrossReplicaOptimizer(pl.Adam(0.1))
    bomb.optimizer.state = {"w": {"m": np.zeros(1024, np.float32), "v": np.zeros(1024, np.float32)}}
    path = pl.save_checkpoint(shared, _state(seed=1, opt=bomb), step=1)
    live = _state(seed=2, opt=pl.CrossReplicaOptimizer(pl.Adam(0.1)))
    with pytest.raises(pl.CheckpointError, match=r"slot 'w/m' is float32\[1024\], its parameter 'w' needs float32\[3\]"):
        pl.load_checkpoint(path, live)
    assert not live["opt"].optimizer.state
    pl.load_checkpoint(path, {"opt": live["opt"]})  # the parameters are not in this state
    params = {"w": live["params"]["w"].copy()}
    with pytest.raises(ValueError, match=r"state w/m: expected float32\[3\], got float32\[1024\]"):
        live["opt"].step(live["params"], {"w": np.ones(3, np.float32)})
    np.testing.assert_array_equal(live["params"]["w"], params["w"])
