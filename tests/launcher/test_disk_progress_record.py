"""A disk table's counters reach the launcher's collector: the real poprun-lite agent,
with the stall inspector on, runs a program that trains disk-backed tables with
prefetch; the ``progress`` records the collector receives carry the program's summed
counters in their ``storage`` field (checked by the collector like every field).
Every process runs under a timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import JOB_SECONDS, timeout_for
from peers import key_file, wait_for

from popdist_lite import progress, records
from popdist_lite_launcher.collector import Collector

PROGRAM = """
import json, os, sys, time
import numpy as np
import popdist_lite as pl
pl.init()
tables = [pl.create_host_embedding(name, [500, 8], optimizer_spec=pl.HostEmbeddingOptimizerSpec(0.1),
                                   storage=pl.DiskStorage(40 * 60, directory=sys.argv[1])) for name in ("a", "b")]
for step in range(5):
    ids = np.arange(step * 20, step * 20 + 20)
    for table in tables:
        table.prefetch(ids, ahead=0).wait(60)
        table.lookup(ids)
        table.apply_gradients(ids, np.ones((20, 8), np.float32))
stats = [t.storage_stats for t in tables]
print(json.dumps({k: sum(s[k] for s in stats) for k in stats[0]}), flush=True)
pl.all_reduce(np.ones(1))  # one more call: a progress record made after the last counters
for _ in range(6000):  # until the test has seen the record (a count of polls, not a clock)
    if os.path.exists(os.path.join(sys.argv[1], "go")):
        break
    time.sleep(0.05)
else:
    sys.exit("the test never said go")
"""


@timeout_for(1)
def test_progress_records_carry_the_disk_counters(tmp_path):
    with Collector(ranks=1) as collector:
        env = {**os.environ, records.COLLECTOR_ENV: collector.address, records.INSPECTOR_ENV: "1",
               **key_file(collector.key), "PMI_RANK": "0",
               "POPDIST_REPLICA_INDEX_OFFSET": "0", "POPDIST_LITE_ROLE": "replica"}
        proc = subprocess.Popen([sys.executable, "-m", "popdist_lite_launcher.agent", "--",
                                 sys.executable, "-c", PROGRAM, str(tmp_path)], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            line = proc.stdout.readline()
            assert line, proc.stderr.read() if proc.poll() is not None else "no counters from the program"
            want = json.loads(line)

            def carried():
                return [r["storage"] for r in collector.records("progress") if "storage" in r]

            wait_for(lambda: any(s["rows_read"] == want["rows_read"] for s in carried()), timeout=JOB_SECONDS,
                     what="a progress record with the final disk counters")
            final = next(s for s in carried() if s["rows_read"] == want["rows_read"])
            assert set(final) == set(progress.STORAGE_FIELDS)
            for name in progress.STORAGE_FIELDS[:-1]:
                assert final[name] == want[name], name
            assert abs(final["wait_seconds"] - want["wait_seconds"]) < 1e-9
            assert final["prefetched_rows"] == 2 * 5 * 20 and final["misses"] == 0
            (tmp_path / "go").write_text("")
            proc.wait(JOB_SECONDS)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
        assert collector.wait_closed(60)
        assert proc.returncode == 0
