"""Checkpoints at 1-4 replicas: a round trip of every kind of state (compared with the
values saved), the files and manifest read back with plain numpy/json, keep=K, async
saves, and the errors: corrupted and missing files, shape/dtype mismatches, paths that
are not checkpoints, unsupported state, a directory some replica cannot see, a failed
background save. Every error is raised on every replica and changes nothing."""

import json
import shutil

import numpy as np
import pytest

import popdist_lite as pl
from popdist_lite.checkpoint.save import SLOW_WRITE_ENV

T, E = 23, 5


def _state(strategy="TOKEN", seed=0, sharded=True):
    table = pl.create_host_embedding("t", [T, E], partition_strategy=strategy, seed=seed,
                                     optimizer_spec=pl.HostEmbeddingAdamOptimizerSpec(0.1))
    params = {"w": np.full((3, 4), float(seed), np.float32), "b": np.arange(6, dtype=np.float64) + seed}
    opt = pl.CrossReplicaOptimizer(pl.MomentumSGD(0.1, momentum=0.9), shard_optimizer_state=sharded)
    return {"step": seed, "note": {"text": f"seed {seed}"}, "table": table, "params": params, "opt": opt,
            "scaler": pl.StaticLossScaler(2.0 ** (seed + 3)), "rng": np.random.default_rng([seed, pl.replica_id()])}


def _train(state, steps=2):
    r, k = pl.num_replicas(), pl.replica_id()
    for step in range(steps):
        rng = np.random.default_rng([11, step])
        ids = rng.integers(0, T, 8)
        state["table"].apply_gradients(np.ascontiguousarray(ids[k::r]), rng.standard_normal((8, E))[k::r])
        state["opt"].step(state["params"], {n: np.ones_like(v) * (step + 1) for n, v in state["params"].items()})


def _snapshot(state):
    """Everything observable of a state, as plain numpy (collective: full tables)."""
    opt = state["opt"].optimizer
    return {"table": state["table"].get_embedding_tensor(master=True),
            "table_state": {k: v.copy() for k, v in state["table"].state().arrays.items()},
            "params": {k: v.copy() for k, v in state["params"].items()},
            "opt": {k: {s: a.copy() for s, a in slots.items()} for k, slots in opt.state.items()},
            "step": state["step"], "note": state["note"], "scale": state["scaler"].scale,
            "rng": state["rng"].bit_generator.state}


def _assert_same(a, b):
    np.testing.assert_array_equal(a["table"], b["table"])
    assert a["table_state"].keys() == b["table_state"].keys()
    for k in a["table_state"]:
        np.testing.assert_array_equal(a["table_state"][k], b["table_state"][k], err_msg=k)
    for k in a["params"]:
        np.testing.assert_array_equal(a["params"][k], b["params"][k], err_msg=k)
    assert a["opt"].keys() == b["opt"].keys()
    for k in a["opt"]:
        for s in a["opt"][k]:
            np.testing.assert_array_equal(a["opt"][k][s], b["opt"][k][s], err_msg=f"{k}/{s}")
    assert (a["step"], a["note"], a["scale"], a["rng"]) == (b["step"], b["note"], b["scale"], b["rng"])


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["TOKEN", "ENCODING"])
@pytest.mark.parametrize("sharded", [False, True])
def test_round_trip(shared, strategy, sharded):
    saved = _state(strategy, seed=1, sharded=sharded)
    _train(saved)
    want = _snapshot(saved)
    path = pl.save_checkpoint(shared, saved, step=7)
    assert path == shared / "step-00000007" and pl.latest_checkpoint(shared) == path
    fresh = _state(strategy, seed=2, sharded=sharded)
    before = _snapshot(fresh)
    with pytest.raises(AssertionError):
        _assert_same(before, want)  # the fresh state differs, so the load below is seen
    assert pl.load_checkpoint(path, fresh) is fresh
    _assert_same(_snapshot(fresh), want)
    # training goes on identically from the loaded state
    _train(saved, 1)
    _train(fresh, 1)
    _assert_same(_snapshot(fresh), _snapshot(saved))


