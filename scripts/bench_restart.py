#!/usr/bin/env python3
"""Launch costs: what a restart costs, the time from a replica's failure to the first step
of the next attempt, for examples/shakespeare.py under ``poprun-lite --max-restarts 1``;
and what the authenticated control plane costs (``control_plane``).

    python scripts/bench_restart.py [--replicas 2] [--runs 3] [--timeout 200]
    python scripts/bench_restart.py --control-plane-only     # seconds: the control plane alone

prints one JSON object on stdout. Method: each run trains the example on a small text
(60 steps, sequences of 20, batch 4, a checkpoint every 10 steps, ``--resume``) and
SIGKILLs replica 1's process as soon as replica 0 prints step 25. Times are taken when
the lines reach this script: ``detect_s`` from the kill to poprun-lite's ``attempt 1 of 2
failed`` report (the job noticed the failure, stopped the other ranks and reported),
``restart_to_first_step_s`` from the kill to the first ``Step`` line of the second
attempt (which starts again at step 20, the newest checkpoint). For comparison,
``cold_start_s`` is a fresh launch's time to its first step. Every job runs under a
timeout. Medians over ``--runs``.

``control_plane`` is measured against a real collector in this process and the agents'
own code (``popdist_lite_launcher.node.link.Link``) in another: ``handshake_ms`` is the
median over ``--agents`` agents, one after the other, of the time from starting a link
to its welcome (TCP connection, challenge, hello with its HMAC-SHA256, the collector's
check, welcome and the agent's check), what each agent adds to a launch;
``records_per_s`` is the collector's throughput with authentication on: ``--records``
``progress`` records sent as fast as the agent can through one authenticated connection
(each framed with its sequence number and MAC by the agent; MAC, sequence and schema
checked by the collector), counted from the first to the last arrival at a subscriber.
The load average before and after is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "shakespeare.py"
STEP_RE = re.compile(r"^Step (\d+), loss")
TEXT = ("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. "
        "First Citizen: You are all resolved rather to die than to famish? ") * 4


def replica_program(replica: int, attempt: int) -> int | None:
    """PID of the example's process driving ``replica`` in ``attempt`` (not its agent)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if str(EXAMPLE).encode() in cmdline and b"popdist_lite_launcher.node.agent" not in cmdline \
                    and f"POPDIST_REPLICA_INDEX_OFFSET={replica}".encode() in environ \
                    and f"POPDIST_LITE_RESTART_COUNT={attempt}".encode() in environ:
                return int(entry)
    return None


def run(replicas: int, timeout: float, kill_at: int | None) -> dict:
    """One job; returns the times (seconds, on this script's clock) of its events."""
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "text.txt"
        data.write_text(TEXT)
        cmd = [sys.executable, "-m", "popdist_lite_launcher", "--num-replicas", str(replicas),
               "--max-restarts", "1", "--timeout", str(timeout), sys.executable, str(EXAMPLE),
               "--data", str(data), "--steps", "60", "--seq-len", "20", "--batch-size", "4",
               "--log-every", "1", "--sample-chars", "0", "--checkpoint-dir", str(Path(tmp) / "ckpt"),
               "--checkpoint-every", "10", "--resume"]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_", "POPDIST_"))}
        start = time.monotonic()
        job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               stdin=subprocess.DEVNULL)
        events: dict = {}

        def out():
            for line in job.stdout:
                m = STEP_RE.match(line)
                if not m:
                    continue
                now = time.monotonic()
                events.setdefault("first_step", now)
                if "kill" in events:
                    events.setdefault("first_step_after_kill", now)
                elif kill_at is not None and int(m[1]) == kill_at:
                    pid = replica_program(1, 0)
                    if pid is not None:
                        os.kill(pid, signal.SIGKILL)
                        events["kill"] = time.monotonic()

        def err():
            for line in job.stderr:
                if "attempt 1 of 2 failed" in line:
                    events.setdefault("reported", time.monotonic())
        threads = [threading.Thread(target=out, daemon=True), threading.Thread(target=err, daemon=True)]
        for t in threads:
            t.start()
        try:
            code = job.wait(timeout=timeout + 30)
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
        for t in threads:
            t.join(5)
        if code != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed with exit code {code}")
        return {name: t - start for name, t in events.items()}


