"""Nothing left behind, the host's side: every process of an attempt carries the
attempt's mark, and when the attempt ends whatever still carries it is killed, on every
host.

The mark is ``POPRUN_LITE_ATTEMPT=<hex>`` (:data:`MARK_ENV`, :func:`new_mark`, a new one
per attempt) in the environment. mpirun forwards it to every rank (agents and programs,
like the collector's address), and mpirun's daemons on other hosts get it from the
backend: the ssh backend's launch agent
(:data:`popdist_lite_launcher.ssh.launcher.ATTEMPT_AGENT`) exports it before the command
it runs on a host, and under Slurm the ``srun`` steps carry mpirun's environment, so the
MPI daemon started there (Open MPI's prted, MPICH's hydra_pmi_proxy) and everything it
starts carry the mark too. Open MPI's daemon on a surviving host can otherwise outlive a
lost-host attempt as an orphan for many minutes.

When an attempt ends, however it ended, the launcher runs ``python -m
popdist_lite_launcher.node.cleanup MARK`` on every remote host of the attempt through the
launch agent (:func:`popdist_lite_launcher.launch.remote.clean_hosts`), and
:func:`kill_marked` itself for ranks on its own host. :func:`kill_marked` SIGKILLs every
process of the caller's user whose environment holds the mark (read from
``/proc/PID/environ``), itself and its ancestors excepted, until none is left, and
:func:`main` removes the attempt's key directory there
(:func:`popdist_lite_launcher.node.keys.remove_keys`: the files of agents that never
started). The mark names processes; it is not a secret: a local user who copies it into
a process of their own only gets that process killed.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import sys
import time

from . import keys
from .procfs import stat_fields

#: The variable holding the attempt's mark, in every process of the attempt.
MARK_ENV = "POPRUN_LITE_ATTEMPT"
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
        fields = stat_fields(pid)
        if not fields or len(fields) < 2 or not fields[1].isdecimal():
            break
        pid = int(fields[1])
    return found


def marked(mark: str) -> list[int]:
    """PIDs of this user's processes whose environment holds ``POPRUN_LITE_ATTEMPT=mark``
    (Linux /proc), this process and its ancestors excepted."""
    needle = f"{MARK_ENV}={mark}".encode()
    spared, uid = _ancestors(), os.getuid()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdecimal() and int(entry) not in spared:
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


def main(argv: list[str] | None = None) -> int:
    """``python -m popdist_lite_launcher.node.cleanup MARK``: :func:`kill_marked` here; exit
    code 0 when nothing marked is left, 1 otherwise, 2 for a bad argument."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not _MARK.fullmatch(args[0]):
        print("usage: python -m popdist_lite_launcher.node.cleanup MARK (16 to 64 hex digits)", file=sys.stderr)
        return 2
    killed, left = kill_marked(args[0])
    keys.remove_keys(args[0])  # key files of agents that never started (keys.write_keys)
    if left:
        print(f"{SAID}: {len(left)} process(es) of the attempt still running "
              f"(pids {', '.join(map(str, left[:10]))})", file=sys.stderr)
        return 1
    print(f"{SAID}: killed {killed} process(es)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
