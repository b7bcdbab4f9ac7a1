"""A load is all or nothing, on every replica, for every kind of state (numpy, torch,
JAX): a checkpoint that one replica's objects cannot take (a generator state that only
names its bit generator, a torch optimizer slot in big-endian bytes) raises on every
replica and leaves every live array and value bit-identical; a manifest's claims of
arrays (an optimizer's slots before it has any) cost no memory before files back them;
an object that fails while loading (its own error, not the input's) makes the load
raise on every replica.

Replica 0 tampers with a checkpoint the job saved; the last replica is the one whose
entries are bad where a test says so. The reference is a copy of every array and value
of the live state taken before the load (compared byte for byte after it).
"""

import json
import resource
import zlib
from pathlib import Path

import numpy as np
import pytest

import popdist_lite as pl
from popdist_lite.checkpoint.format import file_name

BAD_PCG64 = {"bit_generator": "PCG64", "state": "x"}  # names the bit generator, holds no state


def _manifest(path: Path, change) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    change(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def _tamper(comm, path: Path, change) -> None:
    if comm.rank == 0:
        _manifest(path, change)
    comm.Barrier()


def _bad_replica_value(name: str, value, comm):
    """The manifest change: the last replica's saved ``name`` becomes ``value``."""
    def change(manifest):
        manifest["replica_values"][comm.size - 1][name] = value
    return change


def _frozen(value):
    """A comparable copy: arrays as (dtype, shape, bytes), containers walked."""
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, dict):
        return {k: _frozen(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_frozen(v) for v in value]
    return value


# -- numpy ----------------------------------------------------------------------------------
def _numpy_state(comm, seed: int) -> dict:
    params = {"w": np.arange(4, dtype=np.float32) + seed, "b": np.full(2, seed, np.float64)}
    opt = pl.CrossReplicaOptimizer(pl.Adam(0.1), stochastic_rounding="ON", seed=seed)
    opt.init(params)
    return {"params": params, "opt": opt, "step": seed, "rng": np.random.default_rng(100 * seed + comm.rank),
            "table": pl.create_host_embedding("t", [7, 3], seed=seed,
                                              optimizer_spec=pl.HostEmbeddingAdamOptimizerSpec(0.1))}


def _numpy_snapshot(state) -> dict:
    opt, table = state["opt"], state["table"]
    return _frozen({"params": state["params"], "opt/state": opt.optimizer.state, "opt/steps": opt.optimizer.steps,
                    "opt/generators": opt.stochastic_rounding.generator_states(), "step": state["step"],
                    "rng": state["rng"].bit_generator.state, "table": table.state().arrays,
                    "table/generators": table.stochastic_rounding.generator_states()})


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("entry", ["rng", "opt/generators/per_replica", "t/generators/per_replica"])
def test_bad_generator_state_on_one_replica_changes_nothing_anywhere(shared, comm, entry):
    """Only the bit generator's name used to be checked: the last replica's generator
    raised TypeError in load_state_dict, after the arrays were copied, while the others
    returned (the replicas diverged)."""
    saved = _numpy_state(comm, seed=1)
    saved["opt"].step(saved["params"], {"w": np.ones(4, np.float32), "b": np.ones(2)})
    path = pl.save_checkpoint(shared, saved, step=1)
    name = {"t/generators/per_replica": "table/generators/per_replica"}.get(entry, entry)
    _tamper(comm, path, _bad_replica_value(name, BAD_PCG64, comm))
    live = _numpy_state(comm, seed=2)
    before = _numpy_snapshot(live)
    with pytest.raises(pl.CheckpointError, match=rf"replica {comm.size - 1}: .*not a valid PCG64 state"):
        pl.load_checkpoint(path, live)
    assert _numpy_snapshot(live) == before


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_claims_without_files_allocate_nothing(shared, comm):
    """Eight claimed optimizer slots of 2**31 float32 (8 GiB each) with no files behind
    them: refused as missing files, having allocated nothing for them. The address space
    is limited to 1 GiB above its current size during the load, so a load that allocates
    a claim before checking its file fails with MemoryError instead (quickly, touching
    nothing)."""
    params = {"w": np.ones(4, np.float32)}
    path = pl.save_checkpoint(shared, {"params": params, "opt": pl.CrossReplicaOptimizer(pl.Adam(0.1))}, step=1)
    n = 2 ** 31

    def claim(manifest):
        for i in range(4):
            for slot in ("m", "v"):
                name = f"opt/state/w{i}/{slot}"
                manifest["arrays"][name] = {
                    "shape": [n], "dtype": "<f4", "partition": {"kind": "replicated"}, "writers": comm.size,
                    "files": [{"file": file_name(name, None), "replica": 0, "shape": [n], "bytes": 128 + 4 * n,
                               "crc32": 0}]}
    _tamper(comm, path, claim)
    live = {"params": {"w": np.zeros(4, np.float32)}, "opt": pl.CrossReplicaOptimizer(pl.Adam(0.1))}
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm("VmSize") + (1 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    try:
        with pytest.raises(pl.CheckpointError, match=r"checkpoint file missing: .*opt\.state\.w0\.m\.npy"):
            pl.load_checkpoint(path, live)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert not live["opt"].optimizer.state
    np.testing.assert_array_equal(live["params"]["w"], np.zeros(4, np.float32))


class Fragile:
    """A user's object whose load_state_dict fails on one replica (its own bug)."""

    def __init__(self, fail: bool):
        self.fail, self.count = fail, 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state_dict):
        if self.fail:
            raise RuntimeError("fragile object broke")
        self.count = state_dict["count"]


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_an_objects_own_failure_while_loading_raises_on_every_replica(shared, comm):
    path = pl.save_checkpoint(shared, {"a": Fragile(False), "w": np.ones(3)}, step=1)
    live = {"a": Fragile(fail=comm.rank == comm.size - 1), "w": np.zeros(3)}
    with pytest.raises(pl.CheckpointError, match=rf"replica {comm.size - 1}: the load failed after it began changing "
                                                 r"the state, which is now partly loaded: RuntimeError: fragile"):
        pl.load_checkpoint(path, live)


# -- torch ----------------------------------------------------------------------------------
def _torch_state(comm, seed: int, trained: bool) -> dict:
    torch = pytest.importorskip("torch", reason="needs the [torch] extra")
    import popdist_lite.torch  # noqa: F401 - registers the adapters

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if trained:
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    return {"model": model, "opt": opt, "step": seed, "rng": np.random.default_rng(100 * seed + comm.rank)}


def _torch_snapshot(state) -> dict:
    sd = state["opt"].state_dict()
    return _frozen({"model": {k: v.detach().numpy().copy() for k, v in state["model"].state_dict().items()},
                    "opt/state": {k: {s: v.numpy().copy() if hasattr(v, "numpy") else v for s, v in slots.items()}
                                  for k, slots in sd["state"].items()},
                    "opt/groups": sd["param_groups"], "step": state["step"], "rng": state["rng"].bit_generator.state})


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_torch_big_endian_slot_changes_nothing(shared, comm):
    """An Adam slot rewritten as big-endian float32 passed the slot check (kind only) and
    failed in torch.from_numpy on every replica, after the model's weights were loaded
    and with the optimizer left empty."""
    path = pl.save_checkpoint(shared, _torch_state(comm, seed=1, trained=True), step=1)
    if comm.rank == 0:
        name = "opt/tensors/0/exp_avg"
        record = json.loads((path / "manifest.json").read_text())["arrays"][name]["files"][0]
        data = np.load(path / record["file"])
        np.save(path / record["file"], data.astype(">f4"))
        raw = (path / record["file"]).read_bytes()

        def change(manifest):
            manifest["arrays"][name]["dtype"] = ">f4"
            manifest["arrays"][name]["files"][0].update(bytes=len(raw), crc32=zlib.crc32(raw))
        _manifest(path, change)
    comm.Barrier()
    live = _torch_state(comm, seed=2, trained=False)
    before = _torch_snapshot(live)
    with pytest.raises(pl.CheckpointError, match=r"byte order"):
        pl.load_checkpoint(path, live)
    assert _torch_snapshot(live) == before


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_torch_bad_generator_on_one_replica_changes_nothing(shared, comm):
    path = pl.save_checkpoint(shared, _torch_state(comm, seed=1, trained=True), step=1)
    _tamper(comm, path, _bad_replica_value("rng", BAD_PCG64, comm))
    live = _torch_state(comm, seed=2, trained=True)
    before = _torch_snapshot(live)
    with pytest.raises(pl.CheckpointError, match=rf"replica {comm.size - 1}: .*not a valid PCG64 state"):
        pl.load_checkpoint(path, live)
    assert _torch_snapshot(live) == before


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_torch_claims_of_another_shape_allocate_nothing(shared, comm):
    """Claimed Adam slots of 2**31 elements for a parameter of 12: refused by the slot's
    shape before anything is allocated (the address space is limited as above)."""
    path = pl.save_checkpoint(shared, _torch_state(comm, seed=1, trained=False), step=1)
    n = 2 ** 31

    def claim(manifest):
        name = "opt/tensors/0/exp_avg"
        manifest["objects"]["opt"]["slots"] = {"0": {"exp_avg": "array"}}
        manifest["arrays"][name] = {
            "shape": [n], "dtype": "<f4", "partition": {"kind": "replicated"}, "writers": comm.size,
            "files": [{"file": file_name(name, None), "replica": 0, "shape": [n], "bytes": 128 + 4 * n, "crc32": 0}]}
    _tamper(comm, path, claim)
    live = _torch_state(comm, seed=2, trained=False)
    before = _torch_snapshot(live)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm("VmSize") + (1 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    try:
        with pytest.raises(pl.CheckpointError, match=r"parameter 0 has shape \[3, 4\]"):
            pl.load_checkpoint(path, live)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert _torch_snapshot(live) == before


# -- JAX ------------------------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_jax_bad_generator_on_one_replica_changes_nothing(shared, comm):
    jax = pytest.importorskip("jax", reason="needs the [jax] extra")
    from popdist_lite.jax import PytreeState

    def state(seed):
        tree = {"w": jax.numpy.arange(3.0) + seed, "table": np.full((2, 2), seed, np.float32), "n": seed}
        return {"dense": PytreeState(tree), "step": seed, "rng": np.random.default_rng(100 * seed + comm.rank)}

    path = pl.save_checkpoint(shared, state(1), step=1)
    _tamper(comm, path, _bad_replica_value("rng", BAD_PCG64, comm))
    live = state(2)
    tree = live["dense"].tree
    before = _frozen({"w": np.asarray(tree["w"]), "table": tree["table"], "n": tree["n"], "step": live["step"],
                      "rng": live["rng"].bit_generator.state})
    with pytest.raises(pl.CheckpointError, match=rf"replica {comm.size - 1}: .*not a valid PCG64 state"):
        pl.load_checkpoint(path, live)
    assert live["dense"].tree is tree
    assert _frozen({"w": np.asarray(tree["w"]), "table": tree["table"], "n": tree["n"], "step": live["step"],
                    "rng": live["rng"].bit_generator.state}) == before


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_torch_bits_slot_of_another_width_changes_nothing(shared, comm):
    """A bfloat16 parameter's Adam slot saved as its bits (uint16) rewritten as uint32 of
    the same shape: viewing it as bfloat16 would double its last axis. Refused before
    anything changes, on every replica."""
    torch = pytest.importorskip("torch", reason="needs the [torch] extra")
    import popdist_lite.torch  # noqa: F401 - registers the adapters

    def state(seed, trained):
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 3).to(torch.bfloat16)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        if trained:
            model(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()
            opt.step()
        return {"model": model, "opt": opt, "step": seed, "rng": np.random.default_rng(seed)}

    path = pl.save_checkpoint(shared, state(1, trained=True), step=1)
    if comm.rank == 0:
        name = "opt/tensors/0/exp_avg"
        manifest = json.loads((path / "manifest.json").read_text())
        assert manifest["objects"]["opt"]["slots"]["0"]["exp_avg"] == "bits:bfloat16"
        record = manifest["arrays"][name]["files"][0]
        np.save(path / record["file"], np.load(path / record["file"]).astype(np.uint32))
        raw = (path / record["file"]).read_bytes()

        def change(manifest):
            manifest["arrays"][name]["dtype"] = "<u4"
            manifest["arrays"][name]["files"][0].update(bytes=len(raw), crc32=zlib.crc32(raw))
        _manifest(path, change)
    comm.Barrier()
    live = state(2, trained=False)
    before = _frozen({"model": {k: v.view(torch.int16).numpy().copy() for k, v in live["model"].state_dict().items()},
                      "opt": repr(live["opt"].state_dict()), "rng": live["rng"].bit_generator.state})
    with pytest.raises(pl.CheckpointError, match=r"the bits of a bfloat16 are uint16, the checkpoint holds uint32"):
        pl.load_checkpoint(path, live)
    assert _frozen({"model": {k: v.view(torch.int16).numpy().copy() for k, v in live["model"].state_dict().items()},
                    "opt": repr(live["opt"].state_dict()), "rng": live["rng"].bit_generator.state}) == before
