"""The reachability probe (a process started through the launch agent must reach the
launcher with the check's key) and the cleanup of an attempt's leftovers (every process
carrying the attempt's mark is killed, nothing else), on this host with a launch agent
that runs the command here; an elastic job probes its listed hosts in order, only as many
as it needs. The multi-host side is in tests/multihost/test_hosts_elastic.py.
Every process runs under a timeout."""

from __future__ import annotations

import dataclasses
import functools
import os
import shlex
import socket
import subprocess
import sys

import pytest
from helpers import JOB_SECONDS
from peers import alive, wait_for

from popdist_lite_launcher import cli
from popdist_lite_launcher.core.api import LauncherError
from popdist_lite_launcher.launch import remote
from popdist_lite_launcher.launch.base import LAUNCH_AGENT_ENV
from popdist_lite_launcher.membership.elastic import Cluster
from popdist_lite_launcher.node import cleanup, probe
from popdist_lite_launcher.ssh.launcher import ATTEMPT_AGENT

LOCAL_AGENT = """#!/usr/bin/env bash
# a launch agent for this host: AGENT [options] [--] HOST COMMAND... runs COMMAND here
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do [ "$1" = "--" ] && { shift; break; }; shift; done
echo "$*" >> "$(dirname "$0")/ran"
shift
exec bash -c "$*" __STDIN__
"""


def agent(tmp_path, stdin: str = "") -> str:
    path = tmp_path / "agent"
    path.write_text(LOCAL_AGENT.replace("__STDIN__", stdin))
    path.chmod(0o755)
    return str(path)


def test_probe_passes_with_the_key_on_stdin(tmp_path):
    assert remote.probe_hosts(agent(tmp_path), ["node1", "node2"], "127.0.0.1", timeout=JOB_SECONDS) == {
        "node1": None, "node2": None}
    ran = (tmp_path / "ran").read_text().splitlines()
    assert len(ran) == 2 and all("popdist_lite_launcher.node.probe 127.0.0.1:" in line for line in ran)
    # the key travelled on stdin: no 64-hex-digit word on the command lines
    assert not [word for line in ran for word in line.split() if len(word) == 64]
    remote.check_hosts(agent(tmp_path), ["node1"], timeout=JOB_SECONDS, address="127.0.0.1")  # raises nothing


def test_probe_failures_in_words(tmp_path):
    swallowing = agent(tmp_path, "< /dev/null")  # an agent that does not pass stdin on
    problems = remote.probe_hosts(swallowing, ["node1"], "127.0.0.1", timeout=JOB_SECONDS)
    assert problems["node1"].startswith("host node1 got no key on its standard input within 5 s "
                                        "(the launch agent must pass its standard input on, as ssh does)")
    failing = tmp_path / "failing"
    failing.write_text("#!/usr/bin/env bash\necho 'ssh: connect to host node1 port 22: No route to host' >&2\n"
                       "exit 255\n")
    failing.chmod(0o755)
    with pytest.raises(LauncherError, match=r"host node1 is not reachable with the launch agent '.*failing': "
                                            r"`.*` exited with 255: ssh: connect to host node1 port 22"):
        remote.check_hosts(str(failing), ["node1"], timeout=JOB_SECONDS, address="127.0.0.1")


def test_probe_names_refused_and_timed_out_connections(tmp_path):
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    key = "ab" * 32 + "\n"
    proc = subprocess.run([sys.executable, "-m", "popdist_lite_launcher.node.probe", f"127.0.0.1:{port}", "0"],
                          input=key, capture_output=True, text=True, timeout=JOB_SECONDS)
    assert proc.returncode == probe.FAILED
    assert f"cannot connect to poprun-lite at 127.0.0.1:{port} over the job network: connection refused" \
        in proc.stderr
    with socket.socket() as silent:  # listens, never answers the handshake
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        proc = subprocess.run([sys.executable, "-m", "popdist_lite_launcher.node.probe",
                               f"127.0.0.1:{silent.getsockname()[1]}", "0"],
                              input=key, capture_output=True, text=True, timeout=JOB_SECONDS)
    assert proc.returncode == probe.FAILED
    assert f"timed out after {probe.CONNECT_SECONDS:g} s" in proc.stderr


