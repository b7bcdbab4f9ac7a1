"""Who can reach a disk table's partition file (popdist_lite/embedding/storage/rowfile.py;
the refused directories and the file's lack of a name: tests/test_rowfile.py), with a
second user (``nobody``, as root) where a test needs one:

- another user in a group-writable directory, asked to swap the file for one of theirs
  whenever the table's process opens or removes a partition file by its name (had it
  one, the table's state and checkpoints would then go through the other user's file),
  finds nothing to swap: the table trains, saves and loads the values of an in-memory
  twin;
- a process killed with SIGKILL leaves nothing in the directory;
- a forked child's exit removes nothing, and the parent's table keeps its rows.

The processes that make tables here do not initialise MPI where they are killed or
fork (a forked child cannot finalise MPI): they use the partition's storage
(``DiskRows``) directly, as the table does.
"""

import os
import pwd
import signal
import subprocess
import sys
import tempfile

import pytest

from helpers import JOB_SECONDS, ROOT, clean_env, run_python, timeout_for
from popdist_lite.embedding.storage import rowfile

pytestmark = timeout_for(1)

def nobody():
    """The unprivileged user a test acts as, or a skip with the reason."""
    if os.geteuid() != 0:
        pytest.skip("acting as a second user needs root")
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' on this machine")


# The other user (a shell, which it can run): for each line (a path), renames that file
# away and puts a file of theirs at its name, mode 0666 and as long, full of 0x7f bytes;
# "ls DIR" counts the entries of DIR.
OTHER = r"""
umask 0
while IFS= read -r line; do
    case "$line" in
        "ls "*) ls -A "${line#ls }" | wc -l; continue ;;
    esac
    size=$(stat -c %s "$line")
    mv "$line" "$line.theirs"
    head -c "$size" /dev/zero | tr '\0' '\177' > "$line"
    echo swapped
done
"""

# The table's process: an audit hook sends the other user every partition file the table
# opens or removes by its name (when it exists), before the call; then the disk table and
# an in-memory twin train, save and load, and must agree.
TABLE = r"""
import os, subprocess, sys
import numpy as np
import popdist_lite as pl

directory, checkpoints, other_code, uid, gid = {args!r}
other = subprocess.Popen(["/bin/sh", "-c", other_code], user=uid, group=gid, extra_groups=[],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
busy = []

def ask(line):
    other.stdin.write(line + "\n")
    other.stdin.flush()
    return other.stdout.readline().strip()

def hook(event, args):
    if busy or event not in ("open", "os.remove") or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    path = os.fsdecode(args[0])
    path = path if os.path.isabs(path) else os.path.join(directory, path)
    if os.path.dirname(path) == directory and os.path.basename(path).startswith("popdist-") \
            and os.path.exists(path):
        busy.append(path)
        print("swapped", path, ask(path), flush=True)

sys.addaudithook(hook)
pl.init()
T, E = 300, 4
spec = pl.HostEmbeddingAdamOptimizerSpec(0.05, beta1=0.9, beta2=0.99, epsilon=1e-8)
memory = pl.create_host_embedding("m", [T, E], optimizer_spec=spec, seed=5)
disk = pl.create_host_embedding("m", [T, E], optimizer_spec=spec, seed=5,
                                storage=pl.DiskStorage(40 * 200, directory=directory))
print("the other user sees", ask("ls " + directory), flush=True)
rng = np.random.default_rng(2)

def same(a, b):
    x, y = a.state().arrays, b.state().arrays
    return sorted(x) == sorted(y) and all(np.asarray(x[k]).tobytes() == np.asarray(y[k]).tobytes() for k in x)

for step in range(12):
    ids = rng.integers(0, T, 32)
    grads = rng.standard_normal((32, E)).astype(np.float32)
    assert memory.lookup(ids).tobytes() == disk.lookup(ids).tobytes(), step
    memory.apply_gradients(ids, grads)
    disk.apply_gradients(ids, grads)
assert same(memory, disk), "state() after training"
path = pl.save_checkpoint(checkpoints, {{"emb": disk}}, step=1)
again = pl.create_host_embedding("m", [T, E], optimizer_spec=spec, seed=9,
                                 storage=pl.DiskStorage(40 * 200, directory=directory))
pl.load_checkpoint(path, {{"emb": again}})
assert same(memory, again), "a disk table loaded from the disk table's checkpoint"
print("OK", flush=True)
other.stdin.close()
other.wait(60)
"""


