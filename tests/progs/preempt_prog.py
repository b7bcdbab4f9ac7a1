"""A small job for the preemption tests (tests/launcher/test_preempt_signals.py): every
replica adds its step to a running sum (an all-reduce), and at every step boundary asks
:func:`popdist_lite.should_checkpoint`; on True it saves a checkpoint of the sum and the
step and exits 0.

    python tests/progs/preempt_prog.py CKPT --steps N [options]

Every replica prints ``STEP step replica`` after each step; replica 0 prints ``STOPPED
step`` when it stopped at a boundary and ``DONE steps`` at the end. Options, each
waiting for an event (a file, the launcher's request), never for a time:

``--hold S``        after step S, wait at the boundary until should_checkpoint() is True
``--busy S FILE``   inside step S (not at a boundary), replica 0 prints ``BUSY S`` and
                    every replica waits until FILE exists
``--save-after FILE``  once should_checkpoint() is True, replica 0 prints ``SAVING``
                    and every replica waits until FILE exists before saving
``--no-save``       once should_checkpoint() is True, exit 0 without saving
``--kill-agent S``  after step S, replica 0 sends its parent (its agent) SIGTERM
``--children``      report how this process and its children hold the scheduler's
                    signals (``SELF``, ``CHILD``, ``SESSION``, ``PYCHILD``, ``FORKED``
                    lines), then run the steps
"""

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import popdist_lite as pl

parser = argparse.ArgumentParser()
parser.add_argument("ckpt")
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--hold", type=int, default=None)
parser.add_argument("--busy", nargs=2, default=None, metavar=("S", "FILE"))
parser.add_argument("--save-after", default=None)
parser.add_argument("--no-save", action="store_true")
parser.add_argument("--kill-agent", type=int, default=None)
parser.add_argument("--children", action="store_true")
args = parser.parse_args()
POLLS, POLL_SECONDS = 6000, 0.05  # a count, not a clock: gives up after 300 s of polls
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def wait_file(path: str) -> None:
    for _ in range(POLLS):
        if os.path.exists(path):
            return
        time.sleep(POLL_SECONDS)
    raise SystemExit(f"{path} never came")


def masks(pid: int) -> str:
    """Which of SIGNALS process ``pid`` ignores or blocks (/proc/PID/status)."""
    fields = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if ":\t" in line)
    found = []
    for kind in ("SigIgn", "SigBlk"):
        bits = int(fields[kind].strip(), 16)
        found += [f"{kind}:{signal.Signals(s).name}" for s in SIGNALS if bits >> (s - 1) & 1]
    return " ".join(found) or "none"


pl.init()
r = pl.replica_id()
if args.children:
    os.kill(os.getpid(), signal.SIGTERM)  # held: this process goes on
    time.sleep(0.1)
    print(f"SELF alive {masks(os.getpid())}", flush=True)
    for name, session in (("CHILD", False), ("SESSION", True)):
        child = subprocess.Popen(["sleep", "30"], start_new_session=session)
        state = masks(child.pid)
        os.kill(child.pid, signal.SIGTERM)
        try:
            code = child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            code = "alive"
        print(f"{name} {state} {code}", flush=True)
    shown = subprocess.run([sys.executable, "-c", "import signal; print(*(signal.getsignal(s).name if "
                            "hasattr(signal.getsignal(s), 'name') else 'handler' for s in (signal.SIGTERM, "
                            "signal.SIGINT, signal.SIGUSR1)))"], capture_output=True, text=True)
    print(f"PYCHILD {shown.stdout.strip()}", flush=True)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if all(signal.getsignal(s) == signal.SIG_DFL for s in (signal.SIGTERM, signal.SIGUSR1)) else 1)
    print(f"FORKED {os.waitpid(pid, 0)[1] >> 8}", flush=True)

state = {"step": 0, "total": np.zeros(1, np.float64)}
latest = pl.latest_checkpoint(args.ckpt)
if latest is not None:
    pl.load_checkpoint(latest, state)
for step in range(state["step"], args.steps):
    state["total"] += pl.all_reduce(np.full(1, step, np.float64))
    print(f"STEP {step} {r}", flush=True)
    if args.busy and step == int(args.busy[0]):
        if r == 0:
            print(f"BUSY {step}", flush=True)
        wait_file(args.busy[1])
    if args.kill_agent == step and r == 0:
        os.kill(os.getppid(), signal.SIGTERM)
    done = step + 1
    if args.hold == step:
        for _ in range(POLLS):
            if pl.should_checkpoint():
                break
            time.sleep(POLL_SECONDS)
    if pl.should_checkpoint():
        if args.no_save:
            sys.exit(0)
        if args.save_after:
            if r == 0:
                print("SAVING", flush=True)
            wait_file(args.save_after)
        state["step"] = done
        pl.save_checkpoint(args.ckpt, state, step=done)
        if r == 0:
            print(f"STOPPED {done}", flush=True)
        sys.exit(0)
if r == 0:
    print(f"DONE {args.steps}", flush=True)
