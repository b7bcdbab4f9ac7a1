"""The partition file's reads and writes (popdist_lite/embedding/storage/rowfile.py)
against a numpy array holding the same records: scattered rows (one run each, issued
from the I/O threads), runs of consecutive rows, a call below PARALLEL_RUNS (one after
another), and a file cut short under the table, whose reads fail naming the rows and
the file whichever thread met it."""

import os
import re

import numpy as np
import pytest

from popdist_lite.embedding.storage import rowfile

RECORD = np.dtype([("weights", np.float32, (5,)), ("step", np.int64)])
ROWS = 3000


def stats():
    return dict.fromkeys(("rows_read", "rows_written", "bytes_read", "bytes_written", "disk_seconds"), 0)


def records(n, seed):
    rng = np.random.default_rng(seed)
    out = np.empty(n, RECORD)
    out["weights"] = rng.standard_normal((n, 5), dtype=np.float32)
    out["step"] = rng.integers(0, 1 << 40, n)
    return out


@pytest.fixture
def file(tmp_path):
    f = rowfile.RowFile(tmp_path, "t-", RECORD, ROWS, stats())
    yield f
    f.close()


@pytest.mark.parametrize("pick", ["scattered", "runs", "few"])
def test_reads_return_what_was_written(file, pick):
    rng = np.random.default_rng(1)
    reference = np.zeros(ROWS, RECORD)  # a new file reads as zeros
    file.write_range(0, reference)
    for round_ in range(3):
        if pick == "scattered":  # no two adjacent: one run per row, far above PARALLEL_RUNS
            rows = np.sort(rng.choice(ROWS // 2, 700, replace=False)) * 2
        elif pick == "runs":
            starts = np.sort(rng.choice(ROWS // 10, 60, replace=False)) * 10
            rows = np.unique(np.concatenate([np.arange(s, s + rng.integers(1, 9)) for s in starts]))
        else:
            rows = np.sort(rng.choice(ROWS, rowfile.PARALLEL_RUNS // 2, replace=False))
        new = records(len(rows), seed=round_)
        file.write(rows, new)
        reference[rows] = new
        ask = np.sort(rng.choice(ROWS, 900, replace=False))
        out = np.empty(len(ask), RECORD)
        file.read(ask, out)
        assert out.tobytes() == reference[ask].tobytes()
    whole = file.read_range(0, ROWS)
    assert whole.tobytes() == reference.tobytes()
    assert file.stats["rows_read"] == 3 * 900 + ROWS


def test_a_file_cut_short_fails_the_reads_naming_rows_and_file(file):
    file.write_range(0, records(ROWS, seed=2))
    os.ftruncate(file.fd, ROWS // 2 * RECORD.itemsize)  # the file has no name
    rows = np.arange(0, ROWS, 3)  # 1000 runs, half of them past the end
    with pytest.raises(rowfile.RowFileError, match=rf"short read of rows \d+\.\.\d+ of the partition file "
                                                   rf"{re.escape(file.name)}: 0 of {RECORD.itemsize} bytes"):
        file.read(rows, np.empty(len(rows), RECORD))
    assert file.stats["rows_read"] == 0  # a failed read counts nothing