def test_probe_with_the_wrong_key_is_refused(tmp_path):
    from popdist_lite_launcher.supervise.collector import Collector

    with Collector("127.0.0.1", ranks=1) as server:
        proc = subprocess.run([sys.executable, "-m", "popdist_lite_launcher.node.probe", server.address, "0"],
                              input="cd" * 32 + "\n", capture_output=True, text=True, timeout=JOB_SECONDS)
        assert not server.records("hello")
        refused, _ = server.ignored()
    assert proc.returncode == probe.FAILED
    assert "the collector closed the connection before the welcome" in proc.stderr
    assert refused == {"hello: bad MAC": 1}


# ---------------------------------------------------------------- cleanup

def spawn(env_extra: dict, *args) -> subprocess.Popen:
    # exec: bash becomes the second sleep, so the two PIDs are all there will be (without
    # it bash may fork a third process for the foreground sleep after a test counted two)
    return subprocess.Popen(["bash", "-c", "sleep 300 & exec sleep 300", *args], env={**os.environ, **env_extra},
                            start_new_session=True)


def test_kill_marked_kills_the_attempts_processes_and_nothing_else(tmp_path):
    mark, other = cleanup.new_mark(), cleanup.new_mark()
    ours = spawn({cleanup.MARK_ENV: mark})
    theirs = spawn({cleanup.MARK_ENV: other})
    try:
        for m in (mark, other):  # bash and its background sleep
            wait_for(lambda m=m: len(cleanup.marked(m)) >= 2, timeout=60, what=f"two processes marked {m}")
        ours_all = cleanup.marked(mark)
        assert ours.pid in ours_all
        proc = subprocess.run([sys.executable, "-m", "popdist_lite_launcher.node.cleanup", mark],
                              capture_output=True, text=True, timeout=JOB_SECONDS,
                              env={**os.environ, cleanup.MARK_ENV: mark})
        assert proc.returncode == 0, proc.stderr  # the cleanup spared itself, though it carries the mark
        assert f"killed {len(ours_all)} process(es)" in proc.stdout
        ours.wait(timeout=60)
        assert not [pid for pid in ours_all if alive(pid)] and not cleanup.marked(mark)
        assert theirs.poll() is None and cleanup.marked(other)  # another attempt's: untouched
    finally:
        for proc in (ours, theirs):
            try:
                os.killpg(proc.pid, 9)
            except OSError:
                pass
            proc.wait()


def test_cleanup_refuses_what_is_not_a_mark():
    proc = subprocess.run([sys.executable, "-m", "popdist_lite_launcher.node.cleanup", "../x"],
                          capture_output=True, text=True, timeout=JOB_SECONDS)
    assert proc.returncode == 2 and "usage" in proc.stderr
    with pytest.raises(ValueError, match="not an attempt mark"):
        cleanup.kill_marked("")


def test_clean_hosts_through_the_launch_agent(tmp_path):
    mark = cleanup.new_mark()
    ours = spawn({cleanup.MARK_ENV: mark})
    try:
        wait_for(lambda: len(cleanup.marked(mark)) >= 2, timeout=60, what="bash and its background sleep")
        assert remote.clean_hosts(agent(tmp_path), ["node1"], mark, timeout=JOB_SECONDS) == ({}, {})
        ours.wait(timeout=60)
        failing = tmp_path / "failing"
        failing.write_text("#!/usr/bin/env bash\necho 'node2: host is down' >&2\nexit 255\n")
        failing.chmod(0o755)
        command = shlex.join([str(failing), "--", "node2", *remote.remote_command(mark)])
        said = f"`{command}` exited with 255: node2: host is down"
        assert remote.clean_hosts(str(failing), ["node2"], mark) == \
            ({"node2": said},
             {"node2": f"host node2 is not reachable with the launch agent {str(failing)!r}: the cleanup after "
                       f"the attempt: {said}"})
        # the cleanup ran there but failed: the host was reached
        ran = tmp_path / "ran-but-failed"
        ran.write_text("#!/usr/bin/env bash\necho 'poprun-lite cleanup: 1 process(es) of the attempt "
                       "still running (pids 7)' >&2\nexit 1\n")
        ran.chmod(0o755)
        problems, unreached = remote.clean_hosts(str(ran), ["node3"], mark)
        assert list(problems) == ["node3"] and "still running" in problems["node3"] and unreached == {}
    finally:
        try:
            os.killpg(ours.pid, 9)
        except OSError:
            pass
        ours.wait()


