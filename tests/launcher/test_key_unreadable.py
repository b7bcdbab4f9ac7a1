"""The job's key cannot be read by the program (issue 28): a program
(tests/progs/key_hunt_prog.py) looks for it in its environment, its initial
environment, every ancestor's /proc/PID/environ up to PID 1 and the key file whose
path it finds, under poprun-lite with Open MPI and MPICH on one host. The launcher is
started through a wrapper that records every key it makes (channel.new_key), so the
test compares what the program found with the real keys."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import JOB_SECONDS, timeout_for
from keyhunt import HUNT, check_nothing_found, hunts, recording_launcher

pytestmark = timeout_for(1)

MPICH_PYTHON = os.environ.get("POPDIST_LITE_MPICH_PYTHON")


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
