"""Fast unit tests of poprun-lite's option handling and MPMD command building.

Nothing here runs mpirun: the implementation is passed explicitly, so the MPICH
command is checked without MPICH installed.
"""

import os
import sys

import pytest

from popdist_lite import records
from popdist_lite_launcher import cli
from popdist_lite_launcher.core import hosts
from popdist_lite_launcher.core.api import LauncherError
from popdist_lite_launcher.core.plan import RankSpec, default_rank_env, format_topology, plan_ranks
from popdist_lite_launcher.launch.command import (MPICH, OPENMPI, agent_command, build_command, find_mpirun,
                                                  parse_implementation)
from popdist_lite_launcher.node import agent, keys

def plan(argv):
    opts = cli.parse_args([*argv, "python3", "train.py"])
    return opts, plan_ranks(opts)


def contexts(cmd):
    """Split an MPMD command into [global part, context 1, context 2, ...]."""
    parts, current = [], []
    for arg in cmd:
        if arg == ":":
            parts.append(current)
            current = []
        else:
            current.append(arg)
    parts.append(current)
    # the first part holds the global args and the first context, split at -np/-n
    first = parts[0]
    cut = next(i for i, a in enumerate(first) if a in ("-np", "-n"))
    return [first[:cut], first[cut:], *parts[1:]]


# ---------------------------------------------------------------- implementation

@pytest.mark.parametrize("text, impl", [
    ("mpirun (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/", OPENMPI),
    ("mpirun (Open MPI) 4.1.5", OPENMPI),
    ("HYDRA build details:\n    Version:  4.2.0\n", MPICH),
    ("MPICH Version: 4.1", MPICH),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.10", MPICH),
])
def test_parse_implementation(text, impl):
    assert parse_implementation(text) == impl


def test_parse_implementation_unknown_is_clear_error():
    with pytest.raises(LauncherError, match="cannot tell the MPI implementation"):
        parse_implementation("some other launcher 1.0")


def test_find_mpirun_order(tmp_path, monkeypatch):
    fake = tmp_path / "my-mpirun"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("POPRUN_LITE_MPIRUN", str(fake))
    assert find_mpirun() == str(fake)
    assert find_mpirun(sys.executable) == sys.executable  # --mpirun wins over the env var
    monkeypatch.setenv("POPRUN_LITE_MPIRUN", str(tmp_path / "missing"))
    with pytest.raises(LauncherError, match="not found"):
        find_mpirun()
    monkeypatch.delenv("POPRUN_LITE_MPIRUN")
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH: next to sys.executable
    found = find_mpirun()
    assert os.path.dirname(found) == os.path.dirname(sys.executable)


# ---------------------------------------------------------------- command building

def test_openmpi_command_shape():
    ranks = [RankSpec("replica", i, env={"A": str(i)}) for i in range(3)]
    cmd = build_command("mpirun", OPENMPI, ranks, ["python3", "t.py", "-v"],
                        global_args=["--mca", "btl", "self,tcp"], tag_output=True,
                        oversubscribe=True, allow_run_as_root=True, export=["PATH"])
    glob, *ctx = contexts(cmd)
    assert glob == ["mpirun", "--bind-to", "none", "--oversubscribe", "--allow-run-as-root",
                    "--tag-output", "--mca", "btl", "self,tcp"]
    assert len(ctx) == 3
    for i, c in enumerate(ctx):
        assert c == ["-np", "1", "-x", "PATH", "-x", f"A={i}",
                     *agent_command(["python3", "t.py", "-v"])]
    assert agent_command(["p"]) == [sys.executable, "-m", "popdist_lite_launcher.node.agent",
                                    "--", "p"]


def test_openmpi_flags_off_by_default():
    cmd = build_command("mpirun", OPENMPI, [RankSpec("replica", 0)], ["p"])
    assert cmd[:3] == ["mpirun", "--bind-to", "none"]
    for flag in ("--oversubscribe", "--allow-run-as-root", "--tag-output"):
        assert flag not in cmd


