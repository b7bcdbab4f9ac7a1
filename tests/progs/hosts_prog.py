"""The program the multi-host launcher tests run on every rank (a file in the project,
since /tmp is private to each test host).

    python tests/progs/hosts_prog.py topology | feed | raise R | sigkill R | loop | wait DIR | detach R
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np

import popdist_lite as pl

what = sys.argv[1]
pl.init()
me = pl.replica_id()
host = socket.gethostname()

if what == "topology":
    print("TOPO " + json.dumps({"replica": me, "role": pl.role(), "host": host,
                                "local_instance_index": pl.local_instance_index(),
                                "num_replicas": pl.num_replicas()}), flush=True)
elif what == "feed":
    def make_dataset(shard, num_shards):
        # runs on the feeder: every batch says where it was made
        for step in range(3):
            yield {"host": np.frombuffer(socket.gethostname().encode().ljust(32), np.uint8),
                   "shard": np.array([shard, num_shards, step], np.int64)}

    got = [(bytes(b["host"]).decode().strip(), b["shard"].tolist()) for b in pl.infeed(make_dataset)]
    print("FEED " + json.dumps({"replica": me, "host": host, "got": got}), flush=True)
elif what in ("raise", "sigkill"):
    victim = int(sys.argv[2])
    pl.all_reduce(np.ones(4))
    if me == victim:
        if what == "raise":
            raise KeyError(f"boom on {host}")
        print(f"about to die on {host}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    # The others wait outside MPI until the job is stopped (beyond any test's --timeout):
    # inside a collective they would fail too, and such a consequence could reach the
    # launcher first and be named the root cause.
    time.sleep(600)
elif what == "loop":
    pl.all_reduce(np.ones(4))
    print(f"READY {me} {host}", flush=True)
    while True:
        pl.all_reduce(np.ones(4))
        time.sleep(0.05)
elif what == "wait":  # until DIR/go exists (DIR in the project: the hosts share it), 10 minutes at most
    go = os.path.join(sys.argv[2], "go")
    pl.all_reduce(np.ones(4))
    print(f"READY {me} {host} {os.getpid()}", flush=True)
    deadline = time.monotonic() + 600  # generous: the job's --timeout ends it first
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.05)
    pl.all_reduce(np.ones(4))
elif what == "detach":  # every rank leaves a process outside its session behind; replica R fails
    subprocess.Popen(["sleep", "300"], start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pl.all_reduce(np.ones(4))
    if me == int(sys.argv[2]):
        os._exit(3)  # dies without finalizing MPI, as a crash does
    # The others wait outside MPI until the job is stopped: inside a collective they would
    # fail too (the peer's socket closed), and on a busy machine such a consequence can
    # reach the launcher first and be named the root cause.
    time.sleep(600)
