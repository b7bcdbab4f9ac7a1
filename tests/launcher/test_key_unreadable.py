"""The job's key cannot be read by the program (issue 28): a program
(tests/progs/key_hunt_prog.py) looks for it in its environment, its initial
environment, every ancestor's /proc/PID/environ up to PID 1 and the key file whose
path it finds, under poprun-lite with Open MPI and MPICH on one host. The launcher is
started through a wrapper that records every key it makes (channel.new_key), so the
test compares what the program found with the real keys."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import JOB_SECONDS, timeout_for
from keyhunt import HUNT, check_nothing_found, hunts, key_dirs, recording_launcher

pytestmark = timeout_for(1)

MPICH_PYTHON = os.environ.get("POPDIST_LITE_MPICH_PYTHON")


@pytest.mark.parametrize("mpi", ["openmpi", pytest.param("mpich", marks=pytest.mark.skipif(
    not MPICH_PYTHON, reason="no MPICH environment (scripts/test prepares one)"))])
def test_program_cannot_read_the_key(tmp_path, mpi):
    python, env = sys.executable, dict(os.environ)
    if mpi == "mpich":
        bin_dir = os.path.dirname(MPICH_PYTHON)
        python = MPICH_PYTHON
        env.update(PATH=f"{bin_dir}:{env['PATH']}", POPRUN_LITE_MPIRUN=os.path.join(bin_dir, "mpiexec"))
    keys, before = tmp_path / "keys", key_dirs()
    proc = subprocess.run(recording_launcher(python, keys, "--timeout", str(JOB_SECONDS), "--num-replicas", "2",
                                             python, HUNT),
                          capture_output=True, text=True, timeout=JOB_SECONDS + 60, env=env,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_nothing_found(hunts(proc.stdout), keys.read_text().split(), 2, 3, proc.stderr)
    assert not key_dirs() - before  # the agents removed every file and directory


def _agent(tmp_path, body: str) -> str:
    """A launch agent (called ``AGENT -- HOST COMMAND...``) running ``body`` in sh."""
    path = tmp_path / "agent"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o700)
    return str(path)


def test_key_files_reach_other_hosts_through_the_launch_agent(tmp_path):
    """deposit_keys: this host's ranks get files written here, another host's through the
    launch agent (here one that runs the command on this machine, TMPDIR set apart);
    every rank's variable names its own file, which holds the key."""
    from popdist_lite_launcher.core.plan import RankSpec
    from popdist_lite_launcher.launch.remote import deposit_keys
    from popdist_lite_launcher.node import keys

    agent = _agent(tmp_path, 'shift 2; exec "$@"')
    ranks = [RankSpec("replica", 0), RankSpec("replica", 1, host="otherhost"), RankSpec("replica", 2)]
    key, mark = b"\x17" * 32, "0123456789abcdef"
    local = deposit_keys(ranks, ["otherhost"], key, mark, agent)
    try:
        paths = [spec.env[keys.KEY_FILE_ENV] for spec in ranks]
        assert [os.path.basename(p) for p in paths] == ["rank-0", "rank-1", "rank-2"]
        assert os.path.dirname(paths[0]) == os.path.dirname(paths[2]) == local
        there = os.path.dirname(paths[1])
        assert there != local and os.path.dirname(there) == os.path.dirname(local) == keys.key_parent()
        assert [keys.take_key({keys.KEY_FILE_ENV: p}) for p in paths] == [key] * 3
        assert not os.path.exists(there) and not os.path.exists(local)  # the last reader removed each directory
    finally:
        keys.remove_keys(mark)


@pytest.mark.parametrize("body", ["exit 3", "cat >/dev/null; echo /etc"])
def test_a_host_that_cannot_take_the_key_fails_the_attempt(tmp_path, body):
    """A launch agent that fails, or prints something other than a key directory of the
    attempt: the attempt fails naming the host, and this host's key files are removed."""
    from popdist_lite_launcher.core.api import AttemptError
    from popdist_lite_launcher.core.plan import RankSpec
    from popdist_lite_launcher.launch.remote import deposit_keys
    from popdist_lite_launcher.node import keys

    ranks = [RankSpec("replica", 0), RankSpec("replica", 1, host="otherhost")]
    mark = "fedcba9876543210"
    with pytest.raises(AttemptError, match="cannot give the job's key to host otherhost"):
        deposit_keys(ranks, ["otherhost"], b"\x17" * 32, mark, _agent(tmp_path, body))
    assert not list(Path(keys.key_parent()).glob(f"poprun-lite-key-{mark}-*"))
