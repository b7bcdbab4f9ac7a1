"""popdist_lite_launcher.slurm.nodes without a cluster: Slurm's answers about the
allocation's nodes (hostile output refused), which nodes are usable, the fixed policy's
membership after a node is lost, and which jobs get the Slurm policies. The real loss
of a node is tests/slurm/test_slurm_node_loss.py."""

from __future__ import annotations

import subprocess

import pytest

from popdist_lite_launcher.core.api import LauncherError, Membership
from popdist_lite_launcher.membership.policies import ElasticPolicy
from popdist_lite_launcher.slurm import nodes as slurm_nodes, scontrol
from popdist_lite_launcher.slurm.launcher import SlurmLauncher


def done(stdout: str, returncode: int = 0) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess([], returncode, stdout, "")


def expand(nodelist: str) -> list[str]:
    """``scontrol show hostnames`` for the lists these tests use, checked as the real one."""
    names = {"n[1-3]": "n1\nn2\nn3\n", "n[1,3]": "n1\nn3\n", "n1": "n1\n",
             "n[1-2],x;y": "n1\nn2\nx;y\n"}
    if nodelist not in names:
        raise LauncherError(f"unexpected list {nodelist!r}")
    return scontrol.parse_hostnames(names[nodelist])


def fake_nodes(squeue: str, sinfo: str, probe=None, calls=None) -> slurm_nodes.Nodes:
    def run(argv):
        if calls is not None:
            calls.append(argv)
        return done(squeue if argv[0] == "squeue" else sinfo)
    return slurm_nodes.Nodes("17", ["n1", "n2", "n3"], "srun-agent", run=run, expand=expand,
                             probe=probe or (lambda nodes: {node: None for node in nodes}))


@pytest.mark.parametrize("state, usable", [
    ("mixed", True), ("allocated", True), ("idle", True), ("completing", True),
    ("down*", False), ("mixed*", False), ("drained", False), ("draining", False),
    ("fail", False), ("unknown", False), (None, False), ("", False), ("MIXED", False),
    ("mixed; rm", False), ("idle" + "*" * 20, False),
])
def test_usable_state(state, usable):
    assert slurm_nodes.usable_state(state) is usable


def test_states_are_parsed_and_checked():
    output = ("n1 mixed\nn2 down*\nn1 mixed\nother idle\nn3 idle extra\n-n3 idle\n"
              "n3\tbad!state!\n\nn3 ~idle\n")
    assert slurm_nodes.parse_states(output, ["n1", "n2", "n3"]) == {"n1": "mixed", "n2": "down*"}


def test_usable_nodes():
    calls = []
    nodes = fake_nodes("n[1-3]\n", "n1 mixed\nn2 down*\nn3 allocated\n", calls=calls)
    usable, why = nodes.usable()
    assert usable == ["n1", "n3"]
    assert why == {"n2": "node n2 of Slurm job 17 is down*"}
    assert calls == [["squeue", "-h", "-j", "17", "-o", "%N"],
                     ["sinfo", "-h", "-N", "-n", "n1,n2,n3", "-o", "%N %T"]]


def test_a_node_slurm_took_out_of_the_job():
    usable, why = fake_nodes("n[1,3]\n", "n1 mixed\nn3 mixed\n").usable()
    assert usable == ["n1", "n3"]
    assert why == {"n2": "node n2 is no longer a node of Slurm job 17"}


@pytest.mark.parametrize("squeue", ["", "n[1-2],x;y\n", "--help\n", "n[1-3] extra\n", "x" * 70000])
def test_hostile_job_nodelist_keeps_the_allocation(squeue):
    """A node list that does not pass is not used: the allocation's nodes stay, with
    their states deciding."""
    calls = []
    usable, why = fake_nodes(squeue, "n1 mixed\nn2 mixed\nn3 mixed\n", calls=calls).usable()
    assert usable == ["n1", "n2", "n3"] and why == {}
    assert calls[-1][:3] == ["sinfo", "-h", "-N"]


def test_no_state_is_not_usable():
    usable, why = fake_nodes("n[1-3]", "n1 mixed\n").usable()
    assert usable == ["n1"]
    assert why["n2"] == "node n2 of Slurm job 17: sinfo gave no state"


def test_a_failed_sinfo_leaves_it_to_the_probe():
    def run(argv):
        return done("n[1-3]") if argv[0] == "squeue" else done("", returncode=1)

    def probe(nodes):
        return {node: ("host n2 is not reachable" if node == "n2" else None) for node in nodes}

    nodes = slurm_nodes.Nodes("17", ["n1", "n2", "n3"], "srun-agent", run=run, expand=expand, probe=probe)
    assert nodes.usable() == (["n1", "n2", "n3"], {})
    assert nodes.gone(["n1", "n2", "n3"]) == {"n2": "host n2 is not reachable"}


def test_gone_asks_the_probe_only_for_nodes_slurm_still_counts():
    probed = []

    def probe(nodes):
        probed.append(list(nodes))
        return {node: (f"host {node} is not reachable" if node == "n3" else None) for node in nodes}

    nodes = fake_nodes("n[1-3]", "n1 mixed\nn2 down*\nn3 mixed\n", probe=probe)
    assert nodes.gone(["n1", "n2", "n3"]) == {"n2": "node n2 of Slurm job 17 is down*",
                                              "n3": "host n3 is not reachable"}
    assert probed == [["n1", "n3"]]


