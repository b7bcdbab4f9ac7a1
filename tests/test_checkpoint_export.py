"""``python -m popdist_lite.checkpoint export`` checks every source file (size, header,
crc32) before it creates its output, and leaves no partial output when it fails: a
manifest claiming a 1 TiB array whose file is missing leaves nothing behind (the output
used to be created at the claimed size first), a corrupted source leaves an existing
output as it was. The reference is the directory listing and the bytes of the files."""

import json
import subprocess
import sys

import numpy as np
import pytest

from helpers import ROOT, run_python


@pytest.fixture
def checkpoint(tmp_path):
    """A checkpoint of one replicated array ``w`` (12 float32) and a 3x4 table."""
    code = (f"import numpy as np, popdist_lite as pl\npl.init()\n"
            f"pl.save_checkpoint({str(tmp_path / 'ckpt')!r}, {{'w': np.arange(12, dtype=np.float32), "
            f"'t': pl.create_host_embedding('t', [3, 4], seed=1)}}, step=1)\n")
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    return tmp_path / "ckpt" / "step-00000001"


def _export(path, name, out) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "popdist_lite.checkpoint", "export", str(path), name, str(out)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def _manifest(path, change) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    change(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_export_of_a_huge_claim_with_a_missing_file_leaves_no_output(checkpoint, tmp_path):
    n = 2 ** 40  # 1 TiB of uint8

    def claim(manifest):
        manifest["arrays"]["huge"] = {"shape": [n], "dtype": "|u1", "partition": {"kind": "replicated"},
                                      "writers": 1, "files": [{"file": "huge.npy", "replica": 0, "shape": [n],
                                                               "bytes": 128 + n, "crc32": 0}]}
        manifest["objects"]["huge"] = {"type": "ndarray"}
    _manifest(checkpoint, claim)
    out = tmp_path / "out" / "huge.npy"
    out.parent.mkdir()
    result = _export(checkpoint, "huge", out)
    assert result.returncode == 1 and "checkpoint file missing" in result.stderr, result.stderr
    assert list(out.parent.iterdir()) == []


def test_export_of_a_corrupted_source_keeps_the_existing_output(checkpoint, tmp_path):
    out = tmp_path / "w.npy"
    out.write_bytes(b"earlier output")
    victim = checkpoint / "w.npy"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    result = _export(checkpoint, "w", out)
    assert result.returncode == 1 and f"checksum mismatch in {victim}" in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "w.npy"]
    assert out.read_bytes() == b"earlier output"


def test_export_writes_the_array(checkpoint, tmp_path):
    out = tmp_path / "w.npy"
    result = _export(checkpoint, "w", out)
    assert result.returncode == 0, result.stderr
    np.testing.assert_array_equal(np.load(out, allow_pickle=False), np.arange(12, dtype=np.float32))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "w.npy"]


@pytest.mark.parametrize("command", [[], ["inspect"], ["export"]])
def test_help_is_plain_text(command, capsys):
    """``--help`` is argparse's plain text: no reStructuredText markup from a docstring."""
    from popdist_lite.checkpoint.__main__ import main
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith("usage: python -m popdist_lite.checkpoint")
    assert "DIR" in out and "``" not in out and "::" not in out and ":func:" not in out, out
