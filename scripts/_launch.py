"""Shared by the benchmark scripts: re-run a script on N ranks through poprun-lite,
under a timeout, and collect the JSON lines it prints; optionally across test hosts."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def under_mpi() -> bool:
    """True inside an MPI job (poprun-lite or mpirun set these)."""
    return any(v in os.environ for v in ("POPDIST_NUM_TOTAL_REPLICAS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"))


@contextlib.contextmanager
def on_test_hosts(n: int):
    """With ``n`` > 0: make ``n`` network-namespace test hosts (tests/multihost/testhosts.py,
    root only) for the duration and yield the poprun-lite arguments that spread the
    replicas evenly over them with every byte between ranks on TCP over the test network
    (``--mca btl tcp,self``); with ``n`` == 0 yield no arguments (one host).

    Raises:
        RuntimeError: test hosts cannot be made here (the reason).
    """
    if not n:
        yield []
        return
    sys.path.insert(0, os.path.join(ROOT, "tests", "multihost"))
    import testhosts

    reason = testhosts.unavailable()
    if reason:
        raise RuntimeError(reason)
    with testhosts.TestHosts(n) as hosts:
        yield ["-H", ",".join(hosts.names), "--launch-agent", testhosts.LAUNCH_AGENT,
               "--network-interface", testhosts.CIDR, "--mpi-global-args=--mca btl tcp,self"]


def run_ranks(script: str, args: list[str], ranks: int, timeout: float,
              launcher_args: list[str] = ()) -> list[dict]:
    """Run ``python script --worker args`` on ``ranks`` replicas with poprun-lite (plus
    ``launcher_args``, e.g. from :func:`on_test_hosts`); return the JSON objects printed on
    lines starting with ``JSON `` (replica 0 prints them).

    Raises:
        RuntimeError: the job failed or timed out (the launcher's report is included).
    """
    cmd = [sys.executable, "-m", "popdist_lite_launcher", "--num-replicas", str(ranks),
           "--timeout", str(timeout), *launcher_args, sys.executable, script, "--worker", *args]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 30,
                                stdin=subprocess.DEVNULL, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{' '.join(cmd)} hung for {exc.timeout} s") from None
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {result.returncode}):\n"
                           f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return [json.loads(line[5:]) for line in result.stdout.splitlines() if line.startswith("JSON ")]
