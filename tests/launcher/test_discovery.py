"""Host discovery (--host-discovery-script, Horovod's contract): the output's grammar, a
script that fails, hangs, prints garbage, too much or too many hosts, in the process and
through poprun-lite; never a hang, and no script outlives the job. Every process runs
under a timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
from helpers import JOB_SECONDS, timeout_for
from peers import alive, wait_for

from popdist_lite_launcher.membership import discovery
from popdist_lite_launcher.membership.discovery import DiscoveryError

LAUNCHER = [sys.executable, "-m", "popdist_lite_launcher"]


def script(tmp_path, body: str, name: str = "discover.sh"):
    path = tmp_path / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)
    return str(path)


def test_parse_reads_horovods_lines_and_hostfile_lines():
    text = b"# available now\nnode1:4\n\n[fe80::1]:2\nnode2 slots=3\n10.0.0.7\n"
    assert discovery.parse(text, "s") == [("node1", 4), ("fe80::1", 2), ("node2", 3), ("10.0.0.7", None)]
    assert discovery.parse(b"", "s") == [] and discovery.parse(b"\n# none\n", "s") == []


@pytest.mark.parametrize("text, message", [
    (b"node1:4\n-oProxyCommand=touch:2\n", r"script s, line 2: '-oProxyCommand=touch' is not a host name"),
    (b"node1;reboot\n", r"script s, line 1: 'node1;reboot' is not a host name"),
    (b"node1:0\n", r"script s, line 1: expected HOST or HOST:SLOTS \(SLOTS >= 1\)"),
    (b"node1:4\nnode1:2\n", r"script s, line 2: host node1 listed again \(first on line 1\)"),
    (b"ok\n\xff\xfe\n", r"script s, line 2: not UTF-8 text"),
    (b"node1 slots=many\n", r"script s, line 1: bad slots value 'many'"),
])
def test_parse_refuses_garbage_naming_the_script_and_line(text, message):
    with pytest.raises(DiscoveryError, match=message):
        discovery.parse(text, "s")


def test_at_most_max_hosts_are_listed():
    lines = b"".join(b"node%d:1\n" % i for i in range(discovery.MAX_HOSTS))
    assert len(discovery.parse(lines, "s")) == discovery.MAX_HOSTS
    with pytest.raises(DiscoveryError, match=rf"script s, line {discovery.MAX_HOSTS + 2}: more than "
                                             rf"{discovery.MAX_HOSTS} hosts listed \(the most poprun-lite takes\)"):
        discovery.parse(b"# many\n" + lines + b"one-more:1\n", "s")


def test_discover_runs_the_script(tmp_path):
    assert discovery.discover(script(tmp_path, "echo node1:2; echo node2:2\n")) == [("node1", 2), ("node2", 2)]


def test_discover_fails_clearly(tmp_path):
    with pytest.raises(DiscoveryError, match=r"discover.sh exited with code 3: no cluster today"):
        discovery.discover(script(tmp_path, "echo node1:2; echo 'no cluster today' >&2; exit 3\n"))
    with pytest.raises(DiscoveryError, match=r"nope.sh cannot be run: .*No such file"):
        discovery.discover(str(tmp_path / "nope.sh"))
    (tmp_path / "plain").write_text("node1:2\n")  # not executable
    with pytest.raises(DiscoveryError, match=r"plain cannot be run: .*Permission denied"):
        discovery.discover(str(tmp_path / "plain"))
    with pytest.raises(DiscoveryError, match=rf"printed more than {discovery.MAX_OUTPUT_BYTES} bytes"):
        discovery.discover(script(tmp_path, "yes node1:2\n"))


@timeout_for(1)
def test_a_hanging_script_and_its_children_are_killed(tmp_path):
    """The script starts a child, names it in a file and hangs: killed at the timeout,
    with its child. A timeout that came before the script had named its child (a slow
    machine) proves nothing about the child: then again with a longer one."""
    pid_file = tmp_path / "child.pid"
    hangs = script(tmp_path, f"echo node1:2\nsleep 300 & echo $! > {pid_file}.tmp && mv {pid_file}.tmp {pid_file}\n"
                             "sleep 300\n")
    for timeout in (1, 4, 16, 64):
        with pytest.raises(DiscoveryError, match=rf"still running after {timeout} s \(killed\)"):
            discovery.discover(hangs, timeout=timeout)
        if pid_file.exists():
            break
    child = int(pid_file.read_text())
    wait_for(lambda: not alive(child), timeout=60, what="the script's child to be gone")


# ---------------------------------------------------------------- through poprun-lite

def poprun(tmp_path, discover: str, *args):
    prog = tmp_path / "prog.py"
    prog.write_text("print('ran', flush=True)\n")
    return subprocess.run([*LAUNCHER, "--num-replicas", "2", "--min-replicas", "1", "--host-discovery-script",
                           discover, "--timeout", str(JOB_SECONDS), *args, sys.executable, str(prog)],
                          capture_output=True, text=True, timeout=JOB_SECONDS + 60, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("body, message", [
    ("echo localhost:2\necho 'rm;reboot'\n", "host discovery script {s}, line 2: 'rm;reboot' is not a host name"),
    ("echo 'inventory down' >&2\nexit 1\n", "host discovery script {s} exited with code 1: inventory down"),
    ("sleep 300\n", "host discovery script {s}: still running after 10 s (killed)"),
])
@timeout_for(1)
def test_a_bad_script_stops_the_job_at_its_start(tmp_path, body, message):
    """Garbage, a failure or a hang at the start: exit code 2 naming the script and what
    was wrong (a hang: killed at the discovery timeout, which the message names); nothing
    was launched."""
    path = script(tmp_path, body)
    proc = poprun(tmp_path, path)
    assert proc.returncode == 2, proc.stderr
    assert f"poprun-lite: error: {message.format(s=path)}" in proc.stderr
    assert "ran" not in proc.stdout


@timeout_for(1)
def test_a_script_failing_between_attempts_is_retried(tmp_path):
    """The script works at the start, then fails while a file exists, logging each
    failure: the first attempt's program makes the file and waits until the launcher's
    resize monitor has met two failures (the first one is then said: during the attempt
    the membership is kept), then fails; the launcher says what it waits for and retries
    at every interval; once the test has seen that, it removes the file, the script works
    again and the second attempt runs."""
    broken, failures = tmp_path / "broken", tmp_path / "failures"
    path = script(tmp_path, f"""if [ -f {broken} ]; then
    echo failed >> {failures}; echo "inventory down" >&2; exit 1
