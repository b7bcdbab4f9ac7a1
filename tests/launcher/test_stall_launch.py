"""The stall inspector end to end: poprun-lite with a short --stall-warning over real
ranks, one replica stalling in each of eight ways (among them in a torch
DistributedDataParallel backward, a checkpoint save, and before a JAX in-jit lookup,
whose calls are on the jax lane: tests/progs/jax_stall_prog.py). Each test checks the printed block
(the right replica, operation and call number, and a Python stack naming the test
program's own function), that it came no sooner than the warning time after the stall,
and that --stall-timeout ends the job (every run has one, so each job ends by itself,
its output read to the end). Every run is under a timeout.

No healthy replica is ever slow enough to look stalled, however busy the machine: the
replicas meet at a file barrier after their imports and before their first collective,
and the replicas that will wait enter the stalled call only once the missing one has
written that it is in its stalling function (an event, not a delay). So the only stall
there is to see is the real one, and --stall-timeout can be a few seconds after the
warning (the inspector prints the warning block before ending the job in any case)."""

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from helpers import JOB_SECONDS, ROOT, timeout_for
from peers import alive, wait_for

pytestmark = timeout_for(1)

LAUNCHER = [sys.executable, "-m", "popdist_lite_launcher"]
PROG_DIR = ROOT / "tests" / "progs"
WARNING = 2.0
#: --stall-timeout: after the warning block (which the inspector prints before it ends
#: the job, whenever the timeout comes); the gap lets the block come first in the usual
#: way, from the warning's own round of stacks.
STALL_TIMEOUT = WARNING + 3.0

# Calls: all_reduce #0, broadcast #1 (after every replica has imported everything: a
# barrier on files), then the scenario. The replica that will be missing calls
# missing_now() once it is in its stalling function; the others call wait_for_missing()
# before they enter the call they will wait in, and replica 0 writes the time at which
# it enters it to argv[1]/stall_start.
PRELUDE = """
    import os, sys, time
    import numpy as np
    import popdist_lite as pl

    def wait_for_file(name):
        deadline = time.monotonic() + 240
        while not os.path.exists(os.path.join(sys.argv[1], name)):
            if time.monotonic() > deadline:
                sys.exit(f"no {name} after 240 s")
            time.sleep(0.01)

    pl.init()
    me = pl.replica_id()
    open(os.path.join(sys.argv[1], f"ready-{me}"), "w").close()
    for r in range(pl.num_replicas()):
        wait_for_file(f"ready-{r}")
    x = np.ones(4)
    pl.all_reduce(x)
    pl.broadcast(x)

    def missing_now():
        open(os.path.join(sys.argv[1], "missing"), "w").close()

    def wait_for_missing():
        wait_for_file("missing")

    def stall_starts():
        if me == 0:
            with open(os.path.join(sys.argv[1], "stall_start"), "w") as f:
                f.write(repr(time.time()))
"""

SLEEP = PRELUDE + """
    def sleep_before_all_reduce():
        missing_now()
        time.sleep(120)

    if me == 1:
        sleep_before_all_reduce()
    wait_for_missing()
    stall_starts()
    pl.all_reduce(x)
"""

LOOP = PRELUDE + """
    def spin_in_a_python_loop():
        missing_now()
        n = 0
        while True:
            n += 1

    if me == 1:
        spin_in_a_python_loop()
    wait_for_missing()
    stall_starts()
    pl.all_gather(x)
"""

SKIP = PRELUDE + """
    pl.set_collective_checks(False)  # checked, the skip would be a clean error at once

    def skip_the_broadcast():
        missing_now()
        pl.all_reduce(x)  # replica 1 skips broadcast #2 (it is the root) and goes on

    if me == 1:
        skip_the_broadcast()
    else:
        wait_for_missing()
        stall_starts()
        pl.broadcast(x, root=1)
        pl.all_reduce(x)
"""

STOP = PRELUDE + """
    import signal

    if me == 1:  # stops itself while replica 0 waits for it in all_reduce #2
        with open(os.path.join(sys.argv[1], "stopped_pid"), "w") as f:
            f.write(str(os.getpid()))
        missing_now()
        os.kill(os.getpid(), signal.SIGSTOP)
    wait_for_missing()
    stall_starts()
    pl.all_reduce(x)
"""

