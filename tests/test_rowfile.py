"""The partition file's reads and writes (popdist_lite/embedding/storage/rowfile.py)
against a numpy array holding the same records: scattered rows (one run each, issued
from the I/O threads), runs of consecutive rows, a call below PARALLEL_RUNS (one after
another), and a file cut short under the table, whose reads fail naming the rows and
the file whichever thread met it. Where the file is made: a directory every user may
write to without the sticky bit, or one owned by another user, is refused, naming the
directory and why, and nothing is made in it (with the sticky bit, as /tmp, it is
taken); the file has no name in its directory, made with O_TMPFILE or the
create-then-unlink way of filesystems without it, nor can it be given one through
/proc/self/fd; the memory map the table's state, checkpoints and loads go through is a
map of the same descriptor as the cache's reads and writes, and nothing of the file is
left open once it is closed. (Other users and processes: tests/test_disk_files.py.)"""

import os
import re

import numpy as np
import pytest

from popdist_lite.embedding.storage import rowfile

RECORD = np.dtype([("weights", np.float32, (5,)), ("step", np.int64)])
ROWS = 3000
OTHER_UID = 54321  # a user that is not this process's (nor root)


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


def test_directory_every_user_may_write_without_the_sticky_bit_is_refused(tmp_path):
    directory = tmp_path / "open"
    directory.mkdir()
    directory.chmod(0o777)
    with pytest.raises(PermissionError, match=r"refused as the directory for partition files: every user may "
                                              r"write to it \(mode 0777\) and it has no sticky bit") as info:
        rowfile.RowFile(directory, "popdist-t-r0-", RECORD, ROWS, stats())
    assert info.value.filename == str(directory)
    assert os.listdir(directory) == []
    directory.chmod(0o1777)  # with the sticky bit (as /tmp): only a file's owner may rename it
    rowfile.RowFile(directory, "popdist-t-r0-", RECORD, ROWS, stats()).close()


def test_directory_of_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    directory = tmp_path / "theirs"
    directory.mkdir(mode=0o755)
    os.chown(directory, OTHER_UID, OTHER_UID)
    with pytest.raises(PermissionError, match=rf"refused as the directory for partition files: it belongs to "
                                              rf"(\S+ \()?uid {OTHER_UID}\)?, not to this user") as info:
        rowfile.RowFile(directory, "popdist-t-r0-", RECORD, ROWS, stats())
    assert info.value.filename == str(directory)
    assert os.listdir(directory) == []


@pytest.mark.parametrize("tmpfile", [True, False], ids=["O_TMPFILE", "create-then-unlink"])
def test_the_file_has_no_name_and_its_map_is_of_the_same_file(tmp_path, monkeypatch, tmpfile):
    if not tmpfile:
        monkeypatch.setattr(rowfile, "TMPFILE", None)
    elif rowfile.TMPFILE is None:
        pytest.skip("no O_TMPFILE on this platform")
    file = rowfile.RowFile(tmp_path, "popdist-t-r0-", RECORD, ROWS, stats())
    try:
        assert os.listdir(tmp_path) == [] and os.fstat(file.fd).st_nlink == 0
        here = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
        try:  # nor can it be given one (O_TMPFILE | O_EXCL, or unlinked): linkat(..., AT_SYMLINK_FOLLOW)
            with pytest.raises(FileNotFoundError):
                os.link(f"/proc/self/fd/{file.fd}", "named", src_dir_fd=here, dst_dir_fd=here, follow_symlinks=True)
        finally:
            os.close(here)
        reference = records(ROWS, seed=1)
        file.write_range(0, reference)
        mapped = file.map()
        assert mapped.tobytes() == reference.tobytes()  # the descriptor's writes, seen through the map
        changed = records(7, seed=2)
        mapped[100:107] = changed
        reference[100:107] = changed
        file.release_map()
        assert file.read_range(0, ROWS).tobytes() == reference.tobytes()  # the map's writes, read by the descriptor
        del mapped
        file.close()
        assert not [path for path in _open_files() if path.startswith(f"{tmp_path}/")]  # its blocks are freed
    finally:
        file.close()


def _open_files():
    """The targets of this process's descriptors (a map keeps one too)."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            yield os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # listdir's own descriptor
            pass
