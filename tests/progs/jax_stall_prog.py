"""A JAX job under poprun-lite in which replica 1 stops before an in-jit lookup, for the
stall inspector's test (tests/launcher/test_stall_launch.py).

Usage: ``jax_stall_prog.py DIR``. The replicas meet at a barrier on files in DIR after
their imports. Step 0: every replica runs the jitted lookup (its host callback's
agreement and exchange on the JAX binding's communicator, the ``jax`` lane), then an
all_reduce on the replica communicator (the ``main`` lane, so the main lane is in step on
every replica and ahead of the jax lane's numbers). Step 1: replica 1 writes DIR/missing
and sleeps in ``stop_before_the_lookup``; the others wait for that file, replica 0
writes DIR/stall_start (the time it enters), and they run the lookup again, waiting in
its host callback for replica 1.
"""

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import popdist_lite as pl
import popdist_lite.jax as plj

DIR = sys.argv[1]


def wait_for_file(name: str) -> None:
    deadline = time.monotonic() + 240
    while not os.path.exists(os.path.join(DIR, name)):
        if time.monotonic() > deadline:
            sys.exit(f"no {name} after 240 s")
        time.sleep(0.01)


def stop_before_the_lookup() -> None:
    open(os.path.join(DIR, "missing"), "w").close()
    time.sleep(120)


pl.init()
me = pl.replica_id()
table = plj.TableSpec("t", 16, 4, initializer=np.arange(64, dtype=np.float32).reshape(16, 4))
coll = plj.EmbeddingCollection([plj.FeatureSpec("f", table, (3,), (3, 4))])
lookup = jax.jit(lambda h, ids: coll.lookup_in_jit(h, {"f": ids})["f"].sum())
ids = jnp.array([1, 2, 3 + me], dtype=jnp.int32)
open(os.path.join(DIR, f"ready-{me}"), "w").close()
for r in range(pl.num_replicas()):
    wait_for_file(f"ready-{r}")

for step in range(2):
    if step == 1:
        if me == 1:
            stop_before_the_lookup()
        wait_for_file("missing")
        if me == 0:
            with open(os.path.join(DIR, "stall_start"), "w") as f:
                f.write(repr(time.time()))
    total = float(lookup(coll.handle(), ids).block_until_ready())
    pl.all_reduce(np.array([total]))
