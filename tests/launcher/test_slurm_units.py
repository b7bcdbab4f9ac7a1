"""popdist_lite_launcher.slurm.allocation and .launcher without a cluster: the allocation read from Slurm's
environment (hostile values refused, naming the variable), the launcher choice, the
placement on the nodes' slots, the mpirun arguments of a launch through Slurm and
where SlurmLauncher puts them in mpirun's command."""

from __future__ import annotations

import pytest

from popdist_lite_launcher.core.api import Attempt, LauncherError
from popdist_lite_launcher.core.plan import plan_ranks
from popdist_lite_launcher.slurm import allocation, scontrol
from popdist_lite_launcher.slurm.launcher import SRUN_AGENT, SlurmLauncher, mpirun_args
from popdist_lite_launcher.ssh.launcher import ATTEMPT_AGENT, SshLauncher


def expand_two(nodelist):
    assert nodelist == "n[1-2]"
    return ["n1", "n2"]


@pytest.mark.parametrize("text, nodes, want", [
    ("2(x2)", 2, [2, 2]),
    ("2(x3),1", 4, [2, 2, 2, 1]),
    ("1,3", 2, [1, 3]),
    ("4", 1, [4]),
])
def test_tasks_per_node(text, nodes, want):
    assert allocation.parse_tasks_per_node(text, nodes) == want


def test_ntasks_per_node_is_one_count_for_every_node():
    assert allocation.parse_tasks_per_node("3", 4, "SLURM_NTASKS_PER_NODE") == [3, 3, 3, 3]
    with pytest.raises(LauncherError, match="SLURM_NTASKS_PER_NODE"):
        allocation.parse_tasks_per_node("2(x2)", 2, "SLURM_NTASKS_PER_NODE")


@pytest.mark.parametrize("text, match", [
    ("0", "at least 1"),
    ("2(x0)", "at least 1"),
    ("-1", "expected COUNT"),
    ("2(x2", "expected COUNT"),
    ("2x2", "expected COUNT"),
    ("", "expected COUNT"),
    ("2;rm -rf /", "expected COUNT"),
    ("1(x99999999)", "more nodes"),     # refused before it is expanded
    ("1,1,1", "more nodes"),
    ("1", "for 1 node"),
    ("1" * 70000, "longer than"),
])
def test_hostile_tasks_per_node(text, match):
    with pytest.raises(LauncherError, match=match):
        allocation.parse_tasks_per_node(text, 2)


def test_hostnames_are_checked():
    assert scontrol.parse_hostnames("n1\nn2\n") == ["n1", "n2"]
    for output, match in [("n1\n-oProxyCommand=x\n", "not a host name"), ("", "no node names"),
                          ("n1\nn1\n", "more than once"), ("n 1\n", "not a host name"),
                          ("n1;reboot\n", "not a host name")]:
        with pytest.raises(LauncherError, match=match):
            scontrol.parse_hostnames(output)


@pytest.mark.parametrize("text", ["", "-n1", "n[1-2] x", "n$(id)", "n1;n2", "a" * 70000])
def test_hostile_nodelist_never_reaches_scontrol(text):
    # refused before scontrol runs (running this one would fail with "cannot run")
    with pytest.raises(LauncherError, match="not a Slurm host list"):
        scontrol.expand_nodelist(text, scontrol="/nonexistent/scontrol")


def test_expand_nodelist_runs_scontrol(tmp_path):
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] || exit 3\necho a1; echo a2\n")
    fake.chmod(0o755)
    assert scontrol.expand_nodelist("a[1-2]", scontrol=str(fake)) == ["a1", "a2"]
    fake.write_text("#!/bin/sh\necho 'a1 && reboot'\n")
    with pytest.raises(LauncherError, match="not a host name"):
        scontrol.expand_nodelist("a[1-2]", scontrol=str(fake))
    fake.write_text("#!/bin/sh\necho 'bad list' >&2; exit 1\n")
    with pytest.raises(LauncherError, match="exited with 1: bad list"):
        scontrol.expand_nodelist("a[1-2]", scontrol=str(fake))


