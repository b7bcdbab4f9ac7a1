"""Open MPI's session directories left by killed mpiruns (popdist_lite_launcher.launch.session_dirs):
which ones are removed and which are kept, and, end to end as root, that a job whose
mpirun gets the PID of an earlier, killed one runs (plain mpirun fails there with "The
PMIx server's listener thread failed to start"). The PIDs are steered through
``/proc/sys/kernel/ns_last_pid`` over a range of planted directories, so the test does
not depend on which PID the job's mpirun gets. Every job runs under a timeout."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import JOB_SECONDS, mpirun_command, timeout_for

from popdist_lite_launcher.launch import session_dirs

LAUNCHER = [sys.executable, "-m", "popdist_lite_launcher"]
NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")
#: How many consecutive PIDs get a planted stale directory (more than the processes a
#: launcher, or the rest of the machine, starts before the job's mpirun).
PLANTED = 400
#: A file in every planted directory: one found later was never removed (a directory of
#: the same name without it was made afresh, by the job).
PLANTED_MARK = "planted-by-the-test"


def test_base_follows_prrte_then_the_temporary_directory_variables():
    assert session_dirs.base({}) == "/tmp"
    assert session_dirs.base({"TMP": "/c", "TEMP": "/b"}) == "/b"
    assert session_dirs.base({"TMP": "/c", "TMPDIR": "/a"}) == "/a"
    assert session_dirs.base({"TMPDIR": "/a", "PRTE_MCA_prte_tmpdir_base": "/p"}) == "/p"


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_removes_the_directories_of_dead_prteruns_only(tmp_path):
    env = {"TMPDIR": str(tmp_path)}
    dead = _dead_pid()
    (tmp_path / f"ompi.{dead}" / "1" / "0").mkdir(parents=True)
    (tmp_path / f"ompi.{dead}" / "pmix.vm.tool").write_text("stale")
    (tmp_path / f"prte.{dead}").mkdir()
    (tmp_path / f"prted.{dead}").mkdir()
    # a live process that is not Open MPI's runtime: its PID's directory is stale too
    (tmp_path / f"ompi.{os.getpid()}").mkdir()
    # names that are not a session directory, and a file with a session directory's name
    for name in ("ompi.vm.0", "ompi.12x", "ompi.", "other.1"):
        (tmp_path / name).mkdir()
    (tmp_path / "ompi.1").write_text("a file")
    fake = tmp_path / "bin" / "prterun"
    fake.parent.mkdir()
    shutil.copy("/bin/sleep", fake)
    live = subprocess.Popen([str(fake), "60"])
    try:
        # the kernel names the process after its exec, which Popen may return before
        comm = Path(f"/proc/{live.pid}/comm")
        deadline = time.monotonic() + JOB_SECONDS
        while comm.read_text().strip() != "prterun":
            assert time.monotonic() < deadline, comm.read_text()
            time.sleep(0.01)
        (tmp_path / f"ompi.{live.pid}").mkdir()
        removed = session_dirs.remove_stale(env)
        assert sorted(removed) == sorted(str(tmp_path / n) for n in (f"ompi.{dead}", f"prte.{dead}",
                                                                       f"prted.{dead}", f"ompi.{os.getpid()}"))
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == sorted(["bin", "ompi.1", "ompi.", "ompi.12x", "ompi.vm.0", "other.1", f"ompi.{live.pid}"])
    finally:
        live.kill()
        live.wait()
    assert session_dirs.remove_stale(env) == [str(tmp_path / f"ompi.{live.pid}")]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_another_users_directory_is_left(tmp_path):
    dead = _dead_pid()
    other = tmp_path / f"ompi.{dead}"
    other.mkdir()
    os.chown(other, 65534, 65534)
    assert session_dirs.remove_stale({"TMPDIR": str(tmp_path)}) == []
    assert session_dirs.remove(dead, {"TMPDIR": str(tmp_path)}) is False
    assert other.is_dir()


def test_remove_takes_one_ended_prteruns_directory(tmp_path):
    dead = _dead_pid()
    (tmp_path / f"ompi.{dead}" / "0").mkdir(parents=True)
    (tmp_path / f"prtrn.{dead}").mkdir()
    (tmp_path / f"ompi.{dead + 1}").mkdir()
    assert session_dirs.remove(dead, {"TMPDIR": str(tmp_path)}) is True
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"ompi.{dead + 1}"]
    assert session_dirs.remove(dead, {"TMPDIR": str(tmp_path)}) is False


def _killed_mpiruns_directory(tmp_path: Path) -> Path:
    """The session directory a SIGKILLed mpirun leaves (a real one, made by Open MPI)."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([*mpirun_command(1, [sys.executable, "-c", "import time; time.sleep(300)"])],
                            env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    made = tmp_path / f"ompi.{proc.pid}"
    try:
        deadline = time.monotonic() + JOB_SECONDS
        while not any(made.glob("pmix.*")):
            assert proc.poll() is None and time.monotonic() < deadline, "mpirun made no session directory"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert made.is_dir()
    return made


