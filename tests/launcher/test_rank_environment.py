"""What every rank finds in its environment besides PopDist's (issue 39): torchrun's
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` on the replicas (the user's own values win), and the launcher's terminal
size (``COLUMNS``, ``LINES``, and the rank's pty sized by its agent). Units first; then one
poprun-lite run on a terminal: a torchrun-style script, unchanged, initialises
``torch.distributed`` on gloo, all-reduces, and draws a tqdm bar."""

import os
import pty
import socket
import sys
import textwrap

import pytest

from popdist_lite_launcher import cli
from popdist_lite_launcher.core.plan import TORCHRUN_VARS, format_topology, plan_ranks, terminal_env
from popdist_lite_launcher.core.api import LauncherError
from popdist_lite_launcher.launch.base import _remote_port, rendezvous, reserve_port
from popdist_lite_launcher.node.agent import size_terminal
from helpers import JOB_SECONDS, run_on_a_terminal, timeout_for


@pytest.fixture
def no_torchrun_env(monkeypatch):
    for name in (*TORCHRUN_VARS, "COLUMNS", "LINES"):
        monkeypatch.delenv(name, raising=False)


def plan(*argv):
    return plan_ranks(cli.parse_args([*argv, "python", "train.py"]))


def test_replicas_get_torchruns_variables(no_torchrun_env):
    ranks = plan("--num-replicas", "4", "-H", "a:2,b:2")
    got = [{name: spec.env[name] for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
           for spec in ranks]
    assert got == [{"RANK": str(r), "WORLD_SIZE": "4", "LOCAL_RANK": str(r % 2), "LOCAL_WORLD_SIZE": "2"}
                   for r in range(4)]


def test_feeders_get_none_of_them(no_torchrun_env):
    ranks = plan("--num-replicas", "2", "--feeders-per-replica", "1")
    assert [spec.role for spec in ranks] == ["replica", "replica", "feeder", "feeder"]
    assert all(name not in spec.env for spec in ranks[2:] for name in TORCHRUN_VARS)
    assert ranks[3].env["POPDIST_LITE_FEEDER_OF"] == "1"


def test_the_users_own_values_win(no_torchrun_env, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "99")
    monkeypatch.setenv("MASTER_PORT", "29500")
    ranks = plan("--num-replicas", "2")
    assert all("WORLD_SIZE" not in spec.env for spec in ranks)   # mpirun passes the user's on
    assert [spec.env["RANK"] for spec in ranks] == ["0", "1"]
    assert rendezvous(None, "127.0.0.1", "ssh") == {"MASTER_ADDR": "127.0.0.1"}
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    assert rendezvous("elsewhere", "127.0.0.1", "no-such-agent") == {}


def test_rank_zero_here_gets_the_launchers_address_and_a_reserved_port(no_torchrun_env):
    found = rendezvous(None, "10.1.0.1", "ssh")
    assert found["MASTER_ADDR"] == "10.1.0.1"
    port = int(found["MASTER_PORT"])
    plain = socket.socket()
    with pytest.raises(OSError):   # held: in TIME_WAIT, nobody binds it without SO_REUSEADDR ...
        plain.bind(("0.0.0.0", port))
    plain.close()
    with socket.socket() as server:  # ... and a server that sets it (as TCPStore does) can
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("0.0.0.0", port))
        server.listen(1)
    assert reserve_port() != reserve_port()


@pytest.mark.parametrize("answer", ["70000", "0", "\u00b2", "29500 extra", ""])
def test_a_remote_port_is_checked_as_another_hosts_word(tmp_path, answer):
    """rank 0's host answers the reservation through the launch agent: only a port number
    (1-65535, ASCII digits) becomes MASTER_PORT; anything else is a one-line error."""
    agent = tmp_path / "agent"
    agent.write_text(f"#!/bin/sh\nprintf '%s\\n' '{answer}'\n")
    agent.chmod(0o755)
    with pytest.raises(LauncherError, match="cannot reserve MASTER_PORT on rank 0's host h1"):
        _remote_port(str(agent), "h1")


def test_a_remote_port_number_is_taken(tmp_path):
    agent = tmp_path / "agent"
    agent.write_text("#!/bin/sh\necho 29500\n")
    agent.chmod(0o755)
    assert _remote_port(str(agent), "h1") == "29500"


def test_terminal_size_only_from_a_terminal_and_not_over_the_users(no_torchrun_env, monkeypatch):
    parent, child = pty.openpty()
    try:
        os.set_blocking(child, True)
        import termios
        termios.tcsetwinsize(child, (33, 111))
        with os.fdopen(os.dup(child), "w") as stream:
            assert terminal_env({}, stream) == {"COLUMNS": "111", "LINES": "33"}
            assert terminal_env({"COLUMNS": "80"}, stream) == {"LINES": "33"}
            termios.tcsetwinsize(child, (0, 0))   # a size unknown, as Open MPI gives its ranks
            assert terminal_env({}, stream) == {}
        with open(os.devnull, "w") as stream:
            assert terminal_env({}, stream) == {}
        # the agent gives a pty of no size the launcher's, and leaves a sized one alone
        size_terminal({"COLUMNS": "120", "LINES": "40"}, child)
        assert os.get_terminal_size(child) == (120, 40)
        size_terminal({"COLUMNS": "60", "LINES": "20"}, child)
        assert os.get_terminal_size(child) == (120, 40)
    finally:
        os.close(parent)
        os.close(child)


def test_print_topology_names_this_host():
    table = format_topology(plan("--num-replicas", "2"))
    assert table.splitlines()[1].split()[3] == socket.gethostname()
    assert "localhost" not in table


@timeout_for(1)
def test_a_torchrun_script_runs_unchanged_and_tqdm_draws(tmp_path):
    """``poprun-lite --num-replicas 2 python script.py`` on a 100 x 30 terminal: the script
    reads RANK/WORLD_SIZE, ``init_process_group("gloo")`` (env://, MASTER_ADDR/PORT)
    and all-reduces 1 + 2 (a numpy-free reference: 3 on both ranks); its tqdm bar on
    stdout is drawn at the terminal's width (a 0x0 pty draws nothing)."""
    pytest.importorskip("torch")
    pytest.importorskip("tqdm")
    script = tmp_path / "torchrun_style.py"
    script.write_text(textwrap.dedent("""
        import os
        import torch
        import torch.distributed as dist
        from tqdm import tqdm
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo")
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        print(f"rank {rank} of {world}: sum {total.item():g}", flush=True)
        dist.destroy_process_group()
        if rank == 0:
            for _ in tqdm(range(4), desc="steps", file=sys.stdout, mininterval=0):
                pass
    """).replace("import os\n", "import os\nimport sys\n", 1))
    code, out = run_on_a_terminal([sys.executable, "-m", "popdist_lite_launcher", "--num-replicas", "2",
                                   "--timeout", str(JOB_SECONDS), sys.executable, str(script)], rows=30, columns=100)
    assert code == 0, out
    assert "rank 0 of 2: sum 3" in out and "rank 1 of 2: sum 3" in out, out
    bars = [line for line in out.replace("\r", "\n").splitlines() if line.startswith("steps: 100%")]
    assert bars, out
    assert 90 <= len(bars[-1].rstrip()) <= 100 and "4/4" in bars[-1], bars   # the 100 columns
