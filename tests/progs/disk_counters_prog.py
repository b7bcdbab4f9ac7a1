"""A disk table's counters, for the tests that read them from outside the process
(tests/test_disk_progress.py: the progress slot; tests/launcher/test_disk_progress_record.py:
the agent's progress records).

    python tests/progs/disk_counters_prog.py DIR STEPS

One replica (``pl.init()``; under the agent or alone) trains two disk-backed tables,
"a" and "b" (500 x 8, SGD, a cache of 60 rows each, files in DIR), for STEPS steps of the
20 IDs ``20 * step ...``, each prefetched first (``ahead=0``); prints the tables'
``storage_stats`` summed, as one JSON line; makes one more call (``all_reduce``: a
progress record made after the last counters); and waits until DIR/go exists (the test
has read what it needs; a count of polls, not a clock), exiting 1 if it never does.
"""

import json
import os
import sys
import time

import numpy as np

import popdist_lite as pl

directory, steps = sys.argv[1], int(sys.argv[2])
pl.init()
tables = [pl.create_host_embedding(name, [500, 8], optimizer_spec=pl.HostEmbeddingOptimizerSpec(0.1),
                                   storage=pl.DiskStorage(40 * 60, directory=directory)) for name in ("a", "b")]
for step in range(steps):
    ids = np.arange(step * 20, step * 20 + 20) % 500
    for table in tables:
        table.prefetch(ids, ahead=0).wait(60)
        table.lookup(ids)
        table.apply_gradients(ids, np.ones((20, 8), np.float32))
stats = [t.storage_stats for t in tables]
print(json.dumps({k: sum(s[k] for s in stats) for k in stats[0]}), flush=True)
pl.all_reduce(np.ones(1))
for _ in range(6000):
    if os.path.exists(os.path.join(directory, "go")):
        break
    time.sleep(0.05)
else:
    sys.exit("the test never said go")
