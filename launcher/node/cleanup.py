"""Nothing left behind: every process of an attempt carries the attempt's mark, and when
the attempt ends whatever still carries it is killed, on every host.

The mark is ``POPRUN_LITE_ATTEMPT=<hex>`` (:func:`new_mark`, a new one per attempt) in the
environment. mpirun forwards it to every rank (agents and programs, like the collector's
address), and the launch agent poprun-lite gives mpirun for remote hosts is
:data:`ATTEMPT_AGENT`, a wrapper around the real one (``--launch-agent``, in
:data:`LAUNCH_AGENT_ENV`) that prefixes the command it runs on a host with ``export
POPRUN_LITE_ATTEMPT=...``, so the MPI daemon started there (Open MPI's prted, MPICH's
hydra_pmi_proxy) and everything it starts carry the mark too. Open MPI's daemon on a
surviving host can otherwise outlive a lost-host attempt as an orphan for many minutes.

When an attempt ends, however it ended, the launcher runs ``python -m
popdist_lite_launcher.node.cleanup MARK`` on every remote host of the attempt through the
launch agent, all at once and under :data:`CLEANUP_TIMEOUT_SECONDS` (and
:func:`kill_marked` itself for ranks on its own host); a host where that fails is
reported, and a host the launch agent did not reach at all (no word from the cleanup
command) is one the next attempt leaves out without probing it again: the cleanup was
the probe (:mod:`popdist_lite_launcher.attempts`). :func:`kill_marked` SIGKILLs every process of the caller's user whose
environment holds the mark (read from ``/proc/PID/environ``), itself and its ancestors
excepted, until none is left, and removes the attempt's key directory there
(:func:`popdist_lite_launcher.core.channel.remove_keys`: the files of agents that never
started). The mark names processes; it is not a secret: a local user
who copies it into a process of their own only gets that process killed.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import sys
import time
from pathlib import Path

from ..core import channel

#: The variable holding the attempt's mark, in every process of the attempt.
MARK_ENV = "POPRUN_LITE_ATTEMPT"
#: The real launch agent (``--launch-agent``), for :data:`ATTEMPT_AGENT`.
LAUNCH_AGENT_ENV = "POPRUN_LITE_LAUNCH_AGENT"
#: The launch agent poprun-lite gives mpirun for remote hosts (a bash script).
ATTEMPT_AGENT = str(Path(__file__).parents[1] / "ssh" / "attempt-agent")
#: Seconds the cleanup of all hosts may take.
CLEANUP_TIMEOUT_SECONDS = 20.0
#: How every line the cleanup command (:func:`main`) prints begins.
SAID = "poprun-lite cleanup"
#: Rounds of :func:`kill_marked` (a daemon may start a process while it is killed).
KILL_ROUNDS = 20
_MARK = re.compile(r"[0-9a-f]{16,64}")


def new_mark() -> str:
    """A new attempt mark: 16 random bytes in hex."""
    return secrets.token_hex(16)


def _environ_has(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in f.read().split(b"\0")
    except OSError:  # gone, or not ours to read
        return False


def _ancestors() -> set[int]:
    """This process and its ancestors."""
    found, pid = set(), os.getpid()
    while pid > 1 and pid not in found:
        found.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
            pid = int(stat[stat.rfind(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return found


def marked(mark: str) -> list[int]:
    """PIDs of this user's processes whose environment holds ``POPRUN_LITE_ATTEMPT=mark``
    (Linux /proc), this process and its ancestors excepted."""
    needle = f"{MARK_ENV}={mark}".encode()
    spared, uid = _ancestors(), os.getuid()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in spared:
            try:
                if os.stat(f"/proc/{entry}").st_uid != uid:
                    continue
            except OSError:
                continue
            if _environ_has(int(entry), needle):
                pids.append(int(entry))
    return pids


def kill_marked(mark: str, rounds: int = KILL_ROUNDS) -> tuple[int, list[int]]:
    """SIGKILL every process :func:`marked` finds, again until none is left (at most
    ``rounds`` rounds, 0.05 s apart): ``(processes killed, PIDs still there)``.

    Raises:
        ValueError: ``mark`` is not one (16 to 64 lowercase hex digits).
    """
    if not _MARK.fullmatch(mark):
        raise ValueError(f"not an attempt mark: {mark[:80]!r}")
    killed: set[int] = set()
    for _ in range(rounds):
        left = marked(mark)
        if not left:
            return len(killed), []
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except OSError:
                pass
        time.sleep(0.05)
    return len(killed), marked(mark)


def remote_command(mark: str) -> list[str]:
    """What :func:`clean_hosts` runs on a host."""
    return [sys.executable, "-m", "popdist_lite_launcher.node.cleanup", mark]


def clean_hosts(launch_agent: str, hosts: list[str], mark: str,
                timeout: float = CLEANUP_TIMEOUT_SECONDS) -> tuple[dict[str, str], dict[str, str]]:
    """Kill what is left of the attempt ``mark`` on every host of ``hosts`` (run with the
    launch agent, all at once).

    Returns:
        for each host where that failed, why; and for the hosts among them that the
        launch agent did not reach (no answer within ``timeout``, or no word
        (:data:`SAID`) from the cleanup command, only the agent's own failure) the
        sentence naming each (:func:`network.not_reachable
        <popdist_lite_launcher.launch.remote.not_reachable>`).
    """
    from ..launch.remote import not_reachable, run_on_hosts

    problems, unreached = {}, set()
    outcomes = run_on_hosts(launch_agent, hosts, lambda host, index: remote_command(mark), timeout=timeout)
    for host, outcome in outcomes.items():
        if isinstance(outcome, str):
            problems[host] = outcome
            unreached.add(host)
        elif outcome.returncode != 0:
            said = (outcome.stderr.strip() or outcome.stdout.strip()).splitlines()[-3:]
            problems[host] = f"exit code {outcome.returncode}" + (": " + " / ".join(said) if said else "")
            if SAID not in outcome.stdout + outcome.stderr:
                unreached.add(host)
    return problems, {host: not_reachable(launch_agent, host, f"the cleanup after the attempt: {problems[host]}")
                      for host in hosts if host in unreached}


def main(argv: list[str] | None = None) -> int:
    """``python -m popdist_lite_launcher.node.cleanup MARK``: :func:`kill_marked` here; exit
    code 0 when nothing marked is left, 1 otherwise, 2 for a bad argument."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not _MARK.fullmatch(args[0]):
        print("usage: python -m popdist_lite_launcher.node.cleanup MARK (16 to 64 hex digits)", file=sys.stderr)
        return 2
    killed, left = kill_marked(args[0])
    channel.remove_keys(args[0])  # key files of agents that never started (channel.write_keys)
    if left:
        print(f"{SAID}: {len(left)} process(es) of the attempt still running "
              f"(pids {', '.join(map(str, left[:10]))})", file=sys.stderr)
        return 1
    print(f"{SAID}: killed {killed} process(es)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
