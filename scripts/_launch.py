"""Shared by the benchmark scripts: re-run a script on N ranks through poprun-lite,
under a timeout, and collect the JSON lines it prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def under_mpi() -> bool:
    """True inside an MPI job (poprun-lite or mpirun set these)."""
    return any(v in os.environ for v in ("POPDIST_NUM_TOTAL_REPLICAS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"))


def run_ranks(script: str, args: list[str], ranks: int, timeout: float) -> list[dict]:
    """Run ``python script --worker args`` on ``ranks`` replicas with poprun-lite; return
    the JSON objects printed on lines starting with ``JSON `` (replica 0 prints them).

    Raises:
        RuntimeError: the job failed or timed out (the launcher's report is included).
    """
    cmd = [sys.executable, "-m", "popdist_lite_launcher", "--num-replicas", str(ranks),
           "--timeout", str(timeout), sys.executable, script, "--worker", *args]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 30,
                                stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{' '.join(cmd)} hung for {exc.timeout} s") from None
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {result.returncode}):\n"
                           f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return [json.loads(line[5:]) for line in result.stdout.splitlines() if line.startswith("JSON ")]
