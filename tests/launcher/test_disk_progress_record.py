"""A disk table's counters reach the launcher's collector: the real poprun-lite agent,
with the stall inspector on, runs a program that trains disk-backed tables with
prefetch (tests/progs/disk_counters_prog.py); the ``progress`` records the collector
receives carry the program's summed counters in their ``storage`` field (checked by
the collector like every field).
Every process runs under a timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import JOB_SECONDS, timeout_for
from peers import key_file, wait_for

from popdist_lite import progress, records
from popdist_lite_launcher.supervise.collector import Collector

PROG = Path(__file__).parents[1] / "progs" / "disk_counters_prog.py"
STEPS = 5


@timeout_for(1)
def test_progress_records_carry_the_disk_counters(tmp_path):
    with Collector(ranks=1) as collector:
        env = {**os.environ, records.COLLECTOR_ENV: collector.address, records.INSPECTOR_ENV: "1",
               **key_file(collector.key), "PMI_RANK": "0",
               "POPDIST_REPLICA_INDEX_OFFSET": "0", "POPDIST_LITE_ROLE": "replica"}
        proc = subprocess.Popen([sys.executable, "-m", "popdist_lite_launcher.node.agent", "--",
                                 sys.executable, str(PROG), str(tmp_path), str(STEPS)], env=env, text=True,
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
            assert final["prefetched_rows"] == 2 * STEPS * 20 and final["misses"] == 0
            (tmp_path / "go").write_text("")
            proc.wait(JOB_SECONDS)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
        assert collector.wait_closed(60)
        assert proc.returncode == 0
