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
def on_test_hosts(n: int, ranks: int):
    """With ``n`` > 0: make ``n`` network-namespace test hosts (popdist_lite_launcher.testing.netns_hosts,
    root only) for the duration and yield the poprun-lite arguments that spread the
    ``ranks`` replicas evenly over them with every byte between ranks on TCP over the
    test network (``--mca btl tcp,self``); with ``n`` == 0 yield no arguments (one host).

    The test hosts share this machine's cores, which Open MPI cannot see: each host
    looks like a node with a core per rank, so the ranks would busy-poll, and with more
    ranks than cores every message would wait for the scheduler's time slice (milliseconds).
    With more ``ranks`` than cores the ranks therefore yield the processor while they
    wait (``--mca mpi_yield_when_idle 1``, what Open MPI does by itself on a node it
    knows to be oversubscribed).

    Raises:
        RuntimeError: test hosts cannot be made here (the reason).
    """
    if not n:
        yield []
        return
    from popdist_lite_launcher.testing import netns_hosts

    reason = netns_hosts.unavailable()
    if reason:
        raise RuntimeError(reason)
    mca = "--mca btl tcp,self" + (" --mca mpi_yield_when_idle 1" if _oversubscribed(ranks) else "")
    with netns_hosts.TestHosts(n) as hosts:
        yield ["-H", ",".join(hosts.names), "--launch-agent", netns_hosts.LAUNCH_AGENT,
               "--network-interface", netns_hosts.CIDR, f"--mpi-global-args={mca}"]


def _oversubscribed(ranks: int) -> bool:
    return ranks > (os.cpu_count() or 1)


def test_hosts_setup(n: int, ranks: int) -> dict:
    """How :func:`on_test_hosts` ran ``ranks`` replicas on ``n`` test hosts, for a report."""
    return {"hosts": n, "transport": "tcp (btl tcp,self) between network-namespace test hosts",
            "mpi_yield_when_idle": _oversubscribed(ranks)}


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