def _plant(stale: Path) -> tuple[int, list[Path]]:
    """Copies of ``stale`` for PLANTED consecutive free PIDs; returns the first one."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    first = int(NS_LAST_PID.read_text()) + 2000
    if first + PLANTED >= pid_max:
        first = 1000
    planted = []
    for pid in range(first, first + PLANTED):
        target = stale.with_name(f"ompi.{pid}")
        if Path(f"/proc/{pid}").exists() or target.exists():
            continue
        shutil.copytree(stale, target, symlinks=True)
        for path in target.iterdir():
            old = str(stale.name.split(".")[1])
            if old in path.name:
                path.rename(path.with_name(path.name.replace(old, str(pid))))
        (target / PLANTED_MARK).write_text("planted by the test")
        planted.append(target)
    return first, planted


def _what_runs(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError as exc:
        return repr(exc)


def _next_pid(first: int) -> None:
    NS_LAST_PID.write_text(str(first - 1))


@pytest.mark.skipif(os.geteuid() != 0 or not NS_LAST_PID.exists(),
                    reason="steering PIDs needs root and /proc/sys/kernel/ns_last_pid")
@timeout_for(3)
def test_a_job_whose_mpirun_gets_a_killed_ones_pid_runs(tmp_path):
    if "Open MPI" not in subprocess.run([mpirun_command(1, [])[0], "--version"], capture_output=True,
                                        text=True, timeout=30).stdout:
        pytest.skip("the session directories are Open MPI's")
    stale = _killed_mpiruns_directory(tmp_path)
    env = {**os.environ, "TMPDIR": str(tmp_path)}

    # plain mpirun, given a PID with a stale directory, fails: what the launcher prevents
    first, planted = _plant(stale)
    cmd = mpirun_command(1, ["true"])  # sweeps /tmp, not this TMPDIR
    _next_pid(first)
    plain = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=JOB_SECONDS)
    assert plain.returncode != 0 and "listener thread failed to start" in plain.stdout + plain.stderr, \
        (plain.returncode, plain.stdout, plain.stderr)

    first, planted = _plant(stale)
    _next_pid(first)
    job = subprocess.run([*LAUNCHER, "--timeout", str(JOB_SECONDS), "--num-replicas", "2", sys.executable, "-c",
                          "import popdist_lite as pl; pl.init(); print('replica', pl.replica_id(), 'ok')"],
                         env=env, capture_output=True, text=True, timeout=JOB_SECONDS + 60, stdin=subprocess.DEVNULL)
    assert job.returncode == 0, job.stderr
    assert sorted(job.stdout.splitlines()) == ["replica 0 ok", "replica 1 ok"]
    left = [path.name for path in planted if (path / PLANTED_MARK).exists()]
    assert not left, [(name, _what_runs(int(name.split(".")[1]))) for name in left]
    assert not list(tmp_path.glob("ompi.*")), "the job's own session directory is gone too"
