"""Slurm's values are bounded before they cost memory (popdist_lite_launcher.slurm.allocation,
slurm_nodes), with stand-ins for ``scontrol`` and ``squeue`` and for Slurm's
environment: the node list is read as ``scontrol show hostnames`` prints it and stopped
at the name past the limit; tasks per node and the tasks in all (the replicas an
allocation gives) are refused past their limits. Each refusal is one line, and comes
without waiting for the command to end."""

from __future__ import annotations

import os

import pytest

from popdist_lite_launcher.core.api import LauncherError
from popdist_lite_launcher.slurm import allocation, nodes as slurm_nodes, scontrol


def nodelist_of(chars: int) -> str:
    """A Slurm host list of exactly ``chars`` characters naming millions of nodes
    (ranges of 65,536 names, as Slurm writes them), good for ``check_nodelist``."""
    pieces: list[str] = []
    while len(",".join(pieces)) + len(f",x{len(pieces)}[0-65535]") < chars - 2:
        pieces.append(f"x{len(pieces)}[0-65535]")
    text = ",".join(pieces)
    return f"{text},{'y' * (chars - len(text) - 1)}"


def stand_in(directory, name: str, script: str) -> str:
    """An executable ``directory/name`` running the shell ``script``."""
    path = directory / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return str(path)


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_long_node_list_is_stopped_at_the_limit(tmp_path):
    """A 7,389-character $SLURM_JOB_NODELIST names 35 million nodes; the stand-in prints
    one name past the limit and then holds its output open (as a real scontrol still
    printing the rest would): poprun-lite stops at that name, without waiting for the
    end, and kills the command."""
    nodelist = nodelist_of(7389)
    assert len(nodelist) == 7389 and scontrol.check_nodelist(nodelist) == nodelist
    pid_file = tmp_path / "pid"
    fake = stand_in(tmp_path, "scontrol", f"echo $$ > {pid_file}\n"
                                          f"seq -f 'n%.0f' 1 {scontrol.MAX_NODES + 1}\nexec sleep 300\n")
    env = {"SLURM_JOB_ID": "17", "SLURM_JOB_NODELIST": nodelist, "SLURM_TASKS_PER_NODE": "1"}
    with pytest.raises(LauncherError) as exc:
        allocation.from_environment(env, expand=lambda text: scontrol.expand_nodelist(text, scontrol=fake))
    text = one_line(exc)
    assert f"printed more than {scontrol.MAX_NODES} node names" in text, text
    assert text.startswith("`scontrol show hostnames x0[0-65535],x1[0-65535],") and len(text) < 200, text
    assert gone(int(pid_file.read_text())), "the stopped scontrol is still running"


def test_a_node_list_without_line_ends_is_stopped_at_the_limit(tmp_path):
    """One endless 'name' (no line end): stopped once it is longer than the most
    MAX_NODES names can be."""
    limit = scontrol.MAX_NODES * 254
    fake = stand_in(tmp_path, "scontrol", f"head -c {limit + 70000} /dev/zero | tr '\\0' a\n"
                                          f"exec sleep 300\n")
    with pytest.raises(LauncherError) as exc:
        scontrol.expand_nodelist("n[1-2]", scontrol=fake)
    assert f"printed more than {limit} bytes (killed)" in one_line(exc)


@pytest.mark.parametrize("name, text, nodes, match", [
    ("SLURM_TASKS_PER_NODE", "100000000", 1,
     r"'100000000': 100000000 tasks on a node, more than the 65533 Slurm allows"),
    ("SLURM_TASKS_PER_NODE", "65534", 1, "65534 tasks on a node, more than the 65533"),
    ("SLURM_TASKS_PER_NODE", "1,999999999", 2, "999999999 tasks on a node"),
    ("SLURM_TASKS_PER_NODE", "65533(x2)", 2, "more than 65536 tasks in all, the most replicas"),
    ("SLURM_NTASKS_PER_NODE", "100000000", 2, "100000000 tasks on a node"),
    ("SLURM_NTASKS_PER_NODE", "40000", 2, "more than 65536 tasks in all"),
])
def test_tasks_past_the_limits_are_refused(name, text, nodes, match):
    env = {"SLURM_JOB_ID": "17", "SLURM_JOB_NODELIST": "n[1-2]", name: text}
    with pytest.raises(LauncherError, match=rf"^\${name} .*{match}") as exc:
        allocation.from_environment(env, expand=lambda _: [f"n{i + 1}" for i in range(nodes)])
    one_line(exc)


@pytest.mark.parametrize("text, nodes, want", [("65533", 1, 65533), ("32768(x2)", 2, 65536),
                                               ("1,65533", 2, 65534)])
def test_tasks_up_to_the_limits_are_taken(text, nodes, want):
    env = {"SLURM_JOB_ID": "17", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": text}
    got = allocation.from_environment(env, expand=lambda _: [f"n{i + 1}" for i in range(nodes)])
    assert got.total_tasks == want


def test_poprun_lite_refuses_a_hundred_million_tasks_in_one_line(monkeypatch, capsys):
    """poprun-lite's options in an allocation of one node with 10^8 tasks: a usage
    error naming the variable (not 10^8 replicas)."""
    from popdist_lite_launcher import cli
    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_JOB_ID", "17")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n1")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "100000000")
    monkeypatch.setattr(scontrol, "expand_nodelist", lambda text: ["n1"])
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(["prog"])
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == ("poprun-lite: error: $SLURM_TASKS_PER_NODE '100000000': 100000000 tasks on a node, "
                    "more than the 65533 Slurm allows (MaxTasksPerNode)"), last


def test_squeue_output_is_stopped_at_the_limit(tmp_path, monkeypatch):
    """A stand-in squeue prints more than the most a query reads, then holds its output
    open: the job's node list is unknown (the allocation's nodes kept), at once."""
    stand_in(tmp_path, "squeue", f"head -c {scontrol.MAX_OUTPUT_BYTES + 70000} /dev/zero | tr '\\0' n\n"
                                 f"exec sleep 300\n")
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    nodes = slurm_nodes.Nodes("17", ["n1", "n2"], "srun-agent")
    listed, problem = nodes.in_job()
    assert listed == ["n1", "n2"]
    assert problem == (f"squeue: `squeue -h -j 17 -o %N` printed more than "
                       f"{scontrol.MAX_OUTPUT_BYTES} bytes (killed)"), problem
