"""poprun-lite across the test hosts, under a timeout (shared by the multi-host tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import testhosts

ROOT = Path(__file__).resolve().parents[2]
PROG_PY = str(Path(__file__).with_name("prog.py"))
MPICH_PYTHON = os.environ.get("POPDIST_LITE_MPICH_PYTHON")


def prog(*args: str, mpich: bool = False) -> list[str]:
    """tests/multihost/prog.py with ``args``, under the interpreter of the MPI in use."""
    return [MPICH_PYTHON if mpich else sys.executable, PROG_PY, *args]


def poprun_command(hosts, *args, job_timeout: float = 60, python: str = sys.executable) -> list[str]:
    """poprun-lite over every test host, with the launch agent and the test network."""
    return [python, "-m", "popdist_lite_launcher", "--timeout", str(job_timeout),
            "-H", ",".join(hosts.names), "--launch-agent", testhosts.LAUNCH_AGENT,
            "--network-interface", testhosts.CIDR, *args]


def mpich_env() -> dict:
    """Environment running the MPICH venv's mpiexec (POPDIST_LITE_MPICH_PYTHON)."""
    bin_dir = Path(MPICH_PYTHON).parent
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "POPRUN_LITE_MPIRUN": str(bin_dir / "mpiexec")}


def poprun(hosts, *args, timeout: float = 90, job_timeout: float = 60, mpich: bool = False,
           **kw) -> subprocess.CompletedProcess:
    python = MPICH_PYTHON if mpich else sys.executable
    env = {**os.environ, **(mpich_env() if mpich else {}), **kw.pop("env", {})}
    return subprocess.run(poprun_command(hosts, *args, job_timeout=job_timeout, python=python),
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env,
                          stdin=subprocess.DEVNULL, **kw)