def test_another_user_has_no_file_to_swap(tmp_path):
    """The directory is the other user's group's and group-writable (taken: the file has
    no name a member could reach; without the sticky bit, a member may rename any file
    in it)."""
    other = nobody()
    if rowfile.TMPFILE is None:
        pytest.skip("no O_TMPFILE on this platform: the file has a name for a moment")
    directory = tempfile.mkdtemp(prefix="popdist-test-shared-")  # in /tmp: the other user can reach it
    try:
        os.chown(directory, 0, other.pw_gid)
        os.chmod(directory, 0o770)
        code = TABLE.format(args=(directory, str(tmp_path / "ckpt"), OTHER, other.pw_uid, other.pw_gid))
        result = run_python(code)
        assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr
        assert "swapped" not in result.stdout, result.stdout  # no file was ever opened or removed by its name
        assert "the other user sees 0" in result.stdout, result.stdout
    finally:
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)


# A process with a table's partition (DiskRows, as the table makes it; MPI not initialised).
PARTITION = r"""
import os, sys
import mpi4py
mpi4py.rc.initialize = mpi4py.rc.finalize = False
import numpy as np
from popdist_lite.embedding.storage import DiskStorage
from popdist_lite.embedding.storage.disk import DiskRows
import popdist_lite as pl

directory = {directory!r}
spec = pl.HostEmbeddingAdamOptimizerSpec(0.05, beta1=0.9, beta2=0.99, epsilon=1e-8)
rows = DiskRows("t", 0, (2048, 8), np.float32, spec, DiskStorage(1 << 14, directory=directory))
want = np.random.default_rng(1).standard_normal((2048, 8), dtype=np.float32)
rows.weights[:] = want
rows.sync()


def served():
    # every row as a lookup serves it (64 at a time: the cache holds 129)
    out = []
    for first in range(0, 2048, 64):
        out.append(rows.take(np.arange(first, first + 64), np.float32))
        rows.unpin()
    assert rows.problem is None, rows.problem
    return np.concatenate(out)
"""


def test_a_killed_process_leaves_no_file(tmp_path):
    code = PARTITION.format(directory=str(tmp_path)) + r"""
print(rows.file.fd, flush=True)
sys.stdin.read()
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env=clean_env())
    try:
        fd = proc.stdout.readline().strip()
        assert fd.isdigit(), proc.communicate(timeout=JOB_SECONDS)
        assert os.readlink(f"/proc/{proc.pid}/fd/{fd}").startswith(f"{tmp_path}/")  # the file is in that directory
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(JOB_SECONDS) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait(JOB_SECONDS)
    assert os.listdir(tmp_path) == []


def test_a_forked_childs_exit_removes_nothing(tmp_path):
    (tmp_path / "other.rows").write_bytes(b"x")  # the directory's own file, listed before and after
    code = PARTITION.format(directory=str(tmp_path)) + r"""
before = sorted(os.listdir(directory))
pid = os.fork()
if pid == 0:  # a worker forked from the training process uses the table, then exits as Python does
    sys.exit(0 if served().tobytes() == want.tobytes() else 3)
assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
after = sorted(os.listdir(directory))
assert after == before, (before, after)
assert served().tobytes() == want.tobytes()
rows.sync()
assert rows.weights.tobytes() == want.tobytes()
print("OK")
"""
    result = run_python(code)
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr
    assert os.listdir(tmp_path) == ["other.rows"]
