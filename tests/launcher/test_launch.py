"""Integration tests: the real ``poprun-lite`` (``python -m popdist_lite_launcher``)
over the installed Open MPI, with small programs written to tmp_path.

Every subprocess runs under a timeout (subprocess's and the launcher's own
``--timeout``), so a hang fails one test, never the suite.
"""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from popdist_lite_launcher import __version__
from popdist_lite_launcher.launch import mpirun
from popdist_lite_launcher.supervise.collector import Collector
from helpers import JOB_SECONDS, ROOT, timeout_for
from peers import alive, wait_for

pytestmark = timeout_for(1)

LAUNCHER = [sys.executable, "-m", "popdist_lite_launcher"]


def launch(*args, timeout=JOB_SECONDS + 60, env=None, job_timeout=JOB_SECONDS):
    """Run poprun-lite with ``args``; the job itself is limited to ``job_timeout`` s (a
    subprocess timeout above it, so the launcher's own timeout, with its report, fires first)."""
    return subprocess.run([*LAUNCHER, "--timeout", str(job_timeout), *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)


def program(tmp_path, name, code):
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return [sys.executable, str(path)]


# ---------------------------------------------------------------- topology

ENV_DUMP = """
    import json, os, sys
    info = {k: v for k, v in os.environ.items()
            if k.startswith(("POPDIST", "POPRUN", "OMP_", "OPENBLAS_", "MKL_"))}
    if "--mpi" in sys.argv:
        from mpi4py import MPI
        info["size"], info["rank"] = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    print("ENV " + json.dumps(info), flush=True)
"""


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_topology_env_per_rank(tmp_path, n):
    # 4 ranks on this 2-core machine need oversubscription; check MPI sees them all
    extra = ["--mpi"] if n == 4 else []
    env = {"OMP_NUM_THREADS": "3"} if n == 2 else {}
    proc = launch("--num-replicas", str(n), *program(tmp_path, "env.py", ENV_DUMP), *extra,
                  env=env)
    assert proc.returncode == 0, proc.stderr
    infos = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ENV ")]
    assert len(infos) == n
    infos.sort(key=lambda d: int(d["POPDIST_REPLICA_INDEX_OFFSET"]))
    for i, info in enumerate(infos):
        assert info["POPDIST_NUM_TOTAL_REPLICAS"] == str(n)
        assert info["POPDIST_NUM_IPUS_PER_REPLICA"] == "1"
        assert info["POPDIST_NUM_LOCAL_REPLICAS"] == "1"
        assert info["POPDIST_UNIFORM_REPLICAS_PER_INSTANCE"] == "1"
        assert info["POPDIST_REPLICA_INDEX_OFFSET"] == str(i)
        assert info["POPDIST_LOCAL_INSTANCE_INDEX"] == str(i)
        assert info["POPDIST_LITE_ROLE"] == "replica"
        assert info["POPRUN_LITE_COLLECTOR"] == infos[0]["POPRUN_LITE_COLLECTOR"]
        assert info["POPRUN_LITE_COLLECTOR"].startswith("127.0.0.1:")
        assert info["POPDIST_LITE_RECORD_FD"].isdigit()  # the socket to its agent
        assert info["OMP_NUM_THREADS"] == ("3" if n == 2 else "1")
        assert info["OPENBLAS_NUM_THREADS"] == info["MKL_NUM_THREADS"] == "1"
        if n == 4:
            assert (info["size"], info["rank"]) == (4, i)
    assert proc.stderr == ""  # success: nothing extra


def test_print_topology_verbose_and_tag_output(tmp_path):
    proc = launch("--num-replicas", "2", "--print-topology", "-v", "--tag-output",
                  *program(tmp_path, "hi.py", "print('hi', flush=True)\n"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["replica", "instance", "rank", "host", "role"]
    assert lines[1].split()[:3] == ["0", "0", "0"] and lines[2].split()[:3] == ["1", "1", "1"]
    assert sorted(lines[3:]) == ["[1,0]<stdout>: hi", "[1,1]<stdout>: hi"]
    cmd = shlex.split(proc.stderr.splitlines()[0])
    assert os.path.basename(cmd[0]) in ("mpirun", "mpiexec")
    assert cmd.count("-np") == 2 and cmd.count(":") == 1 and "--tag-output" in cmd
    assert "POPDIST_REPLICA_INDEX_OFFSET=1" in cmd and "popdist_lite_launcher.node.agent" in cmd


def test_version():
    proc = subprocess.run([*LAUNCHER, "--version"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout.strip() == f"poprun-lite {__version__}"


@pytest.mark.parametrize("args, message", [
    (["--num-replicas", "2", "--num-instances", "3"], "each instance drives exactly one"),
    (["--num-replicas", "-1"], "must be at least 1"),
])
def test_bad_option_values(args, message):
    proc = subprocess.run([*LAUNCHER, *args, "true"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.startswith("poprun-lite: error: ") and message in proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr   # one line, no usage block


# ---------------------------------------------------------------- failures

def readme_failure() -> tuple[str, str]:
    """The README's failing ``train.py`` and what it says poprun-lite prints for it."""
    section = (ROOT / "README.md").read_text().split("When a rank fails", 1)[1]
    program = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    shown = re.search(r"prints, and nothing else.*?```\n(.*?)```", section, re.S).group(1)
    return program, shown


def normalised(text: str, directory) -> str:
    """``text`` without what differs between two runs: pids, the host's name, the run's
    directory, the log's private directory."""
    text = text.replace(f"{directory}/", "")
    text = re.sub(r"pid \d+", "pid N", text)
    text = re.sub(r"host [^,\s)]+", "host H", text)
    return re.sub(r"/\S*/poprun-lite-[^/\s]+/job\.log", "LOG", text)


def test_the_readmes_failure_report_is_what_a_user_sees(tmp_path):
    """The README's failing job, run: replica 1 raises after init(), replica 0 waits in
    all_reduce until the abort ends it (not the job's timeout). Everything on stdout and
    stderr is the README's report (normalised): the error once, none of the replicas'
    own tracebacks, no MPI abort box; those are in the log the report names."""
    program, shown = readme_failure()
    (tmp_path / "train.py").write_text(program)
    proc = subprocess.run([*LAUNCHER, "--timeout", str(JOB_SECONDS), "--num-replicas", "2", sys.executable,
                           "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=JOB_SECONDS + 60,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 1, proc.stderr
    assert normalised(proc.stdout + proc.stderr, tmp_path) == normalised(shown, tmp_path)
    log = open(re.search(r"(/\S*/poprun-lite-[^/\s]+/job\.log)", proc.stderr).group(1)).read()
    assert "MPI_ABORT was invoked on rank 1" in log
    assert "popdist-lite: uncaught exception in replica 1" in log and "KeyError: 'labels'" in log


def test_plain_program_exception(tmp_path):
    prog = program(tmp_path, "plain.py", """
        import os, sys, time
        if os.environ["POPDIST_REPLICA_INDEX_OFFSET"] == "2":
            raise ValueError("plain failure in rank two")
        time.sleep(600)   # beyond the job's timeout: only the failure ends the others
    """)
    proc = launch("--num-replicas", "3", *prog)
    assert proc.returncode == 1, proc.stderr
    report = proc.stderr[proc.stderr.index("poprun-lite: job failed (exit code 1)"):]
    assert "root cause: replica 2 (rank 2" in report and ": exit code 1\n" in report
    assert "ValueError: plain failure in rank two" in report


def test_rank_killed_by_sigkill(tmp_path):
    prog = program(tmp_path, "kill.py", """
        import os, signal, sys, time
        if os.environ["POPDIST_REPLICA_INDEX_OFFSET"] == "1":
            print("about to die", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)   # beyond the job's timeout: only the failure ends the others
    """)
    proc = launch("--num-replicas", "2", *prog)
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr
    assert "root cause: replica 1 (rank 1" in proc.stderr
    assert "signal SIGKILL\n  about to die" in proc.stderr


def test_missing_program(tmp_path):
    """Named in one line before mpirun starts (tests/launcher/test_cli_checks.py has the
    other cases)."""
    missing = tmp_path / "no-such-program"
    proc = launch("--num-replicas", "2", str(missing))
    assert proc.returncode == 2
    assert proc.stderr == f"poprun-lite: error: program {missing}: no such file\n"


def test_only_output_from_instance_still_reports_hidden_failure(tmp_path):
    prog = program(tmp_path, "out.py", """
        import os, sys, time
        from pathlib import Path
        r = os.environ["POPDIST_REPLICA_INDEX_OFFSET"]
        print(f"stdout from {r}", flush=True)
        print(f"stderr from {r}", file=sys.stderr, flush=True)
        Path(sys.argv[1], f"printed-{r}").touch()
        if r == "1":   # fail once every replica has printed
            while len(list(Path(sys.argv[1]).glob("printed-*"))) < 3:
                time.sleep(0.05)
            raise RuntimeError("hidden instance failed")
        time.sleep(600)   # beyond the job's timeout: only the failure ends the others
    """)
    proc = launch("--num-replicas", "3", "--only-output-from-instance", "0", *prog, str(tmp_path))
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.splitlines() == ["stdout from 0"]
    head, _, report = proc.stderr.partition("poprun-lite: job failed")
    assert "stderr from 0" in head
    assert "stderr from 1" not in head and "stderr from 2" not in proc.stderr
    assert "root cause: replica 1 (rank 1" in report
    assert "RuntimeError: hidden instance failed" in report


# ---------------------------------------------------------------- stopping

SLEEPER = """
    import os, signal, sys, time
    if "--ignore-term" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    r = os.environ["POPDIST_REPLICA_INDEX_OFFSET"]
    with open(os.path.join(sys.argv[1], f"pids-{r}.tmp"), "w") as f:
        f.write(f"{os.getpid()} {os.getppid()}")
    os.replace(os.path.join(sys.argv[1], f"pids-{r}.tmp"), os.path.join(sys.argv[1], f"pids-{r}"))
    while True:
        time.sleep(1)
"""


@pytest.mark.parametrize("signum, extra", [(signal.SIGINT, []),
                                           (signal.SIGTERM, ["--ignore-term"])])
def test_signal_to_launcher_stops_every_rank(tmp_path, signum, extra):
    n = 3
    prog = program(tmp_path, "sleeper.py", SLEEPER)
    launcher = subprocess.Popen([*LAUNCHER, "--timeout", str(JOB_SECONDS), "--num-replicas", str(n), *prog,
                                 str(tmp_path), *extra], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + JOB_SECONDS
        while len(list(tmp_path.glob("pids-?"))) < n:
            assert time.monotonic() < deadline and launcher.poll() is None, "ranks did not start"
            time.sleep(0.1)
        pids = [int(p) for f in tmp_path.glob("pids-?") for p in f.read_text().split()]
        assert all(alive(p) for p in pids)
        launcher.send_signal(signum)
        _, err = launcher.communicate(timeout=JOB_SECONDS)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 128 + signum, err
    assert f"poprun-lite: job interrupted by {signal.Signals(signum).name}" in err
    wait_for(lambda: not any(alive(p) for p in pids), 60, "the rank processes to be gone")


def test_timeout_stops_job(tmp_path):
    prog = program(tmp_path, "sleeper.py", SLEEPER)
    proc = launch("--num-replicas", "2", *prog, str(tmp_path), job_timeout=1.5)
    assert proc.returncode == 124, proc.stderr
    assert "poprun-lite: job timed out after 1.5 s (exit code 124)" in proc.stderr
    pids = [int(p) for f in tmp_path.glob("pids-?") for p in f.read_text().split()]
    wait_for(lambda: not any(alive(p) for p in pids), 60, "the rank processes to be gone")


def test_run_mpirun_kills_whole_session_when_stop_is_ignored(tmp_path, monkeypatch):
    """If mpirun itself does not stop, every process of its session is SIGKILLed."""
    monkeypatch.setattr(mpirun, "SESSION_KILL_DELAY_SECONDS", 1.0)
    stubborn = program(tmp_path, "stubborn.py", """
        import os, signal, subprocess, sys, time
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
        # a "rank" in its own process group, as mpirun starts them (ignores signals too)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 preexec_fn=os.setpgrp)
        with open(sys.argv[1], "w") as f:
            f.write(f"{os.getpid()} {child.pid}")
        time.sleep(600)
    """)
    pid_file = tmp_path / "pids"
    with Collector() as collector:
        result = mpirun.run_mpirun([*stubborn, str(pid_file)], collector, timeout=1.0)
    assert result.timed_out and result.returncode == -signal.SIGKILL
    pids = [int(p) for p in pid_file.read_text().split()]
    wait_for(lambda: not any(alive(p) for p in pids), 60, "the session's processes to be gone")


# ---------------------------------------------------------------- the launcher's death

MPICH_PYTHON = os.environ.get("POPDIST_LITE_MPICH_PYTHON")
BOTH_MPIS = pytest.mark.parametrize("mpi", ["openmpi", pytest.param("mpich", marks=pytest.mark.skipif(
    not MPICH_PYTHON, reason="no MPICH environment (scripts/test prepares one)"))])

# every replica and feeder publishes its pid, then waits to be ended
UP = """
    import os, sys, time
    from pathlib import Path
    d = Path(sys.argv[1])
    name = f"{os.environ['POPDIST_LITE_ROLE']}-{os.environ['POPDIST_REPLICA_INDEX_OFFSET']}"
    (d / f"{name}.tmp").write_text(str(os.getpid()))
    os.replace(d / f"{name}.tmp", d / f"{name}.up")
    time.sleep(120)
"""


def _with_mpi(mpi: str) -> tuple[str, dict]:
    """The interpreter and environment running poprun-lite under ``mpi``."""
    if mpi == "openmpi":
        return sys.executable, dict(os.environ)
    bin_dir = os.path.dirname(MPICH_PYTHON)
    return MPICH_PYTHON, {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                          "POPRUN_LITE_MPIRUN": os.path.join(bin_dir, "mpiexec")}


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(e.decode(errors="replace").partition("=")[::2] for e in f.read().split(b"\0") if e)


@BOTH_MPIS
def test_launcher_killed_ends_its_job(tmp_path, mpi):
    """kill -9 of poprun-lite under 2 replicas with a feeder each: mpirun (SIGKILLed by
    the kernel, PR_SET_PDEATHSIG), every agent (its connection to the launcher ends) and
    every rank and feeder are gone within 5 s of the kill; nothing carrying the
    attempt's mark is left."""
    from popdist_lite_launcher.node import cleanup
    python, env = _with_mpi(mpi)
    up = tmp_path / "up.py"
    up.write_text(textwrap.dedent(UP))
    launcher = subprocess.Popen([python, "-m", "popdist_lite_launcher", "--timeout", "120",
                                 "--num-replicas", "2", "--feeders-per-replica", "1",
                                 python, str(up), str(tmp_path)],
                                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
    mark, pids = None, []
    try:
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("*.up"))) < 4:
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the ranks and feeders did not start"
            time.sleep(0.05)
        pids = [int(p.read_text()) for p in tmp_path.glob("*.up")]
        mark = _environ(pids[0])[cleanup.MARK_ENV]
        attempt = cleanup.marked(mark)  # mpirun, its daemon, the agents, ranks, feeders
        assert set(pids) < set(attempt) and len(attempt) >= 9, attempt
        launcher.kill()
        killed = time.monotonic()
        launcher.communicate(timeout=30)
        left = attempt
        while left and time.monotonic() - killed < 5.0:
            time.sleep(0.05)
            left = [p for p in attempt if alive(p)] + [p for p in cleanup.marked(mark) if p not in attempt]
        assert not left, f"left {time.monotonic() - killed:.1f} s after the kill: " + \
            ", ".join(f"{p} {_cmdline(p)}" for p in left)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
        if mark is not None:
            cleanup.kill_marked(mark)
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "(gone)"