# The agents' side of control_plane(), in its own process as agents are: N handshakes,
# one after the other, then records through the first connection. The key comes in a key
# file, as poprun-lite gives it (keys.take_key reads and removes it).
AGENTS = """
import json, os, sys, time
from popdist_lite import records
from popdist_lite_launcher.node import keys, link as agent_link
key, agents, count = keys.take_key(), int(sys.argv[1]), int(sys.argv[2])
links, handshakes = [], []
for rank in range(agents):
    link = agent_link.Link(os.environ[records.COLLECTOR_ENV], key)
    start = time.perf_counter()
    link.start(records.identity(rank=rank, replica=rank, pid=os.getpid()), lambda request: None)
    if not link.ready.wait(60) or link.session is None:
        sys.exit(f"agent {rank} did not authenticate")
    handshakes.append(time.perf_counter() - start)
    links.append(link)
print(json.dumps(handshakes), flush=True)
ident = records.identity(rank=0, replica=0, pid=os.getpid())
for call in range(count):
    links[0].send(records.make("progress", ident, lane="main", call=call, op="all_reduce", since=1.0))
sys.stdin.read()  # until the launcher has counted them
"""


def control_plane(agents: int, count: int, timeout: float) -> dict:
    """The handshake's cost per agent and the collector's throughput (module docstring)."""
    from popdist_lite import records
    from popdist_lite_launcher.node import keys
    from popdist_lite_launcher.supervise.collector import Collector

    arrivals: list[float] = []
    done = threading.Event()

    def arrived(record):
        arrivals.append(time.perf_counter())
        if len(arrivals) == count:
            done.set()

    with Collector(ranks=agents) as collector:
        collector.subscribe("progress", arrived)
        directory = keys.write_keys(collector.key, [0], "0" * 16)  # the agents' side reads and removes it
        env = {**os.environ, records.COLLECTOR_ENV: collector.address,
               keys.KEY_FILE_ENV: f"{directory}/{keys.key_file_name(0)}"}
        proc = subprocess.Popen([sys.executable, "-c", AGENTS, str(agents), str(count)], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            handshakes = json.loads(proc.stdout.readline() or "null")
            counted = done.wait(timeout)
        finally:
            proc.communicate(timeout=30)
        refused, dropped = collector.ignored()
    if not handshakes or not counted or refused or dropped:
        raise RuntimeError(f"control plane: handshakes {handshakes}, {len(arrivals)} of {count} "
                           f"records counted, refused {refused}, dropped {dropped}")
    return {"agents": agents, "handshake_ms": round(1e3 * statistics.median(handshakes), 3),
            "handshake_ms_all": [round(1e3 * t, 3) for t in handshakes], "records": count,
            "records_per_s": round((count - 1) / (arrivals[-1] - arrivals[0]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=200)
    parser.add_argument("--agents", type=int, default=32, help="handshakes measured (default 32)")
    parser.add_argument("--records", type=int, default=20000,
                        help="records through one authenticated connection (default 20000)")
    parser.add_argument("--control-plane-only", action="store_true",
                        help="measure the control plane only (no restarts)")
    opts = parser.parse_args()
    load_before = os.getloadavg()[0]
    plane = control_plane(opts.agents, opts.records, opts.timeout)
    if opts.control_plane_only:
        print(json.dumps({"benchmark": "restart", "control_plane": plane,
                          "load_avg_1min_before": round(load_before, 2),
                          "load_avg_1min_after": round(os.getloadavg()[0], 2)}, indent=1))
        return
    cold, detect, restart = [], [], []
    for _ in range(opts.runs):
        cold.append(run(opts.replicas, opts.timeout, None)["first_step"])
        t = run(opts.replicas, opts.timeout, 25)
        if "kill" not in t or "first_step_after_kill" not in t:
            raise RuntimeError(f"replica 1 was not killed or the job did not restart: {t}")
        detect.append(t["reported"] - t["kill"])
        restart.append(t["first_step_after_kill"] - t["kill"])
    med = lambda xs: round(statistics.median(xs), 2)  # noqa: E731
    print(json.dumps({"benchmark": "restart", "replicas": opts.replicas, "runs": opts.runs,
                      "cold_start_s": med(cold), "detect_s": med(detect),
                      "restart_to_first_step_s": med(restart), "control_plane": plane,
                      "load_avg_1min_before": round(load_before, 2),
                      "load_avg_1min_after": round(os.getloadavg()[0], 2),
                      "all": {"cold_start_s": [round(x, 2) for x in cold], "detect_s": [round(x, 2) for x in detect],
                              "restart_to_first_step_s": [round(x, 2) for x in restart]}}, indent=1))


if __name__ == "__main__":
    main()
