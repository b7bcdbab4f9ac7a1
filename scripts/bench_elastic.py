#!/usr/bin/env python3
"""What a change of membership costs in an elastic job (docs/elastic.md): at 2 test hosts x
2 replicas, the time from the loss of a host to the first step at 2 replicas, and from
its return to the first step at 4 again, for examples/shakespeare.py; with the size of
its checkpoint.

    python scripts/bench_elastic.py [--runs 3] [--timeout 300]

prints one JSON object on stdout. Needs root (network-namespace test hosts,
popdist_lite_launcher.testing.netns_hosts). Method: each run starts
``poprun-lite --num-replicas 4 --min-replicas 2 --host-discovery-script S
--discovery-interval 1`` over the test hosts pdlh1 and pdlh2 (2 slots each; every byte
between ranks on TCP) running the example (the guide's [256, 256] table and GRU(256),
sequences of 20, per-replica batch 4, ``--global-batch-size 16``, ``--data-order
global``, a checkpoint every 10 steps, ``--resume``). When replica 0 prints step 25,
pdlh2's link is set down, its processes are killed and the discovery script stops
listing it (``loss``); the first step printed after that (step 20 again, from the
step-20 checkpoint, at 2 replicas) ends ``loss_to_first_step_s``. Ten steps later pdlh2
is brought back and listed again (``return``); the first step printed after the
program's ``stopping at step S for a resize`` (step S, at 4 replicas) ends
``return_to_first_step_s``; the job is then stopped (SIGINT). Times are taken when the
lines reach this script.
``checkpoint_bytes`` is the size of the step-20 checkpoint directory. Every job runs
under a timeout; medians over ``--runs``, every run's figures in ``all``, and the load
average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
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
STOP_RE = re.compile(r"^stopping at step (\d+) for a resize")
TEXT = ("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. "
        "First Citizen: You are all resolved rather to die than to famish? ") * 20
LOSS_AT, RETURN_AFTER = 25, 10


def run(hosts, timeout: float) -> dict:
    """One job; returns its times (seconds) and checkpoint size."""
    from popdist_lite_launcher.testing import netns_hosts

    base = ROOT / ".bench-elastic"
    base.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=base))  # in the project: the test hosts share it, not /tmp
    try:
        (work / "text.txt").write_text(TEXT)
        listing = work / "hosts"
        listing.write_text("pdlh1:2\npdlh2:2\n")
        script = work / "discover.sh"
        script.write_text(f"#!/usr/bin/env bash\ncat {listing}\n")
        script.chmod(0o755)
        cmd = [sys.executable, "-m", "popdist_lite_launcher", "--timeout", str(timeout), "--num-replicas", "4",
               "--min-replicas", "2", "--host-discovery-script", str(script), "--discovery-interval", "1",
               "--launch-agent", netns_hosts.LAUNCH_AGENT, "--network-interface", netns_hosts.CIDR,
               "--mpi-global-args=--mca btl tcp,self --mca mpi_yield_when_idle 1",
               sys.executable, str(EXAMPLE), "--data", str(work / "text.txt"), "--steps", "100000",
               "--seq-len", "20", "--batch-size", "4", "--global-batch-size", "16", "--data-order", "global",
               "--log-every", "1", "--sample-chars", "0", "--checkpoint-dir", str(work / "ckpt"),
               "--checkpoint-every", "10", "--checkpoint-keep", "100", "--resume"]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_", "POPDIST_"))}
        job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                               stdin=subprocess.DEVNULL)
        events: dict = {}

        def out():
            small_steps = 0
            for line in job.stdout:
                now = time.monotonic()
                if STOP_RE.match(line):
                    events.setdefault("stopped", now)
                m = STEP_RE.match(line)
                if not m:
                    continue
                step = int(m[1])
                if "loss" not in events and step == LOSS_AT:
                    hosts.kill_host("pdlh2")
                    listing.write_text("pdlh1:2\n")
                    events["loss"] = time.monotonic()
                elif "loss" in events and "first_small" not in events and step <= LOSS_AT:
                    events["first_small"] = now
                elif "first_small" in events and "return" not in events:
                    small_steps += 1
                    if small_steps == RETURN_AFTER:
                        hosts.restore_host("pdlh2")
                        listing.write_text("pdlh1:2\npdlh2:2\n")
                        events["return"] = time.monotonic()
                elif "stopped" in events and "first_large" not in events:
                    events["first_large"] = now
                    job.send_signal(signal.SIGINT)  # measured: stop the job (no restart on SIGINT)

        err: list[str] = []
        threads = [threading.Thread(target=out, daemon=True),
                   threading.Thread(target=lambda: err.append(job.stderr.read()), daemon=True)]
        for t in threads:
            t.start()
        try:
            code = job.wait(timeout=timeout + 30)
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
            hosts.restore_host("pdlh2")
        for t in threads:
            t.join(5)
        missing = {"loss", "first_small", "return", "first_large"} - set(events)
        if code != 128 + signal.SIGINT or missing:
            raise RuntimeError(f"job failed (exit {code}) or events {sorted(missing)} missing:\n"
                               + "".join(err)[-4000:])
        step20 = work / "ckpt" / "step-00000020"
        return {"loss_to_first_step_s": events["first_small"] - events["loss"],
                "return_to_first_step_s": events["first_large"] - events["return"],
                "checkpoint_bytes": sum(f.stat().st_size for f in step20.iterdir())}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per job (default 300)")
    opts = parser.parse_args()
    from popdist_lite_launcher.testing import netns_hosts

    reason = netns_hosts.unavailable()
    if reason:
        sys.exit(f"bench_elastic.py: {reason}")
    load_before = os.getloadavg()[0]
    results = []
    with netns_hosts.TestHosts(2) as hosts:
        for _ in range(opts.runs):
            results.append(run(hosts, opts.timeout))
    med = lambda key: round(statistics.median(r[key] for r in results), 2)  # noqa: E731
    print(json.dumps({
        "benchmark": "elastic", "hosts": 2, "replicas": [4, 2, 4], "runs": opts.runs,
        "loss_to_first_step_s": med("loss_to_first_step_s"),
        "return_to_first_step_s": med("return_to_first_step_s"),
        "checkpoint_bytes": results[0]["checkpoint_bytes"],
        "setup": {"program": "examples/shakespeare.py --seq-len 20 --batch-size 4 --global-batch-size 16 "
                             "--data-order global --checkpoint-every 10 --checkpoint-keep 100",
                  "transport": "tcp (btl tcp,self) between network-namespace test hosts",
                  "discovery_interval_s": 1, "host_lost_at_step": LOSS_AT,
                  "host_back_after_steps": RETURN_AFTER},
        "load_avg_1min_before": round(load_before, 2), "load_avg_1min_after": round(os.getloadavg()[0], 2),
        "all": {key: [round(r[key], 2) for r in results] for key in ("loss_to_first_step_s",
                                                                       "return_to_first_step_s")},
    }, indent=1))


if __name__ == "__main__":
    main()
