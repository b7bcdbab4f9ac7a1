"""poprun-lite end to end against a hostile neighbour and its own bugs: a stranger on the
collector's port cannot change a healthy job's outcome, the job's key is on no command
line and not in the program's environment, and a crash inside the launcher never leaves
the job running. Every launch runs under the launcher's --timeout and a subprocess
timeout."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from popdist_lite import records
from popdist_lite_launcher.core import channel
from popdist_lite_launcher.node import keys
from popdist_lite_launcher.launch import mpirun
from popdist_lite_launcher.supervise.collector import Collector
from helpers import JOB_SECONDS, timeout_for
from peers import alive, wait_for

pytestmark = timeout_for(1)

LAUNCHER = [sys.executable, "-m", "popdist_lite_launcher"]
FORGED = "FORGED-BY-A-STRANGER"

# Logs "<attempt> <replica>", publishes its pid and environment check, waits for `go`.
WAITER = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    d = Path(sys.argv[1])
    attempt, r = os.environ["POPDIST_LITE_RESTART_COUNT"], os.environ["POPDIST_REPLICA_INDEX_OFFSET"]
    with open(d / "attempts", "a") as f:
        f.write(f"{attempt} {r}\\n")
    seen = {"environ": "POPRUN_LITE_JOB_KEY" in os.environ,
            "initial": b"POPRUN_LITE_JOB_KEY" in Path("/proc/self/environ").read_bytes()}
    (d / f"rank-{r}.tmp").write_text(json.dumps({"pid": os.getpid(), **seen}))
    os.replace(d / f"rank-{r}.tmp", d / f"rank-{r}")
    deadline = time.monotonic() + 600
    while not (d / "go").exists():
        if time.monotonic() > deadline:
            sys.exit(5)
        time.sleep(0.05)
    print(f"replica {r} done", flush=True)
""")


