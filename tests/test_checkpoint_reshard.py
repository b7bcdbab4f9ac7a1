"""Resharding: a checkpoint saved at 2 replicas loads at 1, 3 and 4 and into the other
partition strategy with every table, optimizer slot (Adam's per-row step counter
included), dense optimizer shard and value equal to the saved ones; training continued
from it matches training continued at 2 replicas (tests/progs/checkpoint_prog.py).

Full arrays are assembled here with numpy from each replica's own arrays, by the
partition rules (TOKEN row i on replica i % r at local row i // r; ENCODING columns
[k*c, (k+1)*c)), not by the checkpoint code."""

import re
import subprocess
import sys

import numpy as np
import pytest

from helpers import (CHECKPOINT_DENSE, CHECKPOINT_E, CHECKPOINT_T, JOB_SECONDS, ROOT, assemble_dumps,
                     run_checkpoint_prog, timeout_for)

T, E, DENSE = CHECKPOINT_T, CHECKPOINT_E, CHECKPOINT_DENSE
pytestmark = timeout_for(3)  # the module's two saves and a load


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints written at 2 replicas with each strategy: (dir, out) per strategy."""
    found = {}
    for strategy in ("TOKEN", "ENCODING"):
        base = tmp_path_factory.mktemp(f"saved-{strategy}")
        run_checkpoint_prog(2, "save", base / "ckpt", base, strategy)
        found[strategy] = base
    return found


@pytest.mark.parametrize("source,ranks,target", [("TOKEN", 1, "TOKEN"), ("TOKEN", 3, "TOKEN"), ("TOKEN", 4, "TOKEN"),
                                                 ("TOKEN", 2, "ENCODING"), ("ENCODING", 3, "TOKEN"),
                                                 ("ENCODING", 1, "ENCODING")])
def test_reshard(saved, tmp_path, source, ranks, target):
    base = saved[source]
    run_checkpoint_prog(ranks, "load", base / "ckpt", tmp_path, target)
    want, want_values = assemble_dumps(base, "saved", 2, source)
    got, got_values = assemble_dumps(tmp_path, "loaded", ranks, target)
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
                          text=True, timeout=JOB_SECONDS, cwd=ROOT)


@pytest.mark.parametrize("strategy", ["TOKEN", "ENCODING"])
def test_cli_inspect_and_export(saved, tmp_path, strategy):
    base = saved[strategy]
    want, _ = assemble_dumps(base, "saved", 2, strategy)
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