def test_allocation_from_the_environment():
    env = {"SLURM_JOB_ID": "17", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2,1",
           "SLURM_JOB_NUM_NODES": "2"}
    got = allocation.from_environment(env, expand=expand_two)
    assert (got.job_id, got.nodes, got.tasks, got.total_tasks) == ("17", ("n1", "n2"), (2, 1), 3)
    assert got.slots == {"n1": 2, "n2": 1}
    assert got.describe() == "slurm job 17: 2 node(s) n[1-2], 3 task(s): n1 2, n2 1"
    env2 = {"SLURM_JOB_ID": "17", "SLURM_NODELIST": "n[1-2]", "SLURM_NTASKS_PER_NODE": "3"}
    assert allocation.from_environment(env2, expand=expand_two).tasks == (3, 3)
    assert allocation.from_environment({}, expand=expand_two) is None


@pytest.mark.parametrize("change, match", [
    ({"SLURM_JOB_ID": "17; rm"}, "SLURM_JOB_ID is not a Slurm job id"),
    ({"SLURM_JOB_NODELIST": ""}, "SLURM_JOB_NODELIST is not set"),
    ({"SLURM_JOB_NUM_NODES": "3"}, "SLURM_JOB_NUM_NODES '3' does not match"),
    ({"SLURM_TASKS_PER_NODE": ""}, "neither"),
    ({"SLURM_TASKS_PER_NODE": "2(x3)"}, "SLURM_TASKS_PER_NODE .* more nodes"),
])
def test_hostile_allocation(change, match):
    env = {"SLURM_JOB_ID": "17", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    env.update(change)
    with pytest.raises(LauncherError, match=match):
        allocation.from_environment(env, expand=expand_two)


def test_choose_launcher():
    assert allocation.choose_launcher("auto", inside=True, hosts_given=False) == "slurm"
    assert allocation.choose_launcher("auto", inside=True, hosts_given=True) == "ssh"
    assert allocation.choose_launcher("auto", inside=False, hosts_given=False) == "ssh"
    assert allocation.choose_launcher("ssh", inside=True, hosts_given=False) == "ssh"
    assert allocation.choose_launcher("slurm", inside=True, hosts_given=True) == "slurm"
    with pytest.raises(LauncherError, match="needs a Slurm allocation"):
        allocation.choose_launcher("slurm", inside=False, hosts_given=False)


def test_place_fills_nodes_in_order():
    slots = {"a": 2, "b": 2, "c": 1}
    assert allocation.place(["a", "b", "c"], slots, 5) == [("a", 2), ("b", 2), ("c", 1)]
    assert allocation.place(["a", "b", "c"], slots, 3) == [("a", 2), ("b", 1)]
    with pytest.raises(LauncherError, match="more than the 5 task"):
        allocation.place(["a", "b", "c"], slots, 6)


def test_mpirun_args():
    assert mpirun_args("openmpi") == ["--prtemca", "plm", "slurm"]
    assert mpirun_args("mpich") == ["-launcher", "slurm"]


# ------------------------------------------------------------------ poprun-lite's options

@pytest.fixture
def in_allocation(monkeypatch):
    """Slurm job 17 on n1 and n2 with 2 tasks each (scontrol replaced by expand_two)."""
    for name in [k for k in __import__("os").environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_JOB_ID", "17")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x2)")
    monkeypatch.setattr(scontrol, "expand_nodelist", expand_two)


def test_options_inside_an_allocation(in_allocation):
    from popdist_lite_launcher import cli
    opts = cli.parse_args(["prog"])
    assert (opts.launcher, opts.num_replicas, opts.hosts) == ("slurm", 4, ["n1", "n2"])
    assert opts.launch_agent == SRUN_AGENT
    assert [spec.host for spec in plan_ranks(opts)] == ["n1", "n1", "n2", "n2"]
    opts = cli.parse_args(["--num-replicas", "3", "--feeders-per-replica", "1", "prog"])
    assert [(s.host, s.role) for s in plan_ranks(opts)] == [
        ("n1", "replica"), ("n1", "replica"), ("n2", "replica"),
        ("n1", "feeder"), ("n1", "feeder"), ("n2", "feeder")]
    opts = cli.parse_args(["--launcher", "ssh", "prog"])  # mpirun over ssh, Slurm's hosts
    assert (opts.launcher, opts.num_replicas, opts.hosts, opts.launch_agent) == (
        "ssh", 4, ["n1", "n2"], "ssh")


def test_hosts_given_inside_an_allocation(in_allocation):
    from popdist_lite_launcher import cli
    opts = cli.parse_args(["-H", "h1,h2", "--num-replicas", "2", "prog"])
    assert (opts.launcher, opts.allocation, opts.hosts) == ("ssh", None, ["h1", "h2"])
    assert cli.parse_args(["-H", "h1", "prog"]).num_replicas == 1


def test_bad_options_inside_an_allocation(in_allocation, monkeypatch, capsys):
    from popdist_lite_launcher import cli
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(["--num-replicas", "5", "prog"])
    assert exc.value.code == 2 and "more than the 4 task(s)" in capsys.readouterr().err
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x2);x")
    with pytest.raises(SystemExit):
        cli.parse_args(["prog"])
    assert "$SLURM_TASKS_PER_NODE: expected COUNT" in capsys.readouterr().err