FEEDER = """
    import os, sys, time
    import numpy as np
    import popdist_lite as pl

    def wait_for_file(name):
        deadline = time.monotonic() + 240
        while not os.path.exists(os.path.join(sys.argv[1], name)):
            if time.monotonic() > deadline:
                sys.exit(f"no {name} after 240 s")
            time.sleep(0.01)

    pl.init()
    if pl.role() == "replica":
        open(os.path.join(sys.argv[1], f"ready-{pl.replica_id()}"), "w").close()
        for r in range(pl.num_replicas()):
            wait_for_file(f"ready-{r}")

    def stuck_in_the_dataset():
        open(os.path.join(sys.argv[1], "missing"), "w").close()
        while True:
            time.sleep(0.1)

    def make_dataset(shard, num_shards):
        for step in range(100):
            if shard == 1 and step == 3:
                stuck_in_the_dataset()
            yield {"x": np.full(4, step, dtype=np.float32)}

    feed = pl.infeed(make_dataset, prefetch_depth=1)
    if pl.role() == "replica":
        for step, batch in enumerate(feed):  # per step: infeed #2s, all_reduce #2s+1
            if step == 2 and pl.replica_id() == 0:
                wait_for_file("missing")  # until replica 1's feeder is stuck
                with open(os.path.join(sys.argv[1], "stall_start"), "w") as f:
                    f.write(repr(time.time()))  # about to ask for batch 3
            pl.all_reduce(batch["x"])
"""


# After the prelude: DistributedDataParallel's construction agrees the parameters
# (agree_objects #2), broadcasts them (agree_objects #3, broadcast #4 and #5) and makes
# its buckets' communicator (comm_dup #6); then each backward waits for its one bucket:
# all_reduce #7, #8.
DDP = PRELUDE + """
    import torch
    import popdist_lite.torch as pt

    model = pt.DistributedDataParallel(torch.nn.Linear(4, 2))

    def sleep_before_backward():
        missing_now()
        time.sleep(120)

    for step in range(2):
        loss = model(torch.ones(3, 4)).sum()
        if step == 1:
            if me == 1:
                sleep_before_backward()
            wait_for_missing()
            stall_starts()
        loss.backward()
"""


# After the prelude, a blocking save: agree_objects #2 (the arguments), replica 0's
# directory broadcast (checkpoint_bcast #3), agree_objects #4 (every replica sees it),
# then the writers of each array write its file and every replica reports to replica 0
# (checkpoint_gather #5; the others' small sends return at once), then waits for
# replica 0's outcome (checkpoint_bcast #6). Replica 0 alone writes the replicated array,
# and its disk never finishes.
SAVE = PRELUDE + """
    from popdist_lite.checkpoint import save as checkpoint_save

    def slow_disk(*args, **kwargs):  # replica 1 cannot be held: it is inside the save already
        time.sleep(120)

    if me == 0:
        checkpoint_save.write_npy = slow_disk
    else:
        with open(os.path.join(sys.argv[1], "stall_start"), "w") as f:
            f.write(repr(time.time()))  # about to save: it reaches the gather at once
    pl.save_checkpoint(os.path.join(sys.argv[1], "ckpt"), {"x": x}, step=0)
"""