def test_gone_does_not_probe_again_a_node_the_cleanup_did_not_reach():
    probed = []

    def probe(nodes):
        probed.append(list(nodes))
        return {node: None for node in nodes}

    nodes = fake_nodes("n[1-3]", "n1 mixed\nn2 down*\nn3 mixed\n", probe=probe)
    unreached = {"n2": "host n2 is not reachable: the cleanup", "n3": "host n3 is not reachable: the cleanup"}
    assert nodes.gone(["n1", "n2", "n3"], unreached) == {"n2": "node n2 of Slurm job 17 is down*",
                                                         "n3": "host n3 is not reachable: the cleanup"}
    assert probed == [["n1"]]


# ------------------------------------------------------------------ the policies

@pytest.fixture
def in_allocation(monkeypatch):
    """Slurm job 17 on n1, n2, n3 with 2 tasks each (scontrol replaced)."""
    for name in [k for k in __import__("os").environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_JOB_ID", "17")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-3]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x3)")
    monkeypatch.setattr(scontrol, "expand_nodelist", expand)


def options(*argv):
    from popdist_lite_launcher import cli
    return cli.parse_args([*argv, "prog"])


class Gone:
    """A :class:`slurm_nodes.Nodes` stand-in: ``gone`` says the nodes in ``lost``."""

    job_id = "17"

    def __init__(self, *lost):
        self.lost = lost

    def gone(self, used, unreachable=None):
        return {node: f"node {node} is down*" for node in used if node in self.lost}


def test_fixed_policy_restarts_on_the_nodes_left(in_allocation):
    opts = options("--max-restarts", "1")
    policy = slurm_nodes.SlurmFixedPolicy(opts, Gone("n2"))
    first = policy.next(None, print)
    assert first == Membership((("n1", 2), ("n2", 2), ("n3", 2)))
    said = []
    assert policy.lost(first, said.append, {}) == ["n2"]
    assert said == ["Slurm node n2 lost: node n2 is down*"]
    assert policy.next(None, print) == Membership((("n1", 2), ("n3", 2)))


def test_fixed_policy_fills_the_nodes_left_up_to_the_replicas(in_allocation):
    opts = options("--max-restarts", "3", "--num-replicas", "3")
    policy = slurm_nodes.SlurmFixedPolicy(opts, Gone("n1"))
    assert policy.next(None, print) == Membership((("n1", 2), ("n2", 1)))
    assert policy.lost(policy.next(None, print), print, {}) == ["n1"]
    assert policy.next(None, print) == Membership((("n2", 2), ("n3", 1)))


def test_fixed_policy_without_restarts_names_the_node_and_fails(in_allocation):
    opts = options()
    policy = slurm_nodes.SlurmFixedPolicy(opts, Gone("n3"))
    said = []
    first = policy.next(None, print)
    assert policy.lost(first, said.append, {}) == []
    assert said == ["Slurm node n3 lost: node n3 is down*",
                    "not restarting without node n3 (no --max-restarts or --min-replicas)"]
    assert policy.next(None, print) == first


def test_fixed_policy_with_no_node_left(in_allocation):
    opts = options("--max-restarts", "1", "--num-replicas", "2")
    policy = slurm_nodes.SlurmFixedPolicy(opts, Gone("n1"))
    said = []
    assert policy.lost(policy.next(None, print), said.append, {}) == ["n1"]
    policy = slurm_nodes.SlurmFixedPolicy(opts, Gone("n1", "n2", "n3"))
    assert policy.lost(Membership((("n1", 2), ("n2", 2), ("n3", 2))), said.append, {}) == []
    assert said[-1] == "no node of Slurm job 17 is left to restart on"


def test_cluster_discovers_the_usable_nodes(in_allocation):
    opts = options("--min-replicas", "2")
    nodes = fake_nodes("n[1-3]", "n1 mixed\nn2 down*\nn3 idle\n")
    cluster = slurm_nodes.SlurmCluster(opts, nodes)
    assert cluster.discover() == [("n1", 2), ("n3", 2)]
    # named even when it is this machine: mpirun gets -H, not the whole allocation
    assert cluster.size([("localhost", 2)]) == Membership((("localhost", 2),))


def test_slurm_launcher_lets_mpiruns_steps_overlap(in_allocation):
    opts = options()
    launcher = SlurmLauncher(opts, "mpirun", "openmpi")
    assert launcher.environment({"A": "1"}) == {"A": "1", "SLURM_OVERLAP": "1"}


def test_which_jobs_get_the_slurm_policies(in_allocation):
    assert isinstance(slurm_nodes.make_policy(options()), slurm_nodes.SlurmFixedPolicy)
    elastic = slurm_nodes.make_policy(options("--min-replicas", "2"))
    assert isinstance(elastic, ElasticPolicy)
    assert isinstance(elastic.cluster, slurm_nodes.SlurmCluster)
    assert slurm_nodes.make_policy(options("--launcher", "ssh")) is None
    assert slurm_nodes.make_policy(options("-H", "n1,n2", "--num-replicas", "2")) is None