def test_mpich_command_shape():
    ranks = [RankSpec("replica", i, host=f"h{i // 2}", env={"A": str(i)},
                      mpi_args=["-genvnone"] if i == 1 else []) for i in range(4)]
    cmd = build_command("mpiexec", MPICH, ranks, ["p"], global_args=["-v"], tag_output=True,
                        oversubscribe=True, allow_run_as_root=True, export=["PATH"])
    glob, *ctx = contexts(cmd)
    assert glob == ["mpiexec", "-prepend-rank", "-hosts", "h0:2,h1:2", "-v"]
    # MPICH takes neither flag; it forwards the environment itself (no -x / -env PATH)
    assert not {"--oversubscribe", "--allow-run-as-root", "--bind-to", "-x"} & set(cmd)
    assert ctx[0] == ["-n", "1", "-env", "A", "0", *agent_command(["p"])]
    assert ctx[1][:5] == ["-n", "1", "-env", "A", "1"]
    assert ctx[1][5] == "-genvnone"
    assert "-host" not in cmd  # hydra rejects a host list per context


def test_hosts_and_hostfile_per_implementation():
    ranks = [RankSpec("replica", i, host=h) for i, h in enumerate(["a", "a", "b", "b"])]
    ompi = build_command("mpirun", OPENMPI, ranks, ["p"], hostfile="hf")
    assert ompi[ompi.index("--hostfile") + 1] == "hf"
    assert [ompi[i + 1] for i, a in enumerate(ompi) if a == "-H"] == ["a:2", "a:2", "b:2", "b:2"]
    mpich = build_command("mpiexec", MPICH, ranks, ["p"], hostfile="hf")
    # hydra: hosts only globally, and not together with a hostfile
    assert mpich[mpich.index("-hosts") + 1] == "a:2,b:2" and "-f" not in mpich
    feeders = ranks + [RankSpec("feeder", 0, host="a"), RankSpec("feeder", 1, host="b")]
    mpich = build_command("mpiexec", MPICH, feeders, ["p"])
    assert mpich[mpich.index("-hosts") + 1] == "a:2,b:2,a:1,b:1"
    mpich = build_command("mpiexec", MPICH, [RankSpec("replica", 0)], ["p"], hostfile="hf")
    assert mpich[mpich.index("-f") + 1] == "hf"


def test_build_command_errors():
    with pytest.raises(LauncherError, match="unknown MPI implementation"):
        build_command("mpirun", "lam", [RankSpec("replica", 0)], ["p"])
    with pytest.raises(LauncherError, match="at least one rank"):
        build_command("mpirun", OPENMPI, [], ["p"])


def test_feeder_like_specs_need_no_builder_change():
    """Other roles are just more rank specs (e.g. a host feeder per replica)."""
    ranks = [RankSpec("replica", 0, env={"POPDIST_LITE_ROLE": "replica"}),
             RankSpec("feeder", 0, env={"POPDIST_LITE_ROLE": "feeder"})]
    cmd = build_command("mpirun", OPENMPI, ranks, ["p"])
    assert cmd.count(":") == 1 and "POPDIST_LITE_ROLE=feeder" in cmd


# ---------------------------------------------------------------- rank plan

def test_plan_env_per_instance():
    opts, ranks = plan(["--num-replicas", "3", "--ipus-per-replica", "2"])
    assert opts.num_instances == 3
    assert [r.replica for r in ranks] == [0, 1, 2] and {r.role for r in ranks} == {"replica"}
    for i, r in enumerate(ranks):
        assert r.host is None
        env = r.env
        assert env["POPDIST_NUM_TOTAL_REPLICAS"] == "3"
        assert env["POPDIST_NUM_IPUS_PER_REPLICA"] == "2"
        assert env["POPDIST_NUM_LOCAL_REPLICAS"] == "1"
        assert env["POPDIST_UNIFORM_REPLICAS_PER_INSTANCE"] == "1"
        assert env["POPDIST_REPLICA_INDEX_OFFSET"] == str(i)
        assert env["POPDIST_LOCAL_INSTANCE_INDEX"] == str(i)
        assert env["POPDIST_LITE_ROLE"] == "replica"
        assert "POPDIST_LITE_ONLY_OUTPUT_FROM_INSTANCE" not in env
        # forwarded by name from mpirun's environment; the key file is set per attempt (launch.remote.deposit_keys)
        assert records.COLLECTOR_ENV not in env and keys.KEY_FILE_ENV not in env


def test_plan_hosts_divided_evenly():
    _, ranks = plan(["--num-replicas", "4", "-H", "h0,h1"])
    assert [r.host for r in ranks] == ["h0", "h0", "h1", "h1"]
    assert [r.env["POPDIST_LOCAL_INSTANCE_INDEX"] for r in ranks] == ["0", "1", "0", "1"]