fi
echo localhost:2
""")
    prog = tmp_path / "prog.py"
    prog.write_text("import os, sys, time\n"
                    "if os.environ['POPDIST_LITE_RESTART_COUNT'] == '0':\n"
                    f"    open({str(broken)!r}, 'w').close()\n"
                    "    for _ in range(6000):  # a count of polls, not a clock\n"
                    f"        if os.path.exists({str(failures)!r}) and len(open({str(failures)!r}).readlines()) >= 2:\n"
                    "            sys.exit(5)\n"
                    "        time.sleep(0.05)\n"
                    "    sys.exit('no discovery failure during the attempt')\n"
                    "print('second attempt', os.environ['POPDIST_REPLICA_INDEX_OFFSET'], flush=True)\n")
    out, err_path = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as stdout, open(err_path, "w") as stderr:
        launcher = subprocess.Popen([*LAUNCHER, "--num-replicas", "2", "--min-replicas", "2", "--max-restarts", "1",
                                     "--host-discovery-script", path, "--discovery-interval", "0.5",
                                     "--timeout", str(JOB_SECONDS), sys.executable, str(prog)],
                                    stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: "poprun-lite: waiting for hosts" in err_path.read_text() or launcher.poll() is not None,
                 timeout=JOB_SECONDS, what="poprun-lite waiting for hosts")
        broken.unlink(missing_ok=True)
        code = launcher.wait(timeout=JOB_SECONDS)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    err = err_path.read_text()
    assert code == 0, err
    assert sorted(out.read_text().split("\n")) == ["", "second attempt 0", "second attempt 1"]
    assert f"host discovery failed during the attempt (membership kept): host discovery script {path} " \
           f"exited with code 1: inventory down" in err
    assert "poprun-lite: attempt 1 failed (exit code 5)" in err
    assert f"poprun-lite: waiting for hosts: no replicas usable, --min-replicas 2\n" \
           f"  host discovery script {path} exited with code 1: inventory down" in err
    assert "restarting the job after failure 1 of at most 1 (--max-restarts)" in err
    assert "attempt 2: 2 replicas on this host (2), after a failure; succeeded" in err


def processes_with(marker: str) -> list[int]:
    """PIDs of the processes whose command line holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


@timeout_for(1)
def test_a_script_hanging_during_an_attempt_is_gone_when_the_job_ends(tmp_path):
    """The script answers its first call (the job's start) and hangs on the second (the
    resize monitor's, during the attempt), with a child in the background: when the
    program has ended, the job ends with exit code 0 and no process of the script is
    left (they run in their own session; the end of the attempt kills it)."""
    marker = f"hang-{uuid.uuid4().hex}"
    calls, hanging = tmp_path / "calls", tmp_path / "hanging"
    path = script(tmp_path, f"""calls=$(cat {calls} 2>/dev/null || echo 0)
echo $((calls + 1)) > {calls}
if [ "$calls" -ge 1 ]; then
    (exec -a {marker}-child sleep 300) &
    touch {hanging}
    exec -a {marker}-script sleep 300
fi
echo localhost:2
""", name=f"{marker}.sh")
    prog = tmp_path / "prog.py"
    prog.write_text("import os, sys, time\n"
                    "for _ in range(6000):  # a count of polls, not a clock\n"
                    f"    if os.path.exists({str(hanging)!r}):\n"
                    "        break\n"
                    "    time.sleep(0.05)\n"
                    "else:\n"
                    "    sys.exit('no second discovery call')\n"
                    "print('done', flush=True)\n")
    try:
        proc = subprocess.run([*LAUNCHER, "--num-replicas", "2", "--host-discovery-script", path,
                               "--discovery-interval", "0.1", "--timeout", str(JOB_SECONDS), sys.executable,
                               str(prog)], capture_output=True, text=True, timeout=JOB_SECONDS + 60,
                              stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["done", "done"]
        wait_for(lambda: not processes_with(marker), timeout=60, what="the discovery script's processes to be gone")
        assert "host discovery failed" not in proc.stderr  # its end was the attempt's, not an error
    finally:
        for pid in processes_with(marker):
            try:
                os.kill(pid, 9)
            except OSError:
                pass
