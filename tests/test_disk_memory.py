"""Resident memory of a disk table bounded, shown by the kernel: a 2-replica job trains a
DiskStorage table inside a memory cgroup (cgroup v1) whose limit is a quarter of the
table's bytes (rows and Adam state across the replicas) plus ``OVERHEAD`` for the
processes themselves; it is not OOM-killed, and its final state (every array's bytes,
every lookup) equals the same steps of the in-memory table run outside the cgroup. The
in-memory table run inside the same cgroup is OOM-killed: the limit bites.

The page cache is charged to the cgroup (v1), and the kernel reclaims clean file pages
when the limit is reached, so "not OOM-killed" alone would not show that the file's pages
are kept in check: the cgroup's memory (processes and page cache) must also never have
reached the limit while training (memory.max_usage_in_bytes, reset by the job once both
replicas created the table and read once both have trained, below it; memory.failcnt 0).
What keeps the file's pages down is the table's advice (docs/offload.md, "The page
cache"). Outside that window the kernel's reclaim under the limit is what bounds the
file's pages: while the table is created (the memory maps' read-around of the pages they
write, and the initializer's blocks, reached about 165 MiB unlimited here) and in the
job's final read of its state through the maps (the hashes), which faults in the whole
partition's pages like a checkpoint save. No checkpoint is saved. That read needs room
beside the processes' anonymous memory for the pages it faults in: ``state()`` writes
the cache back in parts (``test_a_flush_writes_the_dirty_rows_back_in_parts``), so that
it leaves no copy of the cache in the heap (docs/offload.md, "Resident memory").
"""

import errno
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from helpers import JOB_SECONDS, ROOT, mpirun_command, timeout_for

PROG = str(ROOT / "tests" / "progs" / "disk_memory_prog.py")
V1 = Path("/sys/fs/cgroup/memory")
ROWS, COLS = 196608, 64
#: Bytes of the table: float32 rows, Adam's m and v (float32, like the rows) and its
#: per-row int64 step count (tests/progs/disk_memory_prog.py's table).
TABLE_BYTES = ROWS * (COLS * 4 * 3 + 8)
#: Bytes charged to the job's cgroup by everything but the table: mpirun, two Python
#: ranks with numpy and mpi4py (Open MPI), their shared memory, the page cache they
#: fault in. Measured on this machine (Open MPI 5, Python 3.11): the in-memory job with a
#: 1,024-row table peaks at 79 MiB (memory.max_usage_in_bytes); 17 MiB more for each
#: step's buffers and the allocator's slack. The table (145 MiB) is larger than the limit.
OVERHEAD = 96 << 20
LIMIT = TABLE_BYTES // 4 + OVERHEAD
#: Each replica's cache: a tenth of its partition, well under the limit.
CACHE_BYTES = TABLE_BYTES // 2 // 10


def _own_cgroup() -> Path | None:
    """This process's cgroup in the v1 memory hierarchy, or None."""
    if not (V1 / "memory.limit_in_bytes").exists():
        return None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            here = V1 / path.lstrip("/")
            return here if here.is_dir() else None
    return None


def _on_tmpfs(path: Path) -> bool:
    """Whether ``path`` is on a tmpfs (whose pages the cgroup could not reclaim)."""
    best, fstype = "", ""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, right = line.split(" - ", 1)
        mount = left.split()[4]
        if str(path).startswith(mount.rstrip("/") + "/") and len(mount) > len(best):
            best, fstype = mount, right.split()[0]
    return fstype == "tmpfs"


@pytest.fixture
def cgroup():
    """A child memory cgroup of this process's, with the limit above and no swap; removed
    afterwards (its remaining processes, which only the test's jobs can be, killed first)."""
    parent = _own_cgroup()
    if os.geteuid() != 0 or parent is None:
        pytest.skip("needs root and the cgroup v1 memory controller (/sys/fs/cgroup/memory)")
    group = parent / f"popdist-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(LIMIT))
        if (group / "memory.memsw.limit_in_bytes").exists():
            (group / "memory.memsw.limit_in_bytes").write_text(str(LIMIT))
        (group / "memory.swappiness").write_text("0")
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                pass
        for _ in range(100):  # rmdir fails while a killed process is still exiting
            try:
                group.rmdir()
                break
            except OSError:
                subprocess.run(["sleep", "0.1"])


def _oom_kills(group: Path) -> int:
    for line in (group / "memory.oom_control").read_text().splitlines():
        key, value = line.split()
        if key == "oom_kill":
            return int(value)
    raise AssertionError("memory.oom_control has no oom_kill line")