def test_attempt_agent_marks_the_remote_command(tmp_path):
    """The wrapper given to mpirun runs the real agent (its words split, mpirun's options
    passed on, `--` before the host) with the remote command prefixed by the mark; it
    refuses to run without a mark or with a bad one."""
    real = tmp_path / "real"
    real.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$(dirname "$0")/argv"\n')
    real.chmod(0o755)
    mark = cleanup.new_mark()
    env = {**os.environ, cleanup.MARK_ENV: mark, LAUNCH_AGENT_ENV: f"{real} -p 2222"}
    proc = subprocess.run([ATTEMPT_AGENT, "-x", "node1", "PATH=/x;export PATH;", "/bin/prted", "--a", "b c"],
                          env=env, capture_output=True, text=True, timeout=JOB_SECONDS)
    assert proc.returncode == 0, proc.stderr
    argv = (tmp_path / "argv").read_text().split("\n")[:-1]
    assert argv[:5] == ["-p", "2222", "-x", "--", "node1"]
    assert argv[5] == (f"POPRUN_LITE_ATTEMPT={mark}; export POPRUN_LITE_ATTEMPT; "
                       f"POPRUN_LITE_LAUNCH_AGENT={real}\\ -p\\ 2222; export POPRUN_LITE_LAUNCH_AGENT; "
                       "PATH=/x;export PATH; /bin/prted --a b c")
    assert len(argv) == 6
    for broken in ({cleanup.MARK_ENV: "$(reboot)"}, {cleanup.MARK_ENV: ""}):
        proc = subprocess.run([ATTEMPT_AGENT, "node1", "true"], env={**env, **broken},
                              capture_output=True, text=True, timeout=JOB_SECONDS)
        assert proc.returncode != 0 and "attempt-agent: POPRUN_LITE_ATTEMPT" in proc.stderr


def test_hosts_are_probed_in_order_only_until_the_replicas_are_filled(tmp_path, monkeypatch):
    """100 listed hosts of one slot, --num-replicas 2: 2 probes (was one per listed host);
    when the first host fails its probe, one more, and the usable hosts are the next two."""
    # probes that answer, however slowly: only 127.0.0.2's failing agent fails
    monkeypatch.setattr(remote, "probe_hosts", functools.partial(remote.probe_hosts, timeout=JOB_SECONDS))
    listing = tmp_path / "discover.sh"
    listing.write_text("#!/usr/bin/env bash\n" + "".join(f"echo 127.0.0.{i}:1\n" for i in range(2, 102)))
    listing.chmod(0o755)
    opts = cli.parse_args(["--num-replicas", "2", "--min-replicas", "1", "--host-discovery-script", str(listing),
                           "--launch-agent", agent(tmp_path), "prog"])
    cluster = Cluster(opts)
    available = cluster.discover()
    assert len(available) == 100
    usable, problems = cluster.usable(available)
    ran = (tmp_path / "ran").read_text().splitlines()
    assert len(ran) == 2, f"{len(ran)} launch-agent runs"
    assert usable == [("127.0.0.2", 1), ("127.0.0.3", 1)] and problems == {}

    (tmp_path / "ran").unlink()
    failing = tmp_path / "failing-agent"  # 127.0.0.2 unreachable, the others as before
    failing.write_text(f"#!/usr/bin/env bash\nfor a in \"$@\"; do [ \"$a\" = 127.0.0.2 ] && "
                       f"{{ echo \"$*\" >> {tmp_path / 'ran'}; echo 'no route' >&2; exit 255; }}; done\n"
                       f"exec {agent(tmp_path)} \"$@\"\n")
    failing.chmod(0o755)
    cluster = Cluster(dataclasses.replace(opts, launch_agent=str(failing)))
    usable, problems = cluster.usable(available)
    ran = (tmp_path / "ran").read_text().splitlines()
    assert len(ran) == 3, f"{len(ran)} launch-agent runs"
    assert usable == [("127.0.0.3", 1), ("127.0.0.4", 1)] and list(problems) == ["127.0.0.2"]
    assert "host 127.0.0.2 is not reachable with the launch agent" in problems["127.0.0.2"]

    # a host the cleanup after an attempt did not reach fails without a probe
    (tmp_path / "ran").unlink()
    cluster = Cluster(dataclasses.replace(opts, launch_agent=str(failing)))
    usable, problems = cluster.usable(available, unreachable={"127.0.0.2": "host 127.0.0.2: the cleanup"})
    ran = (tmp_path / "ran").read_text().splitlines()
    assert len(ran) == 2 and not any("127.0.0.2" in line for line in ran), ran
    assert usable == [("127.0.0.3", 1), ("127.0.0.4", 1)] and problems == {"127.0.0.2": "host 127.0.0.2: the cleanup"}