def test_options_outside_an_allocation(monkeypatch, capsys):
    from popdist_lite_launcher import cli
    for name in [k for k in __import__("os").environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    opts = cli.parse_args(["prog"])
    assert (opts.launcher, opts.num_replicas, opts.hosts, opts.allocation) == ("ssh", 1, None, None)
    with pytest.raises(SystemExit):
        cli.parse_args(["--launcher", "slurm", "prog"])
    assert "--launcher slurm needs a Slurm allocation" in capsys.readouterr().err


# ------------------------------------------------------------------ the launch command

class _Collector:
    """What SshLauncher._launch reads of a collector (no sockets)."""
    address, key = "10.0.0.1:5000", b"k" * 32

    def send(self, rank, record):
        raise AssertionError("nothing is sent before the job runs")

    def subscribe(self, kind, callback):
        pass


def _command(monkeypatch, launcher_class, opts, implementation="openmpi"):
    """The mpirun command ``launcher_class`` runs for attempt 0 of ``opts`` (mpirun.run_mpirun
    replaced by a recorder), with the ranks' hosts taken as remote."""
    from popdist_lite_launcher.launch import mpirun
    seen = []
    monkeypatch.setattr(mpirun, "run_mpirun", lambda cmd, collector, **kw: seen.append(cmd))
    ranks = plan_ranks(opts)
    remote = list(dict.fromkeys(spec.host for spec in ranks))
    launcher = launcher_class(opts, "mpirun", implementation)
    attempt = Attempt(0, None, None)
    launcher._launch(attempt, ranks, remote, "10.0.0.1", _Collector(), "mark")
    return seen[0]


@pytest.mark.parametrize("implementation, first", [("openmpi", ["--prtemca", "plm", "slurm"]),
                                                   ("mpich", ["-launcher", "slurm"])])
def test_launch_through_slurm(in_allocation, monkeypatch, capsys, implementation, first):
    from popdist_lite_launcher import cli
    opts = cli.parse_args(["--print-topology", "--mpi-global-args=--mine", "prog"])
    cmd = _command(monkeypatch, SlurmLauncher, opts, implementation)
    at = cmd.index(first[0])
    assert cmd[at:at + len(first)] == first and at < cmd.index("--mine"), cmd  # first global args
    assert ATTEMPT_AGENT not in " ".join(cmd), cmd    # mpirun's own Slurm launch
    out = capsys.readouterr().out
    assert out.startswith("slurm job 17: 2 node(s) n[1-2], 4 task(s): n1 2, n2 2; "
                          "launcher slurm\nreplica"), out
    # the same options under --launcher ssh: mpirun over the attempt agent, the same line
    opts = cli.parse_args(["--launcher", "ssh", "--print-topology", "prog"])
    cmd = _command(monkeypatch, SshLauncher, opts, implementation)
    assert "slurm" not in cmd and ATTEMPT_AGENT in " ".join(cmd), cmd
    assert "; launcher ssh\nreplica" in capsys.readouterr().out


@pytest.mark.parametrize("hold", [False, True])
def test_hydra_on_this_node_alone_calls_back_at_an_address(in_allocation, hold):
    """Every rank on the batch script's node (a job left with one node): MPICH's hydra
    still starts its proxy with srun, and the proxy must call hydra back at an address,
    not at this node's name, which need not resolve (the test cluster's do not)."""
    from types import SimpleNamespace

    from popdist_lite_launcher import cli
    opts = cli.parse_args(["prog"])
    preemption = SimpleNamespace(settings=SimpleNamespace(enabled=hold))
    local = SlurmLauncher(opts, "mpiexec", "mpich", preemption).local_launch()
    assert local[-2:] == ["-localhost", "127.0.0.1"], local
    assert ("-launcher-exec" in local) == hold, local
    assert SlurmLauncher(opts, "mpirun", "openmpi", preemption).local_launch() == []
