"""The job's key cannot be read by the program (issue 28): a program
(tests/progs/key_hunt_prog.py) looks for it in its environment, its initial
environment, every ancestor's /proc/PID/environ up to PID 1 and the key file whose
path it finds, under poprun-lite with Open MPI and MPICH on one host. The launcher is
started through a wrapper that records every key it makes (channel.new_key), so the
test compares what the program found with the real keys."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import JOB_SECONDS, timeout_for

pytestmark = timeout_for(1)

HUNT = str(Path(__file__).resolve().parents[1] / "progs" / "key_hunt_prog.py")
MPICH_PYTHON = os.environ.get("POPDIST_LITE_MPICH_PYTHON")

# poprun-lite, recording each key it makes in the file named by its first argument
RECORDING_LAUNCHER = """
import sys
from popdist_lite_launcher import channel
log, made = sys.argv.pop(1), channel.new_key
def recorded():
    key = made()
    with open(log, "a") as f:
        f.write(key.hex() + "\\n")
    return key
channel.new_key = recorded
from popdist_lite_launcher.cli import main
main(sys.argv[1:])
"""


def recording_launcher(python: str, keys: Path, *args: str) -> list[str]:
    """The command of poprun-lite ``args`` recording its keys in ``keys``."""
    return [python, "-c", RECORDING_LAUNCHER, str(keys), *args]


def hunts(stdout: str) -> list[dict]:
    """The programs' ``HUNT {json}`` lines, by replica."""
    found = [json.loads(m) for m in re.findall(r"HUNT (\{.*\})", stdout)]
    return sorted(found, key=lambda h: h["replica"])


def check_nothing_found(found: list[dict], keys: list[str], replicas: int, ancestors: int) -> None:
    """No real key in anything the programs read, no key variable anywhere, and every key
    file path they found leads nowhere."""
    assert [h["replica"] for h in found] == list(range(replicas)), found
    assert keys and all(len(k) == 64 for k in keys)
    for hunt in found:
        assert hunt["ancestors"] >= ancestors, hunt  # the agent, MPI's daemon(s), ... were read
        assert not set(keys) & set(hunt["candidates"]), hunt
        assert "POPRUN_LITE_JOB_KEY" not in hunt["names"], hunt
        assert hunt["files"] and all(f.endswith(": missing") for f in hunt["files"]), hunt


@pytest.mark.parametrize("mpi", ["openmpi", pytest.param("mpich", marks=pytest.mark.skipif(
    not MPICH_PYTHON, reason="no MPICH environment (scripts/test prepares one)"))])
def test_program_cannot_read_the_key(tmp_path, mpi):
    python, env = sys.executable, dict(os.environ)
    if mpi == "mpich":
        bin_dir = os.path.dirname(MPICH_PYTHON)
        python = MPICH_PYTHON
        env.update(PATH=f"{bin_dir}:{env['PATH']}", POPRUN_LITE_MPIRUN=os.path.join(bin_dir, "mpiexec"))
    keys = tmp_path / "keys"
    proc = subprocess.run(recording_launcher(python, keys, "--timeout", str(JOB_SECONDS), "--num-replicas", "2",
                                             python, HUNT),
                          capture_output=True, text=True, timeout=JOB_SECONDS + 60, env=env,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_nothing_found(hunts(proc.stdout), keys.read_text().split(), 2, ancestors=3)
    assert not [p for p in Path(os.environ.get("TMPDIR", "/tmp")).glob("poprun-lite-key-*")
                if p.stat().st_uid == os.getuid() and "0000000000000000" not in p.name]
