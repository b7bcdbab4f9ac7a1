"""Resharding: a checkpoint saved at 2 replicas loads at 1, 3 and 4 and into the other
partition strategy with every table, optimizer slot (Adam's per-row step counter
included), dense optimizer shard and value equal to the saved ones; training continued
from it matches training continued at 2 replicas (tests/checkpoint_prog.py).

Full arrays are assembled here with numpy from each replica's own arrays, by the
partition rules (TOKEN row i on replica i % r at local row i // r; ENCODING columns
[k*c, (k+1)*c)), not by the checkpoint code."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpirun import ROOT, run_mpi

PROG = str(Path(__file__).parent / "checkpoint_prog.py")
T, E, DENSE = 37, 6, 57  # checkpoint_prog's table shape and number of dense parameter elements


def _run(ranks: int, *args) -> None:
    try:
        r = run_mpi(ranks, [sys.executable, PROG, *map(str, args)], timeout=120)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"checkpoint_prog {args} on {ranks} ranks hung:\n{e.stdout!r}")
    assert r.returncode == 0, f"{args} on {ranks} ranks:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"


def _assemble(out: Path, tag: str, replicas: int, strategy: str) -> tuple[dict, dict]:
    """Full arrays (and values) from every replica's dump."""
    parts = [np.load(out / f"{tag}.r{k}.npz", allow_pickle=False) for k in range(replicas)]
    values = [json.loads((out / f"{tag}.r{k}.json").read_text()) for k in range(replicas)]
    full = {}
    for name in parts[0].files:
        locals_ = [p[name] for p in parts]
        if name.startswith("opt/"):  # replicated tensor sharding: flat blocks of ceil(n/r)
            full[name] = np.concatenate(locals_)[:DENSE]
        elif name.startswith("params/") or name.endswith("/calls") or (strategy == "ENCODING" and locals_[0].ndim == 1):
            for other in locals_[1:]:
                np.testing.assert_array_equal(other, locals_[0], err_msg=f"{name} differs between replicas")
            full[name] = locals_[0]
        elif strategy == "TOKEN":
            rows = np.arange(T)
            full[name] = np.stack([locals_[i % replicas][i // replicas] for i in rows])
        else:
            c = -(-E // replicas)
            full[name] = np.stack([locals_[j // c][:, j % c] for j in range(E)], axis=1)
    for v in values[1:]:
        assert {k: x for k, x in v.items()} == values[0], "values differ between replicas"
    return full, values[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints written at 2 replicas with each strategy: (dir, out) per strategy."""
    found = {}
    for strategy in ("TOKEN", "ENCODING"):
        base = tmp_path_factory.mktemp(f"saved-{strategy}")
        _run(2, "save", base / "ckpt", base, strategy)
        found[strategy] = base
    return found


@pytest.mark.parametrize("source,ranks,target", [("TOKEN", 1, "TOKEN"), ("TOKEN", 3, "TOKEN"), ("TOKEN", 4, "TOKEN"),
                                                 ("TOKEN", 2, "ENCODING"), ("ENCODING", 3, "TOKEN"),
                                                 ("ENCODING", 1, "ENCODING")])
def test_reshard(saved, tmp_path, source, ranks, target):
    base = saved[source]
    _run(ranks, "load", base / "ckpt", tmp_path, target)
    want, want_values = _assemble(base, "saved", 2, source)
    got, got_values = _assemble(tmp_path, "loaded", ranks, target)
    assert sorted(got) == sorted(want)
    assert want["adam/optimizer/steps"].max() > 1  # the step counters are not trivially zero
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    for key in ("step", "opt_steps", "scale", "clean_steps", "shard_sizes"):
        assert got_values[key] == want_values[key], key
    assert got_values["replicas"] == ranks
    # training continued from the resharded checkpoint = training continued at 2 replicas
    a = np.load(base / "continued.full.npz", allow_pickle=False)
    b = np.load(tmp_path / "continued.full.npz", allow_pickle=False)
    assert sorted(a.files) == sorted(b.files)
    for name in a.files:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-6, err_msg=name)
        assert not np.array_equal(a[name], want.get(f"{name}/weights", want.get(name))), f"{name} did not train"


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "popdist_lite.checkpoint", *map(str, args)], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)


@pytest.mark.parametrize("strategy", ["TOKEN", "ENCODING"])
def test_cli_inspect_and_export(saved, tmp_path, strategy):
    base = saved[strategy]
    want, _ = _assemble(base, "saved", 2, strategy)
    r = _cli("inspect", base / "ckpt", "--verify")
    assert r.returncode == 0, r.stderr
    assert "step 4, written by 2 replica(s)" in r.stdout and "every file's crc32 matches" in r.stdout
    assert re.search(rf"^tables/adam/weights +{T}x{E} +float32 ", r.stdout, re.M), r.stdout
    for name in ("adam/weights", "adam/optimizer/steps", "sgdga/optimizer/calls", "shard:float32/m"):
        saved_name = f"opt/state/{name}" if name.startswith("shard") else f"tables/{name}"
        r = _cli("export", base / "ckpt", saved_name, tmp_path / "out.npy")
        assert r.returncode == 0, r.stderr
        np.testing.assert_array_equal(np.load(tmp_path / "out.npy", allow_pickle=False),
                                      want[f"opt/{name}" if name.startswith("shard") else name], err_msg=name)
    r = _cli("export", base / "ckpt", "nope", tmp_path / "out.npy")
    assert r.returncode == 1 and "has no array 'nope'" in r.stderr


def test_cli_reports_corruption(saved, tmp_path):
    import shutil
    copy = tmp_path / "ckpt"
    shutil.copytree(saved["TOKEN"] / "ckpt", copy)
    victim = copy / "step-00000004" / "tables.adam.weights.r1.npy"
    data = bytearray(victim.read_bytes())
    data[200] ^= 1
    victim.write_bytes(bytes(data))
    r = _cli("inspect", copy, "--verify")
    assert r.returncode == 1 and f"checksum mismatch in {victim} (array 'tables/adam/weights')" in r.stderr, r.stderr
