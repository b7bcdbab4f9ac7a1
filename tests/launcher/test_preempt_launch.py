"""``--preemption on`` outside Slurm, on this machine (the same path as inside an
allocation, tests/slurm/test_slurm_preempt.py, where a cluster is needed): SIGTERM to
poprun-lite while the replicas wait at a step boundary (tests/progs/hosts_elastic_prog.py
``--hold``) gives a checkpoint at that boundary and exit code 143, no requeue (no Slurm
job). Without the option SIGTERM stops the job at once, as before. Every poprun-lite
runs under a timeout; the test waits for lines, never for a time."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import JOB_SECONDS, timeout_for
from peers import wait_for

PROG = str(Path(__file__).resolve().parents[1] / "progs" / "hosts_elastic_prog.py")
LAUNCHER = [sys.executable, "-m", "popdist_lite_launcher"]


def run_until_held(tmp_path, *options: str):
    """poprun-lite (2 replicas, 6 steps, a checkpoint every 2) held after step 3; the
    process and its output lines so far (a reader thread keeps adding)."""
    cmd = [*LAUNCHER, "--num-replicas", "2", "--timeout", str(JOB_SECONDS), *options, sys.executable, PROG,
           str(tmp_path / "ckpt"), "--samples", "24", "--batch", "2", "--global-batch", "4", "--every", "2",
           "--hold", "0:3"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(line.rstrip("\n") for line in proc.stdout), daemon=True)
    reader.start()
    try:
        wait_for(lambda: {"TOOK 0 3 0", "TOOK 0 3 1"} <= {" ".join(x.split()[:4]) for x in list(lines)},
                 JOB_SECONDS, "both replicas held after step 3")
    except BaseException:
        proc.kill()
        raise
    return proc, lines, reader


def finish(proc, reader) -> int:
    try:
        return proc.wait(timeout=JOB_SECONDS + 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(10)


@timeout_for(1)
@pytest.mark.parametrize("preemption", ["on", "off"])
def test_sigterm_outside_slurm(tmp_path, monkeypatch, preemption):
    for name in [k for k in __import__("os").environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    proc, lines, reader = run_until_held(tmp_path, "--preemption", preemption, "--grace-period", "60")
    proc.send_signal(signal.SIGTERM)
    code = finish(proc, reader)
    text = "\n".join(lines)
    steps = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "ckpt").glob("step-*"))
    assert code == 143, text
    if preemption == "on":
        assert "STOPPED 4" in text and steps == [2, 4], text
        assert "poprun-lite: job stopped at a step boundary after SIGTERM (checkpoint saved); not requeued " \
               "(SIGTERM) (exit code 143)" in text, text
    else:
        assert "STOPPED" not in text and steps == [2], text
        assert "poprun-lite: job interrupted by SIGTERM (exit code 143)" in text, text


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@timeout_for(1)
@pytest.mark.parametrize("launcher_too", [False, True])
def test_sigterm_to_every_process(tmp_path, monkeypatch, launcher_too):
    """As Slurm signals a job's processes, without a cluster: SIGTERM to every process
    below poprun-lite (mpirun, the agents, the programs: ``scancel --signal=TERM``), and
    then to poprun-lite too when ``launcher_too`` (a cancel, a time limit). They hold
    it, the agents pass it on (launcher/node/hold_signals.py), and the replicas checkpoint at
    their boundary, as on poprun-lite's own SIGTERM."""
    for name in [k for k in __import__("os").environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    proc, lines, reader = run_until_held(tmp_path, "--preemption", "on", "--grace-period", "60")
    below = _descendants(proc.pid)
    assert len(below) >= 5, below  # mpirun, 2 agents, 2 programs (and what they start)
    for pid in below:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    if launcher_too:
        proc.send_signal(signal.SIGTERM)  # the same cancel reaching poprun-lite: not a second signal
    code = finish(proc, reader)
    text = "\n".join(lines)
    steps = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "ckpt").glob("step-*"))
    assert code == 143, text
    if not launcher_too:  # else whichever comes first asks; the agents' then change nothing
        assert re.search(r"poprun-lite: SIGTERM reached rank [01] on \S+ from pid \d+ \(as Slurm signals the "
                         r"job's steps\)", text), text
    assert "STOPPED 4" in text and steps == [2, 4], text
    assert "poprun-lite: job stopped at a step boundary after SIGTERM (checkpoint saved); not requeued " \
           "(SIGTERM) (exit code 143)" in text, text
    assert "second SIGTERM" not in text, text