@pytest.mark.mpi
def test_files_are_plain_numpy(shared, comm):
    state = _state()
    _train(state)
    full = state["table"].get_embedding_tensor(master=True)
    path = pl.save_checkpoint(shared, state, step=3)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["num_replicas"] == comm.size and manifest["step"] == 3
    weights = manifest["arrays"]["table/weights"]
    assert weights["shape"] == [T, E] and weights["partition"] == {"kind": "cyclic", "axis": 0}
    assert weights["writers"] == comm.size and len(weights["files"]) == comm.size
    rows = {f["replica"]: np.load(path / f["file"], allow_pickle=False) for f in weights["files"]}
    np.testing.assert_array_equal(np.stack([rows[i % comm.size][i // comm.size] for i in range(T)]), full)
    np.testing.assert_array_equal(np.load(path / "params.w.npy", allow_pickle=False), state["params"]["w"])
    assert len(manifest["arrays"]["params/w"]["files"]) == 1  # replicated: written once
    import zlib
    for record in (f for a in manifest["arrays"].values() for f in a["files"]):
        assert zlib.crc32((path / record["file"]).read_bytes()) == record["crc32"]


@pytest.mark.mpi
def test_keep_removes_old_checkpoints_after_commit(shared):
    state = _state()
    for step in (1, 2, 3, 4):
        pl.save_checkpoint(shared, state, step=step, keep=2)
    assert sorted(p.name for p in shared.iterdir()) == ["step-00000003", "step-00000004"]


@pytest.mark.mpi
def test_async_save(shared):
    state = _state()
    _train(state)
    want = _snapshot(state)
    path = pl.save_checkpoint(shared, state, step=5, blocking=False)
    _train(state, 1)  # training goes on while the background thread writes step 5
    pl.wait_checkpoint()
    assert pl.latest_checkpoint(shared) == path
    fresh = _state(seed=2)
    pl.load_checkpoint(path, fresh)
    _assert_same(_snapshot(fresh), want)


@pytest.mark.mpi
def test_async_failure_raised_on_every_replica_at_next_call(shared, comm, monkeypatch):
    state = _state()
    monkeypatch.setenv(SLOW_WRITE_ENV, "0.3")
    pl.save_checkpoint(shared, state, step=5, blocking=False)
    monkeypatch.delenv(SLOW_WRITE_ENV)
    if comm.rank == 0:  # the temporary directory vanishes while the threads write
        for tmp in shared.glob(".tmp-*"):
            while tmp.exists():  # other replicas' threads may add files while it is removed
                shutil.rmtree(tmp, ignore_errors=True)
    with pytest.raises(pl.CheckpointError, match="background save of step 5 failed"):
        pl.latest_checkpoint(shared)
    assert pl.latest_checkpoint(shared) is None  # reported once
    pl.save_checkpoint(shared, state, step=6)
    assert sorted(p.name for p in shared.iterdir()) == ["step-00000006"]


@pytest.mark.mpi
def test_corrupted_file_names_file_and_array(shared, comm):
    state = _state()
    _train(state)
    path = pl.save_checkpoint(shared, state, step=1)
    victim = sorted(path.glob("table.optimizer.m.r*.npy"))[-1]
    if comm.rank == 0:
        data = bytearray(victim.read_bytes())
        data[-3] ^= 0x40  # one flipped bit in the last row's data
        victim.write_bytes(bytes(data))
    comm.Barrier()
    fresh = _state(seed=2)
    before = _snapshot(fresh)
    with pytest.raises(pl.CheckpointError, match=rf"checksum mismatch in .*{victim.name} \(array 't?able/optimizer/m'\)"):
        pl.load_checkpoint(path, fresh)
    _assert_same(_snapshot(fresh), before)  # nothing loaded half-way


@pytest.mark.mpi
@pytest.mark.parametrize("victim_glob,array,strategy", [("params.w.npy", "params/w", "TOKEN"),
                                                         ("table.weights.r0.npy", "table/weights", "ENCODING")])
def test_corrupted_shared_read_raises_on_every_replica(shared, comm, victim_glob, array, strategy):
    """A file several replicas read (a replicated array; a TOKEN file loaded into an
    ENCODING table) is checksummed by one of them: every replica raises all the same,
    and none changes anything."""
    state = _state()
    _train(state)
    path = pl.save_checkpoint(shared, state, step=1)
    victim = path / victim_glob
    if comm.rank == 0:
        data = bytearray(victim.read_bytes())
        data[-1] ^= 0x01
        victim.write_bytes(bytes(data))
    comm.Barrier()
    fresh = _state(strategy, seed=2)
    before = _snapshot(fresh)
    with pytest.raises(pl.CheckpointError, match=rf"checksum mismatch in .*{victim.name} \(array '{array}'\)"):
        pl.load_checkpoint(path, fresh)
    _assert_same(_snapshot(fresh), before)


@pytest.mark.mpi
def test_missing_file(shared, comm):
    state = _state()
    path = pl.save_checkpoint(shared, state, step=1)
    if comm.rank == 0:
        (path / "params.b.npy").unlink()
    comm.Barrier()
    fresh = _state(seed=2)
    before = _snapshot(fresh)
    with pytest.raises(pl.CheckpointError, match=r"checkpoint file missing: .*params\.b\.npy \(array 'params/b'\)"):
        pl.load_checkpoint(path, fresh)
    _assert_same(_snapshot(fresh), before)


@pytest.mark.mpi
@pytest.mark.parametrize("change,message", [
    (lambda s: s["params"].update(w=np.zeros((4, 4), np.float32)),
     r"array 'params/w': the checkpoint holds float32\[3, 4\], the state being loaded has float32\[4, 4\]"),
    (lambda s: s["params"].update(b=np.zeros(6, np.float32)),
     r"array 'params/b': the checkpoint holds float64\[6\], the state being loaded has float32\[6\]"),
    (lambda s: s.update(table=pl.create_host_embedding("t", [T + 1, E])),
     r"table 'table' has shape \(23, 5\), the table being loaded has \(24, 5\)"),
    (lambda s: s.update(extra=np.zeros(2)), r"has no state 'extra'"),
])
def test_mismatch_raises_everywhere_and_changes_nothing(shared, change, message):
    path = pl.save_checkpoint(shared, _state(), step=1)
    fresh = _state(seed=2)
    change(fresh)
    before = {k: v.copy() for k, v in fresh["params"].items()}
    with pytest.raises(ValueError, match=message):
        pl.load_checkpoint(path, fresh)
    for k in before:
        np.testing.assert_array_equal(fresh["params"][k], before[k])
    assert fresh["step"] == 2


@pytest.mark.mpi
def test_not_a_checkpoint(shared):
    with pytest.raises(pl.CheckpointError, match="is not a checkpoint: not a directory"):
        pl.load_checkpoint(shared / "nope", _state())
    pl.save_checkpoint(shared, _state(), step=1)
    with pytest.raises(pl.CheckpointError, match=r"has no manifest.json .* it holds checkpoints \(the newest is "
                                                 r"step-00000001\): pass latest_checkpoint"):
        pl.load_checkpoint(shared, _state())


@pytest.mark.mpi
def test_unsupported_state_raises_everywhere(shared, comm):
    state = _state()
    if comm.rank == comm.size - 1:
        state["bad"] = object()
    else:
        state["bad"] = 1
    with pytest.raises(TypeError, match=rf"replica {comm.size - 1}: state 'bad': cannot save a object"):
        pl.save_checkpoint(shared, state, step=1)
    assert list(shared.iterdir()) == []


@pytest.mark.mpi
def test_directory_not_shared_raises_before_writing(tmp_path, comm):
    """Each replica passes its own directory: as the same path on hosts that do not
    share a filesystem. Every replica raises; nothing is written."""
    if comm.size == 1:
        pytest.skip("needs a second replica")
    with pytest.raises(pl.CheckpointError, match=r"replica 1: cannot see .*\.tmp-step-00000001-.*: the checkpoint "
                                                 r"directory must be on a filesystem every replica shares"):
        pl.save_checkpoint(tmp_path / "ckpt", _state(), step=1)
    assert list((tmp_path / "ckpt").iterdir()) == [] if (tmp_path / "ckpt").exists() else True


@pytest.mark.mpi
def test_directory_is_a_file(shared):
    (shared / "file").write_text("x") if pl.replica_id() == 0 else None
    with pytest.raises(pl.CheckpointError, match="replica 0 cannot create the checkpoint directory"):
        pl.save_checkpoint(shared / "file", _state(), step=1)


@pytest.mark.mpi
def test_torn_save_ignored_and_cleaned(shared, comm):
    state = _state()
    path = pl.save_checkpoint(shared, state, step=1)
    if comm.rank == 0:  # what a kill in the middle of a save leaves
        torn = shared / ".tmp-step-00000002-deadbeef"
        torn.mkdir()
        (torn / "params.w.npy").write_bytes(b"partial")
        half = shared / "step-00000003"  # a directory without a manifest is no checkpoint either
        half.mkdir()
    comm.Barrier()
    assert pl.latest_checkpoint(shared) == path
    pl.save_checkpoint(shared, state, step=4)
    names = sorted(p.name for p in shared.iterdir())
    assert ".tmp-step-00000002-deadbeef" not in names and "step-00000004" in names