def run_stalled(tmp_path, code, *args, replicas=2):
    """Run ``code`` (a program's text, or the path of one) under poprun-lite until its
    stall timeout ends it; return (all its stderr text, seconds from the stall's start to
    the first stall block, exit code)."""
    if isinstance(code, Path):
        prog = code
    else:
        prog = tmp_path / "prog.py"
        prog.write_text(textwrap.dedent(code))
    proc = subprocess.Popen([*LAUNCHER, "--timeout", str(JOB_SECONDS), "--num-replicas", str(replicas),
                             "--stall-warning", str(WARNING), "--stall-timeout", str(STALL_TIMEOUT), *args,
                             sys.executable, str(prog), str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    lines, first_block = [], []

    def read():
        for line in proc.stderr:
            if line.startswith("poprun-lite: stall:") and not first_block:
                first_block.append(time.time())
            lines.append(line)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=JOB_SECONDS + 30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(60)
    assert not reader.is_alive(), "the launcher's stderr did not end"
    start = float((tmp_path / "stall_start").read_text())
    delay = first_block[0] - start if first_block else None
    return "".join(lines), delay, proc.returncode


def block_of(text, title="poprun-lite: stall:"):
    lines = text[text.index(title):].splitlines()
    end = next((i for i, line in enumerate(lines[1:], 1) if not line.startswith("  ")), len(lines))
    return "\n".join(lines[:end])


def test_replica_sleeping_before_an_all_reduce(tmp_path):
    trace = tmp_path / "trace.json"
    err, delay, code = run_stalled(tmp_path, SLEEP, "--timeline", str(trace), replicas=3)
    assert delay is not None and delay >= WARNING, err
    block = block_of(err)
    assert re.search(r"^poprun-lite: stall: replicas (0, 2|2, 0) have waited", block)  # longest wait first
    assert "in all_reduce (collective call #2) for replica 1, which did not enter it" in block
    assert "  missing: replica 1 (rank 1, host" in block
    assert "last entered broadcast (collective call #1)" in block
    assert "in sleep_before_all_reduce" in block
    # --stall-timeout: the block is the root cause, exit code 1
    assert code == 1, err
    assert "poprun-lite: job stalled (exit code 1)" in err
    cause = block_of(err, "root cause: stall:")
    assert "in all_reduce (collective call #2) for replica 1" in cause
    assert "in sleep_before_all_reduce" in cause
    assert "in _stream" not in block  # the timeline's sender thread is the library's, left out
    # the stalled job's timeline, written by poprun-lite from what the replicas sent before
    # the stall: each replica's all_reduce #0 and broadcast #1
    assert err.rstrip().endswith(f"\ntimeline (partial: the job stalled) {trace}"), err
    events = json.loads(trace.read_text())["traceEvents"]
    for name in ("all_reduce", "broadcast"):
        assert {e["pid"] for e in events if e["ph"] == "X" and e["name"] == name} == {0, 1, 2}, events


def test_replica_sleeping_before_a_ddp_backward(tmp_path):
    """DistributedDataParallel's buckets are numbered collective calls: the replicas
    waiting in a bucket name the one that never reached its backward."""
    pytest.importorskip("torch", reason="popdist_lite.torch needs PyTorch: pip install '.[torch]'")
    err, delay, code = run_stalled(tmp_path, DDP)
    assert delay is not None and delay >= WARNING, err
    block = block_of(err)
    assert "replica 0 has waited" in block
    assert "in all_reduce (collective call #8) for replica 1, which did not enter it" in block
    assert "last entered all_reduce (collective call #7)" in block
    assert "in sleep_before_backward" in block
    assert code == 1, err
    cause = block_of(err, "root cause: stall:")
    assert "in all_reduce (collective call #8) for replica 1" in cause


def test_replica_not_joining_a_checkpoint_save(tmp_path):
    """A checkpoint save's gather and broadcast are numbered collective calls: replica 1,
    waiting for the save's outcome, names replica 0, whose write never ended."""
    err, delay, code = run_stalled(tmp_path, SAVE)
    assert delay is not None and delay >= WARNING, err
    block = block_of(err)
    assert "replica 1 has waited" in block
    assert "in checkpoint_bcast (collective call #6) for replica 0, which did not enter it" in block
    assert "last entered agree_objects (collective call #4)" in block
    assert "in slow_disk" in block
    assert code == 1, err
    cause = block_of(err, "root cause: stall:")
    assert "in checkpoint_bcast (collective call #6) for replica 0" in cause


def test_replica_stopping_before_a_jax_in_jit_lookup(tmp_path):
    """The JAX binding's calls are on a communicator of their own, recorded on the jax
    lane: replica 1 stops before an in-jit lookup while the main lane is in step (and
    ahead), and the replicas waiting in the lookup's host callback name it."""
    pytest.importorskip("jax", reason="popdist_lite.jax needs the [jax] extra (pip install '.[jax]')")
    err, delay, code = run_stalled(tmp_path, PROG_DIR / "jax_stall_prog.py")
    assert delay is not None and delay >= WARNING, err
    block = block_of(err)
    assert "replica 0 has waited" in block
    # the jax lane (the binding's communicator; only agreements take numbers, not the
    # all-to-alls after them). The collection's creation: #0 the feature specs'
    # agreement (EmbeddingCollection), then the core's TableCollection: #1 its configs
    # and fixed plan, #2 the planner's Topology.current (every replica's host, memory
    # and disk), #3 the plan, #4 the given initializer's checksum. Step 0's lookup: #5
    # its input agreement (EmbeddingCollection.lookup_in_jit), #6 the exchange's header
    # (embedding_lookup). Step 1's lookup starts with its input agreement, #7.
    assert ("in EmbeddingCollection.lookup_in_jit (collective call #7 on the jax lane) for replica 1, "
            "which did not enter it") in block, block
    assert "  missing: replica 1 (rank 1, host" in block
    assert "last entered embedding_lookup (collective call #6 on the jax lane)" in block, block
    assert "in stop_before_the_lookup" in block
    assert code == 1, err
    cause = block_of(err, "root cause: stall:")
    assert "in EmbeddingCollection.lookup_in_jit (collective call #7 on the jax lane) for replica 1" in cause


def test_replica_stuck_in_a_python_loop(tmp_path):
    err, delay, code = run_stalled(tmp_path, LOOP)
    assert delay is not None and delay >= WARNING, err
    assert code == 1 and "poprun-lite: job stalled (exit code 1)" in err, err
    block = block_of(err)
    assert "replica 0 has waited" in block
    assert "in all_gather (collective call #2) for replica 1, which did not enter it" in block
    assert "last entered broadcast (collective call #1)" in block
    assert "in spin_in_a_python_loop" in block


def test_replica_skipping_a_broadcast(tmp_path):
    err, delay, code = run_stalled(tmp_path, SKIP)
    assert delay is not None and delay >= WARNING, err
    assert code == 1 and "poprun-lite: job stalled (exit code 1)" in err, err
    block = block_of(err)
    assert "replica 0 has waited" in block
    assert "in broadcast (collective call #2) for replica 1, which did not enter it" in block
    assert "entered all_reduce as collective call #2 instead" in block
    assert "in skip_the_broadcast" in block


def test_replica_waiting_for_a_stuck_feeder(tmp_path):
    err, delay, code = run_stalled(tmp_path, FEEDER, "--feeders-per-replica", "1")
    assert delay is not None and delay >= WARNING, err
    assert code == 1 and "poprun-lite: job stalled (exit code 1)" in err, err
    block = block_of(err)
    # step 3: replica 0 entered the infeed's agreement #6; replica 1 last entered all_reduce #5
    assert "replica 0 has waited" in block
    assert "in infeed (collective call #6) for replica 1, which did not enter it" in block
    assert "last entered all_reduce (collective call #5)" in block
    assert "  Python stack of replica 1:" in block
    assert "  Python stack of feeder 0 of replica 1:" in block
    feeder_stack = block[block.index("Python stack of feeder 0 of replica 1"):]
    assert "in stuck_in_the_dataset" in feeder_stack


def test_replica_stopped_by_sigstop(tmp_path):
    """A replica that stopped itself (SIGSTOP) cannot dump its stack: the block says it is
    stopped (its agent read the state), the stall timeout ends the job, and the stopped
    process does not outlive it."""
    err, delay, code = run_stalled(tmp_path, STOP)
    pid = int((tmp_path / "stopped_pid").read_text())
    try:
        wait_for(lambda: not alive(pid), timeout=30, what=f"the stopped replica (pid {pid}) to end")
    finally:
        if alive(pid):  # our own test program, left stopped: SIGKILL ends it
            os.kill(pid, 9)
    assert delay is not None and delay >= WARNING, err
    block = block_of(err)
    assert "replica 0 has waited" in block
    assert "in all_reduce (collective call #2) for replica 1, which did not enter it" in block
    stopped = "  Python stack of replica 1: not available, stopped (state T)"
    assert stopped in block.splitlines(), block
    assert code == 1, err
    cause = block_of(err, "root cause: stall:")
    assert stopped in cause.splitlines(), cause
