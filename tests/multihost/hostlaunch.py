"""poprun-lite across the test hosts, under a timeout (shared by the multi-host tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from popdist_lite_launcher.testing import netns_hosts

ROOT = Path(__file__).resolve().parents[2]
PROG_PY = str(Path(__file__).parent.parent / "progs" / "hosts_prog.py")
MPICH_PYTHON = os.environ.get("POPDIST_LITE_MPICH_PYTHON")


def prog(*args: str, mpich: bool = False) -> list[str]:
    """tests/progs/hosts_prog.py with ``args``, under the interpreter of the MPI in use."""
    return [MPICH_PYTHON if mpich else sys.executable, PROG_PY, *args]


def poprun_command(hosts, *args, job_timeout: float = 240, python: str = sys.executable) -> list[str]:
    """poprun-lite over every test host, with the launch agent and the test network."""
    return [python, "-m", "popdist_lite_launcher", "--timeout", str(job_timeout),
            "-H", ",".join(hosts.names), "--launch-agent", netns_hosts.LAUNCH_AGENT,
            "--network-interface", netns_hosts.CIDR, *args]


def mpich_env() -> dict:
    """Environment running the MPICH venv's mpiexec (POPDIST_LITE_MPICH_PYTHON)."""
    bin_dir = Path(MPICH_PYTHON).parent
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "POPRUN_LITE_MPIRUN": str(bin_dir / "mpiexec")}


def poprun(hosts, *args, timeout: float = 300, job_timeout: float = 240, mpich: bool = False,
           **kw) -> subprocess.CompletedProcess:
    python = MPICH_PYTHON if mpich else sys.executable
    env = {**os.environ, **(mpich_env() if mpich else {}), **kw.pop("env", {})}
    return subprocess.run(poprun_command(hosts, *args, job_timeout=job_timeout, python=python),
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env,
                          stdin=subprocess.DEVNULL, **kw)


def mpirun(hosts, ranks_per_host: int, args: list[str], *, mpich: bool = False, tcp_only: bool = True,
           timeout: float = 600) -> subprocess.CompletedProcess:
    """Plain mpirun (Open MPI) or mpiexec (MPICH's hydra) over every test host, with the
    launch agent and the test network, under a timeout."""
    spread = ",".join(f"{name}:{ranks_per_host}" for name in hosts.names)
    n = str(ranks_per_host * len(hosts.names))
    if mpich:
        exe = str(Path(MPICH_PYTHON).parent / "mpiexec")
        cmd = [exe, "-launcher", "ssh", "-launcher-exec", netns_hosts.LAUNCH_AGENT,
               "-localhost", netns_hosts.LAUNCHER_ADDRESS, "-hosts", spread, "-n", n]
    else:
        exe = str(Path(sys.executable).parent / "mpirun")
        cmd = [exe, "--allow-run-as-root", "--bind-to", "none", "--host", spread, "-np", n,
               "--prtemca", "plm_ssh_agent", netns_hosts.LAUNCH_AGENT,
               "--prtemca", "oob_tcp_if_include", netns_hosts.CIDR,
               "--mca", "btl_tcp_if_include", netns_hosts.CIDR, "-x", "PATH"]
        if tcp_only:
            cmd += ["--mca", "btl", "tcp,self"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    return subprocess.run(cmd + args, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=env, stdin=subprocess.DEVNULL, start_new_session=True)
