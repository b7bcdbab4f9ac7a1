"""A disk table's counters in the progress records: a real child process (one replica,
no launcher: tests/progs/disk_counters_prog.py) trains disk-backed tables with
prefetch, its progress slot is read the way the poprun-lite agent reads it
(popdist_lite_launcher.node.rank_progress), and the
``progress`` record the agent makes from it passes the records' checks; hostile
``storage`` fields do not."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from popdist_lite import progress, records
from popdist_lite_launcher.node.rank_progress import RankProgress

from helpers import JOB_SECONDS

PROG = Path(__file__).parent / "progs" / "disk_counters_prog.py"
STEPS = 5


def test_disk_counters_reach_the_progress_record(tmp_path):
    rank = RankProgress()
    try:
        assert rank.read_storage() is None and rank.storage_fields() == {}  # nothing before a disk table
        child = subprocess.Popen([sys.executable, str(PROG), str(tmp_path), str(STEPS)],
                                 env={**os.environ, **rank.env()}, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, text=True, pass_fds=rank.fds())
        try:
            line = child.stdout.readline()
            assert line, "the child ended without its counters"
            want = json.loads(line)
            got = rank.read_storage()
            assert got is not None and set(got) == set(progress.STORAGE_FIELDS)
            for name in progress.STORAGE_FIELDS[:-1]:
                assert got[name] == want[name], name  # the sums over both tables
            assert got["wait_seconds"] == pytest.approx(want["wait_seconds"])
            assert got["prefetched_rows"] == 2 * STEPS * 20 and got["misses"] == 0 and got["hits"] > 0
            ident = records.identity(rank=0, replica=0, pid=child.pid)
            record = records.make("progress", ident, lane="main", call=5, op="all_reduce", since=1.0,
                                  **rank.storage_fields())
            decoded = json.loads(records.encode(record))
            assert records.validate(decoded, records.FROM_AGENT)["storage"] == got
        finally:
            (tmp_path / "go").write_text("")
            child.wait(JOB_SECONDS)
        assert child.returncode == 0
    finally:
        rank.close()


@pytest.mark.parametrize("storage", [
    {},  # fields missing
    {**dict.fromkeys(progress.STORAGE_FIELDS, 0), "extra": 1},
    {**dict.fromkeys(progress.STORAGE_FIELDS, 0), "hits": -1},
    {**dict.fromkeys(progress.STORAGE_FIELDS, 0), "misses": 1.5},
    {**dict.fromkeys(progress.STORAGE_FIELDS, 0), "wait_seconds": -0.5},
    {**dict.fromkeys(progress.STORAGE_FIELDS, 0), "rows_read": "7"},
    [0] * len(progress.STORAGE_FIELDS),
    None,
])
def test_hostile_storage_fields_are_refused(storage):
    base = records.make("progress", records.identity(rank=0, replica=0, pid=1), lane="main", call=1,
                        op="all_reduce", since=1.0)
    assert records.validate(dict(base), records.FROM_AGENT)  # without storage: as before
    good = {**base, "storage": {**dict.fromkeys(progress.STORAGE_FIELDS, 0), "wait_seconds": 0.25}}
    assert records.validate(good, records.FROM_AGENT)
    with pytest.raises(ValueError, match="storage"):
        records.validate({**base, "storage": storage}, records.FROM_AGENT)


def test_a_slot_with_bad_counters_reads_as_none():
    data = bytearray(progress.SLOT_SIZE)
    words = memoryview(data).cast("q")
    base = progress.STORAGE_OFFSET // 8
    words[base], words[base + 1] = 1, 5
    assert progress.read_storage(bytes(data))["hits"] == 5
    words[base + 2] = -3  # a negative count
    assert progress.read_storage(bytes(data)) is None
    words[base + 2] = 0
    memoryview(data).cast("d")[base + len(progress.STORAGE_FIELDS)] = float("nan")
    assert progress.read_storage(bytes(data)) is None
    assert progress.read_storage(bytes(data[:progress.STORAGE_OFFSET])) is None  # a short slot