def start(tmp_path, *args):
    prog = tmp_path / "waiter.py"
    prog.write_text(WAITER)
    return subprocess.Popen([*LAUNCHER, "--timeout", str(JOB_SECONDS), "--num-replicas", "2", *args,
                             sys.executable, str(prog), str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)


def ranks_started(tmp_path, launcher) -> list[dict]:
    def started():
        assert launcher.poll() is None, f"the launcher ended: {launcher.communicate()[1][-3000:]}"
        return all((tmp_path / f"rank-{r}").exists() for r in range(2))
    wait_for(started, timeout=240, what="both ranks")
    return [json.loads((tmp_path / f"rank-{r}").read_text()) for r in range(2)]


def finish(tmp_path, launcher, timeout=JOB_SECONDS + 30):
    (tmp_path / "go").touch()
    try:
        return launcher.communicate(timeout=timeout)
    finally:
        stop(tmp_path, launcher)


def stop(tmp_path, launcher):
    """After a failed test: the ranks end by themselves, the launcher is killed."""
    (tmp_path / "go").touch()
    if launcher.poll() is None:
        launcher.kill()
        launcher.communicate()


def environ_of(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode(errors="replace").partition("=")[::2] for e in entries if e)


def stranger(host: str, port: int, first: bytes = b"", *, close: bool = True) -> socket.socket:
    """Connect as a neighbour would, read the challenge, send ``first``."""
    sock = socket.create_connection((host, port), timeout=10)
    sock.recv(1000)
    if first:
        sock.sendall(first)
    if close:
        sock.close()
    return sock


def test_stranger_cannot_change_a_healthy_job(tmp_path):
    """A neighbour who read the collector's address from a rank's environment sends a
    forged error, hello-and-close (in the plain format and framed with a wrong key),
    `lost` without fields then `error`, wrong field types, a 4 MiB line without newline,
    and holds 200 idle connections: the job exits 0, prints none of it, uses no restart,
    and the launcher reports only counts."""
    launcher = start(tmp_path, "--max-restarts", "1")
    try:
        pid = ranks_started(tmp_path, launcher)[1]["pid"]
        host, _, port = environ_of(pid)[records.COLLECTOR_ENV].rpartition(":")
        port = int(port)
        ident = records.identity(rank=1, replica=1, host=FORGED, pid=1)
        error = records.make("error", ident, exception=FORGED, message=FORGED, traceback=FORGED)
        stranger(host, port, records.encode(error))                                # forged error
        stranger(host, port, b"0" * 64 + b" 0 " + records.encode(error))           # ... as a frame
        stranger(host, port, records.encode(records.make("hello", ident)))          # hello, close
        nonce_line = stranger(host, port, close=False)
        nonce_line.close()
        sock = socket.create_connection((host, port), timeout=10)                  # wrong key
        challenge = sock.recv(1000).rstrip(b"\n")
        sock.sendall(channel.answer(b"w" * 32, challenge, ident)[1])
        sock.close()
        stranger(host, port, b'{"kind": "lost"}\n{"kind": "error"}\n')             # KeyError before
        bad_types = {**error, "rank": FORGED, "time": FORGED, "traceback": [FORGED]}
        stranger(host, port, json.dumps(bad_types).encode() + b"\n")
        big = stranger(host, port, close=False)                                    # 4 MiB, no newline
        try:
            big.sendall(FORGED.encode() * (4 * 2 ** 20 // len(FORGED)))
        except OSError:
            pass  # closed by the collector after its first 4 KiB
        big.close()
        idle = [socket.create_connection((host, port), timeout=60) for _ in range(200)]
        for sock in idle:  # each one handled by the collector: challenged, or closed for a newer
            try:
                sock.recv(1000)
            except ConnectionResetError:
                pass
        assert launcher.poll() is None
        out, err = finish(tmp_path, launcher)
        for sock in idle:
            sock.close()
    finally:
        stop(tmp_path, launcher)
    assert launcher.returncode == 0, err
    assert FORGED not in out + err
    assert "Traceback" not in err and "internal error" not in err and "restarting" not in err
    assert sorted(out.splitlines()) == ["replica 0 done", "replica 1 done"]
    assert sorted((tmp_path / "attempts").read_text().split("\n")) == ["", "0 0", "0 1"]  # no restart
    [line] = [line for line in err.splitlines() if line.startswith("poprun-lite: ignored")]
    assert "unauthenticated connection(s) to the collector" in line and "hello: bad MAC" in line


def test_key_is_on_no_command_line_and_not_in_the_program(tmp_path):
    """No environment and no command line holds the job's key: mpirun gets none (each
    agent reads its own key file, tests/launcher/test_key_unreadable.py), the collector's
    address is forwarded by name."""
    launcher = start(tmp_path, "-v")
    try:
        ranks = ranks_started(tmp_path, launcher)
        mpirun = _children(launcher.pid)  # the launcher runs only mpirun (Open MPI 5: prterun)
        assert len(mpirun) == 1
        env = environ_of(mpirun[0])
        assert "POPRUN_LITE_JOB_KEY" not in env and keys.KEY_FILE_ENV not in env
        collector = env[records.COLLECTOR_ENV]
        cmdlines = {int(p): _cmdline(int(p)) for p in os.listdir("/proc") if p.isdigit()}
        agents = [_parent(rank["pid"]) for rank in ranks]
        assert all("popdist_lite_launcher.node.agent" in cmdlines[p] for p in agents)
        assert not [p for p, c in cmdlines.items() if collector in c]
        for rank in ranks:
            assert not rank["environ"] and not rank["initial"]
            assert keys.KEY_FILE_ENV not in environ_of(rank["pid"])  # the agent took it out
            assert environ_of(rank["pid"])[records.COLLECTOR_ENV] == collector
        out, err = finish(tmp_path, launcher)
    finally:
        stop(tmp_path, launcher)
    assert launcher.returncode == 0, err
    command = err.splitlines()[0]
    assert "POPRUN_LITE_JOB_KEY" not in command and f"-x {records.COLLECTOR_ENV} " in command
    assert collector not in command


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# ---------------------------------------------------------------- the launcher's own bugs

SLEEPERS = textwrap.dedent("""
    import os, subprocess, sys, time
    # a "rank" in its own process group, as mpirun starts them
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], preexec_fn=os.setpgrp)
    with open(sys.argv[1], "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    time.sleep(600)
""")


def test_run_mpirun_kills_the_session_when_supervising_fails(tmp_path, monkeypatch):
    prog = tmp_path / "sleepers.py"
    prog.write_text(SLEEPERS)
    pid_file = tmp_path / "pids"
    with Collector() as collector:
        calls = []

        def has_failure():
            calls.append(1)
            if pid_file.exists() and pid_file.read_text():
                raise KeyError("terminated")  # the bug the old record handling had
            return False
        monkeypatch.setattr(collector, "has_failure", has_failure)
        result = mpirun.run_mpirun([sys.executable, str(prog), str(pid_file)], collector, timeout=JOB_SECONDS)
    assert result.internal_error.startswith("KeyError: 'terminated' (at test_hostile.py:")
    pids = [int(p) for p in pid_file.read_text().split()]
    wait_for(lambda: not any(alive(p) for p in pids), 60, "the session's processes to be gone")
    assert not mpirun._sessions


@pytest.mark.parametrize("where", ["supervision", "main"])
def test_launcher_crash_never_orphans_the_job(tmp_path, where):
    """A bug while supervising (in the collector) or after the attempt (in the report):
    the launcher prints what it knows and the internal error, exits non-zero, and no
    rank survives it."""
    patch = {
        "supervision": "import os\n"
                       "from popdist_lite_launcher.supervise import collector\n"
                       "def broken(self):\n"
                       "    if os.path.exists(os.environ['CRASH']): raise KeyError('terminated')\n"
                       "    return False\n"
                       "collector.Collector.has_failure = broken\n",
        "main": "from popdist_lite_launcher.supervise import report\n"
                "def broken(*a, **k): raise RuntimeError('injected')\n"
                "report.summary = broken\n",
    }[where]
    prog = tmp_path / "waiter.py"
    prog.write_text(WAITER)
    code = patch + ("import sys\nfrom popdist_lite_launcher.cli import main\n"
                    "main(sys.argv[1:])\n")
    args = ["--timeout", str(JOB_SECONDS), "--num-replicas", "2", sys.executable, str(prog), str(tmp_path)]
    launcher = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                                env={**os.environ, "CRASH": str(tmp_path / "crash")})
    try:
        ranks = ranks_started(tmp_path, launcher)
        if where == "main":  # the job fails (a rank is killed), then the report breaks
            os.kill(ranks[1]["pid"], signal.SIGKILL)
        else:  # the collector's bug shows from now on
            (tmp_path / "crash").touch()
        _, err = launcher.communicate(timeout=JOB_SECONDS + 30)
    finally:
        stop(tmp_path, launcher)
    assert launcher.returncode not in (0, None), err
    if where == "supervision":
        assert "poprun-lite: job stopped after an internal error in poprun-lite" in err
        assert "poprun-lite: internal error: KeyError: 'terminated' (at <string>:" in err
    else:
        assert "poprun-lite: job ended by an internal error in poprun-lite (exit code 1)" in err
        assert "poprun-lite: internal error: RuntimeError: injected" in err
        assert "replica 1 (rank 1" in err  # the failure known so far
    wait_for(lambda: not any(alive(r["pid"]) for r in ranks), 60, "the ranks to be gone")


# ---------------------------------------------------------------- the program as an attacker

# Rank 0 takes every value it can read that looks like a key (64 hex digits) from its
# environment, /proc/self/environ and the environ of every ancestor (the agent, mpirun's
# daemon, mpirun), and tries each with the real channel code as its own rank and as
# ranks beyond the job; when welcomed it sends an error, a progress and a resize_stop.
ATTACKER = textwrap.dedent("""
    import json, os, re, sys, time
    from pathlib import Path
    from popdist_lite import records
    from popdist_lite_launcher.node.link import connect
    d = Path(sys.argv[1])
    if os.environ["POPDIST_REPLICA_INDEX_OFFSET"] == "0":
        def environ_of(pid):
            try:
                return Path(f"/proc/{pid}/environ").read_bytes().split(b"\\0")
            except OSError:
                return []
        texts = [f"{k}={v}".encode() for k, v in os.environ.items()] + environ_of("self")
        pid, ancestors = os.getpid(), []
        while pid > 1:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])
            ancestors.append(pid)
            texts += environ_of(pid)
        keys = {m for t in texts for m in re.findall(rb"(?<![0-9a-fA-F])[0-9a-f]{64}(?![0-9a-fA-F])", t)}
        address = os.environ["POPRUN_LITE_COLLECTOR"]
        tried, welcomed = 0, []
        for key in sorted(keys):
            for rank in (0, 1, 2, 9):
                ident = records.identity(rank=rank, replica=rank, host="FORGED", pid=1)
                tried += 1
                try:
                    sock, session, _ = connect(address, bytes.fromhex(key.decode()), ident,
                                               time.monotonic() + 10)
                except Exception as exc:
                    continue
                welcomed.append(rank)
                for record in (records.make("error", ident, exception="FORGED", message="FORGED",
                                            traceback="FORGED"),
                               records.make("progress", ident, lane="main", call=1, op="FORGED", since=1.0),
                               records.make("resize_stop", ident)):
                    sock.sendall(session.seal(record))
                time.sleep(0.5)
                sock.close()
        (d / "attack.tmp").write_text(json.dumps({"keys": len(keys), "tried": tried, "welcomed": welcomed,
                                                  "ancestors": len(ancestors)}))
        os.replace(d / "attack.tmp", d / "attack")
    print("replica done", flush=True)
""")

MPICH_PYTHON = os.environ.get("POPDIST_LITE_MPICH_PYTHON")


@pytest.mark.parametrize("mpi", ["openmpi", pytest.param("mpich", marks=pytest.mark.skipif(
    not MPICH_PYTHON, reason="no MPICH environment (scripts/test prepares one)"))])
def test_program_cannot_enrol_with_what_it_can_read(tmp_path, mpi):
    """Whatever looks like a key in the environments of the program and its ancestors
    (the agent's initial environment, mpirun and its daemon) opens nothing: the job's key
    is in none of them (tests/launcher/test_key_unreadable.py), and a key found anyway
    would be spent (every rank had enrolled before any program ran). The job's records
    and report hold nothing of the attacker's, and every refusal is counted."""
    python, env = sys.executable, dict(os.environ)
    if mpi == "mpich":
        bin_dir = os.path.dirname(MPICH_PYTHON)
        python = MPICH_PYTHON
        env.update(PATH=f"{bin_dir}:{env['PATH']}", POPRUN_LITE_MPIRUN=os.path.join(bin_dir, "mpiexec"))
    prog = tmp_path / "attacker.py"
    prog.write_text(ATTACKER)
    proc = subprocess.run([python, "-m", "popdist_lite_launcher", "--timeout", str(JOB_SECONDS), "--num-replicas",
                           "2", python, str(prog), str(tmp_path)], capture_output=True, text=True,
                          timeout=JOB_SECONDS + 60, env=env, stdin=subprocess.DEVNULL)
    attack = json.loads((tmp_path / "attack").read_text())
    assert attack["ancestors"] >= 3, attack
    assert attack["welcomed"] == [], (attack, proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FORGED" not in proc.stdout + proc.stderr and "root cause" not in proc.stderr
    ignored = [line for line in proc.stderr.splitlines() if line.startswith("poprun-lite: ignored")]
    assert len(ignored) == bool(attack["tried"]), ignored
    if attack["tried"]:
        assert f"ignored {attack['tried']} unauthenticated connection(s)" in ignored[0], ignored
