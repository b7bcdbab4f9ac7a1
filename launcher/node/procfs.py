"""A process's line in Linux's ``/proc/PID/stat``, read in one place: the agent's look at
a stopped rank, the cleanup's walk up its ancestors, the launcher's sweep of mpirun's
session, the test cluster's check that a daemon still runs."""

from __future__ import annotations


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (which may hold spaces and
    parentheses): ``[state, ppid, pgrp, session, ...]``; None when the process is gone,
    cannot be read, or there is no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    end = data.rfind(b")")
    return data[end + 1:].decode("ascii", "replace").split() if end >= 0 else None


def state(pid: int) -> str | None:
    """Process ``pid``'s state letter (``R``, ``S``, ``T`` stopped, ``t`` traced, ``Z``
    zombie, ...), None when it is gone or cannot be read."""
    fields = stat_fields(pid)
    return fields[0] if fields else None
