"""Commands on other hosts, through the launch agent (``--launch-agent``: ssh; the
``srun`` agent inside a Slurm allocation), all hosts at once: the check that every host
is usable before mpirun starts (reachable with the launch agent, and able to reach the
launcher over the job's network with the check's key: the probe,
:mod:`popdist_lite_launcher.node.probe`), the job's key files
(:mod:`popdist_lite_launcher.node.keys`) and the cleanup after an attempt
(:mod:`popdist_lite_launcher.node.cleanup`). Host names are checked earlier, by
:mod:`popdist_lite_launcher.core.hosts`; the commands put ``--`` before the host
(:func:`check_command`).
"""

from __future__ import annotations

import concurrent.futures
import shlex
import shutil
import subprocess
import sys
import time

from . import children
from ..core.api import AttemptError, LauncherError
from ..core.hosts import is_local_host
from ..core.plan import RankSpec
from ..core.text import shown
from ..node import cleanup, keys, probe
from ..supervise.collector import Collector

#: Seconds a host gets to answer the reachability check (the launch agent's whole run).
HOST_CHECK_TIMEOUT_SECONDS = 20.0
#: Seconds the cleanup of all hosts may take.
CLEANUP_TIMEOUT_SECONDS = 20.0


def check_command(launch_agent: str, host: str, command=("true",)) -> list[str]:
    """The command that runs ``command`` on ``host``: ``AGENT -- HOST COMMAND`` (``--``:
    nothing after it is an option, whatever the host's name; ssh also gets ``-o
    BatchMode=yes`` and a connect timeout so that a password prompt or a dead host fails
    at once)."""
    agent = shlex.split(launch_agent)
    if agent and agent[0].rsplit("/", 1)[-1] == "ssh":
        agent += ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
    return [*agent, "--", host, *command]


def run_on_hosts(launch_agent: str, hosts: list[str], command, *, timeout: float,
                 input_text: str | None = None) -> dict[str, "subprocess.CompletedProcess | str"]:
    """Run ``command(host, index)`` (an argument list) on every host of ``hosts`` with the
    launch agent, all at once, ``input_text`` on its standard input: for each host its
    completed process, or why it did not complete (no answer within ``timeout`` s, cannot
    be run)."""
    def run(index_host):
        index, host = index_host
        cmd = check_command(launch_agent, host, command(host, index))
        try:  # in its own session, killed with its group by children.kill_all too
            return children.run(cmd, input_text=input_text, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"no answer within {timeout:g} s from `{shlex.join(cmd)}`"
        except OSError as exc:
            return f"cannot run `{shlex.join(cmd)}`: {exc}"

    unique = list(dict.fromkeys(hosts))
    if not unique:
        return {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(unique))) as pool:
        return dict(zip(unique, pool.map(run, enumerate(unique))))


def failure(outcome) -> str | None:
    """What went wrong running a command on a host (``outcome``: from :func:`run_on_hosts`):
    why it did not complete, or the command (in backquotes) ``exited with N`` and the last
    lines it printed (stderr, else stdout); None when it exited 0."""
    if isinstance(outcome, str):
        return outcome
    if outcome.returncode == 0:
        return None
    said = (outcome.stderr.strip() or outcome.stdout.strip()).splitlines()[-5:]
    return f"`{shlex.join(outcome.args)}` exited with {outcome.returncode}" + (": " + " / ".join(said) if said else "")


def not_reachable(launch_agent: str, host: str, problem: str) -> str:
    """The sentence naming ``host`` that the launch agent did not reach, and ``problem``."""
    return f"host {host} is not reachable with the launch agent {launch_agent!r}: {problem}"


def probe_hosts(launch_agent: str, hosts: list[str], address: str,
                timeout: float = HOST_CHECK_TIMEOUT_SECONDS) -> dict[str, str | None]:
    """Check that every host of ``hosts`` is usable, all at once: a probe started there
    with the launch agent (:mod:`popdist_lite_launcher.node.probe`) reaches a check server the
    launcher runs on ``address`` (its address on the job's network) and authenticates
    with a new key, passed on the probe's standard input.

    Returns:
        for each host None (usable) or a sentence naming it and what failed: the launch
        agent (``host H is not reachable with the launch agent ...``, its exit code and
        output), or the network (``host H cannot connect to poprun-lite at ADDRESS over
        the job network: timed out after 5 s``, in the probe's words).

    Raises:
        OSError: the check server cannot listen on ``address``.
    """
    with Collector(address, ranks=len(hosts)) as server:
        outcomes = run_on_hosts(
            launch_agent, hosts, lambda host, index: [sys.executable, "-m", probe.__name__,
                                                      server.address, str(index)],
            timeout=timeout, input_text=server.key.hex() + "\n")
        deadline = time.monotonic() + 2.0  # a hello is recorded just after its welcome left
        index = {host: i for i, host in enumerate(outcomes)}
        want = {index[h] for h, o in outcomes.items() if not isinstance(o, str) and o.returncode == 0}
        while time.monotonic() < deadline and not want <= _welcomed(server):
            time.sleep(0.02)
        welcomed = _welcomed(server)
    problems: dict[str, str | None] = {}
    for host, outcome in outcomes.items():
        said = "" if isinstance(outcome, str) else outcome.stderr.strip()
        if not isinstance(outcome, str) and outcome.returncode == probe.FAILED and probe.PREFIX in said:
            line = said[said.rindex(probe.PREFIX):].splitlines()[0]
            problems[host] = f"host {host} {line.split(': ', 1)[-1]}"
        elif failure(outcome) is not None:
            problems[host] = not_reachable(launch_agent, host, failure(outcome))
        elif index[host] not in welcomed:
            problems[host] = (f"host {host}: the probe exited 0 but never authenticated to "
                              f"poprun-lite at {server.address}")
        else:
            problems[host] = None
    return problems