def _run(args: list[str], group: Path | None) -> subprocess.CompletedProcess:
    """``mpirun -n 2 PROG args`` under a timeout, in ``group`` (its launcher's pid is
    written to the cgroup before exec, so the ranks are born in it) or outside any."""
    def enter():
        (group / "cgroup.procs").write_text(str(os.getpid()))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.Popen(mpirun_command(2, [sys.executable, PROG, *args]), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT, start_new_session=True,
                            preexec_fn=enter if group is not None else None)
    try:
        out, _ = proc.communicate(timeout=JOB_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"{args} hung for {JOB_SECONDS} s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


@timeout_for(3)
def test_disk_table_trains_in_a_quarter_of_its_bytes(cgroup, tmp_path):
    if _on_tmpfs(tmp_path):
        pytest.skip(f"{tmp_path} is a tmpfs: the partition files need a disk")
    out = tmp_path / "out"
    out.mkdir()
    files = tmp_path / "rows"
    rows, cols = str(ROWS), str(COLS)

    r = _run(["disk", str(out), rows, cols, str(CACHE_BYTES), str(files), str(cgroup)], cgroup)
    peak, failcnt, kills = int((cgroup / "memory.max_usage_in_bytes").read_text()), \
        int((cgroup / "memory.failcnt").read_text()), _oom_kills(cgroup)
    print(f"table {TABLE_BYTES} B, limit {LIMIT} B, cache {CACHE_BYTES} B per replica: "
          f"peak {peak} B, failcnt {failcnt}, oom_kill {kills}")
    assert kills == 0 and r.returncode == 0, f"disk job: exit {r.returncode}, oom_kill {kills}:\n{r.stdout[-4000:]}"
    trained = json.loads((out / "disk.r0.json").read_text())["trained"]
    print(f"after training: peak {trained['max_usage']} B, failcnt {trained['failcnt']}")
    assert trained["max_usage"] < LIMIT and trained["failcnt"] == 0, \
        f"the job reached the cgroup's limit {LIMIT} B while training: {trained}"
    assert not any(files.iterdir()), "the partition files were left behind"

    r = _run(["memory", str(out), rows, cols], None)
    assert r.returncode == 0, r.stdout[-4000:]
    for k in range(2):
        disk = json.loads((out / f"disk.r{k}.json").read_text())
        memory = json.loads((out / f"memory.r{k}.json").read_text())
        stats = disk.pop("storage_stats")
        disk.pop("trained", None)
        assert disk == memory, f"replica {k}: the disk table's state differs from the in-memory table's"
        assert stats["evictions"] > 0 and stats["rows_read"] > 0, stats  # rows went to the file and back

    # The limit bites: the in-memory table does not fit in the same cgroup.
    r = _run(["memory", str(tmp_path), rows, cols], cgroup)
    assert r.returncode != 0 and _oom_kills(cgroup) > 0, f"the in-memory table fit under {LIMIT} B:\n{r.stdout[-2000:]}"


def test_a_flush_writes_the_dirty_rows_back_in_parts(tmp_path, monkeypatch):
    """``sync()`` (``state()``, a checkpoint) writes the cache's dirty rows back in parts of
    ``cache.WRITE_BACK_BYTES`` of records, so that the copy of the records and the file's
    scratch buffer stay that small, not twice the cache; a part that fails to be written
    leaves its rows and the rest dirty, and the next sync writes them. One process, the
    file's bytes against a numpy reference."""
    from mpi4py import MPI

    from popdist_lite.embedding.storage import DiskStorage, cache
    from popdist_lite.embedding.storage.cache import SLOT_OVERHEAD
    from popdist_lite.embedding.storage.disk import DiskRows

    rows, cols, capacity, part = 64, 4, 12, 5
    monkeypatch.setattr(cache, "WRITE_BACK_BYTES", part * cols * 4)
    table = DiskRows("t", 0, (rows, cols), np.float32, None,
                     DiskStorage(cache_bytes=capacity * (cols * 4 + SLOT_OVERHEAD), directory=tmp_path))
    try:
        assert table.cache.capacity == capacity
        reference = np.zeros((rows, cols), np.float32)
        touched = np.arange(3, 3 + capacity, dtype=np.int64)
        delta = np.random.default_rng(0).standard_normal((capacity, cols), dtype=np.float32)
        table.update(touched, lambda weights, state: (np.arange(capacity), weights + delta), MPI.COMM_SELF)
        reference[touched] += delta

        write, calls = table.file.write, []

        def counted(at, records, count=True):
            calls.append(len(at))
            if len(calls) == 2:
                raise OSError(errno.ENOSPC, "No space left on device (a test's)")
            return write(at, records, count)

        table.file.write = counted
        with pytest.raises(OSError, match="a test's"):
            table.sync()
        assert calls == [part, part], calls
        assert int(np.count_nonzero(table.cache.dirty)) == capacity - part  # the first part only was written
        table.sync()
        assert calls == [part, part, part, capacity - 2 * part], calls
        assert not table.cache.dirty.any()
        np.testing.assert_array_equal(table.file.read_range(0, rows)["weights"], reference)
    finally:
        table.close()