def test_plan_hostfile(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# comment\nnodeA slots=4\n\nnodeB:2  # mpich style\n")
    assert hosts.read_hostfile(str(hostfile)) == [("nodeA", 4), ("nodeB", 2)]
    opts, ranks = plan(["--num-replicas", "2", "--hostfile", str(hostfile)])
    assert [r.host for r in ranks] == ["nodeA", "nodeB"] and opts.hostfile == str(hostfile)


def test_plan_local_args_and_output_selection():
    _, ranks = plan(["--num-replicas", "3", "--mpi-local-args=-x FOO --mca a b",
                     "--mpi-local-args", "-x BAR", "--instance-mpi-local-args", '1:-x "B Z"',
                     "--instance-mpi-local-args=1:-x Q", "--only-output-from-instance", "2"])
    assert ranks[0].mpi_args == ["-x", "FOO", "--mca", "a", "b", "-x", "BAR"]
    assert ranks[1].mpi_args == ["-x", "FOO", "--mca", "a", "b", "-x", "BAR", "-x", "B Z",
                                 "-x", "Q"]
    assert {r.env["POPDIST_LITE_ONLY_OUTPUT_FROM_INSTANCE"] for r in ranks} == {"2"}


def test_thread_vars_respect_user_settings(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    env = default_rank_env()
    assert "OMP_NUM_THREADS" not in env and env["MKL_NUM_THREADS"] == "1"
    assert env["OPENBLAS_NUM_THREADS"] == "1"
    _, ranks = plan(["--num-replicas", "2"])
    assert "OMP_NUM_THREADS" not in ranks[0].env


@pytest.mark.parametrize("program", [
    ["python3", "-v", "--num-replicas", "9"],
    ["python3", "t.py", "--mpi"],          # not an (ambiguous) abbreviation of our options
    ["python3", "-vx", "-H", "a", "--timeout=3", "--", "z"],
])
def test_program_args_are_not_parsed_as_options(program):
    opts = cli.parse_args(["--num-replicas", "2", *program])
    assert opts.num_replicas == 2 and not opts.verbose and opts.host is None
    assert opts.timeout == 0
    assert [opts.program, *opts.args] == program
    opts = cli.parse_args(["--", *program])
    assert [opts.program, *opts.args] == program


def test_topology_table():
    _, ranks = plan(["--num-replicas", "2", "-H", "h0,h1"])
    lines = format_topology(ranks).splitlines()
    assert lines[0].split() == ["replica", "instance", "rank", "host", "role"]
    assert lines[2].split() == ["1", "1", "1", "h1", "replica"]


@pytest.mark.parametrize("argv, message", [
    (["--num-replicas", "2", "--num-instances", "1"], "each instance drives exactly one"),
    (["--num-replicas", "0"], "must be at least 1"),
    (["--num-replicas", "two"], "invalid int value"),
    (["--num-replicas", "3", "-H", "a,b"], "divided evenly"),
    (["--num-replicas", "2", "--only-output-from-instance", "2"], "out of range"),
    (["--instance-mpi-local-args", "x-y"], "IDX"),
    (["--instance-mpi-local-args", "3:-x A"], "out of range"),
    (["--timeout", "-1"], "0 or more"),
    (["-H", "a", "--hostfile", "f"], "not allowed with"),
])
def test_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.parse_args([*argv, "prog"])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_program(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--num-replicas", "2"])
    assert "program" in capsys.readouterr().err


# ---------------------------------------------------------------- agent helpers

def test_agent_rank_and_output_selection():
    assert records.env_rank({"PMI_RANK": "3"}) == 3
    assert records.env_rank({"OMPI_COMM_WORLD_RANK": "1", "PMI_RANK": "3"}) == 1
    assert records.env_rank({"PMIX_RANK": "2"}) == 2
    assert records.env_rank({}) is None
    assert agent._is_shown({})
    sel = {"POPDIST_LITE_ONLY_OUTPUT_FROM_INSTANCE": "1"}
    assert agent._is_shown({**sel, "POPDIST_REPLICA_INDEX_OFFSET": "1"})
    assert not agent._is_shown({**sel, "POPDIST_REPLICA_INDEX_OFFSET": "0"})


def test_plan_timeline_sets_absolute_path_for_every_rank():
    _, ranks = plan(["--num-replicas", "2", "--timeline", "trace.json"])
    assert {r.env["POPDIST_LITE_TIMELINE"] for r in ranks} == {os.path.abspath("trace.json")}
    _, ranks = plan(["--num-replicas", "2"])
    assert all("POPDIST_LITE_TIMELINE" not in r.env for r in ranks)