def _welcomed(server) -> set[int]:
    """The indices of the probes the check server has welcomed."""
    return {r["replica"] for r in server.records("hello") if r["role"] == "probe"}


def check_hosts(launch_agent: str, hosts: list[str], timeout: float = HOST_CHECK_TIMEOUT_SECONDS,
                *, address: str | None = None) -> None:
    """Check every host at once: with ``address`` the probe of :func:`probe_hosts`,
    without it ``AGENT -- HOST true`` (the launch agent alone).

    Raises:
        LauncherError: naming the first host (in the given order) that failed and how
            (the agent's exit status and the last lines of its output, or what the probe
            could not reach).
    """
    if address is None:
        outcomes = run_on_hosts(launch_agent, hosts, lambda host, index: ["true"], timeout=timeout)
        problems = {host: not_reachable(launch_agent, host, failure(o)) if failure(o) else None
                    for host, o in outcomes.items()}
    else:
        problems = probe_hosts(launch_agent, hosts, address, timeout)
    for host in dict.fromkeys(hosts):
        if problems.get(host):
            raise LauncherError(problems[host])


def deposit_keys(ranks: list[RankSpec], remote: list[str], key: bytes, mark: str,
                 launch_agent: str) -> str | None:
    """Give every rank's agent the job's ``key`` in a file of its own on its host
    (:func:`keys.write_keys <popdist_lite_launcher.node.keys.write_keys>`), and set the
    file's path in the rank's environment (:data:`keys.KEY_FILE_ENV
    <popdist_lite_launcher.node.keys.KEY_FILE_ENV>`, in ``ranks[i].env``): on this host
    directly, on each host of ``remote`` with the launch agent running
    ``python -m popdist_lite_launcher.node.keys MARK RANK...`` with the key on its standard
    input (all hosts at once), whose printed directory is checked
    (:func:`keys.is_key_dir <popdist_lite_launcher.node.keys.is_key_dir>`). Returns this
    host's key directory (None: no rank here), for the caller to remove after the
    attempt; the cleanup removes the others' (``remove_keys``).

    Raises:
        AttemptError: naming the host where the files could not be written.
    """
    hosts: dict[str | None, list[int]] = {}
    for rank, spec in enumerate(ranks):
        hosts.setdefault(None if is_local_host(spec.host) else spec.host, []).append(rank)
    directories: dict[str | None, str] = {}
    try:
        if None in hosts:
            directories[None] = keys.write_keys(key, hosts[None], mark)
    except OSError as exc:
        raise AttemptError(f"cannot write the job's key files on this host: {exc}") from None
    outcomes = run_on_hosts(
        launch_agent, remote, lambda host, index: [sys.executable, "-m", keys.__name__, mark,
                                                   *map(str, hosts[host])],
        timeout=HOST_CHECK_TIMEOUT_SECONDS, input_text=key.hex() + "\n")
    for host in remote:
        outcome = outcomes[host]
        printed = "" if isinstance(outcome, str) else outcome.stdout.strip()
        problem = failure(outcome) or (None if keys.is_key_dir(printed, mark) else
                                       f"it printed {shown(printed)}, not a key directory of the attempt")
        if problem is not None:
            if None in directories:
                shutil.rmtree(directories[None], ignore_errors=True)
            raise AttemptError(f"cannot give the job's key to host {host} with the launch agent: {problem}")
        directories[host] = printed
    for host, members in hosts.items():
        for rank in members:
            ranks[rank].env[keys.KEY_FILE_ENV] = f"{directories[host]}/{keys.key_file_name(rank)}"
    return directories.get(None)


def remote_command(mark: str) -> list[str]:
    """What :func:`clean_hosts` runs on a host."""
    return [sys.executable, "-m", cleanup.__name__, mark]


def clean_hosts(launch_agent: str, hosts: list[str], mark: str,
                timeout: float = CLEANUP_TIMEOUT_SECONDS) -> tuple[dict[str, str], dict[str, str]]:
    """Kill what is left of the attempt ``mark`` on every host of ``hosts`` (run with the
    launch agent, all at once).

    Returns:
        for each host where that failed, why (:func:`failure`); and for the hosts among
        them that the launch agent did not reach (no answer within ``timeout``, or no
        word (:data:`~popdist_lite_launcher.node.cleanup.SAID`) from the cleanup command,
        only the agent's own failure) the sentence naming each (:func:`not_reachable`).
    """
    problems, unreached = {}, set()
    outcomes = run_on_hosts(launch_agent, hosts, lambda host, index: remote_command(mark), timeout=timeout)
    for host, outcome in outcomes.items():
        problem = failure(outcome)
        if problem is not None:
            problems[host] = problem
            if isinstance(outcome, str) or cleanup.SAID not in outcome.stdout + outcome.stderr:
                unreached.add(host)
    return problems, {host: not_reachable(launch_agent, host, f"the cleanup after the attempt: {problems[host]}")
                      for host in hosts if host in unreached}
