"""Open MPI's session directories: remove what a killed mpirun left behind.

Open MPI 5's mpirun (PRRTE's ``prterun``) keeps its PMIx rendezvous files in a session
directory named after its PID, ``$TMPDIR/ompi.<pid>`` (``/tmp`` without ``TMPDIR``), and
removes it when it ends normally. A prterun that is SIGKILLed (a job killed after
ignoring SIGTERM, a launcher killed with ``kill -9``, a test's subprocess timeout) leaves
it. When a later prterun gets the same PID, which happens within minutes on a busy
machine with Linux's default ``pid_max`` of 32768, it cannot set up its rendezvous
point and the job fails at once with "The PMIx server's listener thread failed to
start" (exit code 213), whatever the job was.

:func:`remove_stale` removes such leftovers before a job starts; :func:`remove` removes
the directory of a prterun that has just ended, the launcher's own child. Both act on
the launcher's host: the daemons (``prted``) on other hosts keep theirs in those hosts'
temporary directories, out of the launcher's reach. Only
directories of the caller's user are touched, and never one whose PID is a running
prterun (or another program of Open MPI's runtime).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping

#: Session directory names, ``<prefix>.<pid>``: Open MPI 5.0's mpirun uses ``ompi``; PRRTE
#: documents ``prte``, ``prtrn`` (prterun) and ``prted`` (its daemons) as the prefixes.
PREFIXES = ("ompi", "prte", "prtrn", "prted")
NAME = re.compile(rf"(?:{'|'.join(PREFIXES)})\.([0-9]{{1,10}})")
#: Programs whose session directory is live while they run (``/proc/<pid>/comm``).
RUNTIME_PROGRAMS = frozenset({"prterun", "prte", "prted", "mpirun", "mpiexec", "orterun", "orted"})


def base(environ: Mapping[str, str] | None = None) -> str:
    """The directory prterun puts its session directory in: PRRTE's ``prte_tmpdir_base``
    if set in the environment, else ``TMPDIR``, ``TEMP``, ``TMP``, else ``/tmp``
    (PMIx's ``pmix_tmp_directory``)."""
    environ = os.environ if environ is None else environ
    for name in ("PRTE_MCA_prte_tmpdir_base", "TMPDIR", "TEMP", "TMP"):
        if environ.get(name):
            return environ[name]
    return "/tmp"


def _running_runtime(pid: int) -> bool:
    """Whether ``pid`` is a live process of Open MPI's runtime (unknown: assume so)."""
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip() in RUNTIME_PROGRAMS
    except (FileNotFoundError, ProcessLookupError):  # no such process, or it is being reaped
        return False
    except OSError:
        return True


def remove(pid: int, environ: Mapping[str, str] | None = None) -> bool:
    """Remove the session directory of prterun ``pid``, which has ended (the caller's own
    child, reaped). Returns whether there was one."""
    found = False
    for prefix in PREFIXES:
        path = os.path.join(base(environ), f"{prefix}.{pid}")
        try:
            if os.lstat(path).st_uid != os.getuid():
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        found = True
    return found


def remove_stale(environ: Mapping[str, str] | None = None) -> list[str]:
    """Remove every session directory of this user under :func:`base` whose prterun is
    no longer running. Returns the paths removed. Never raises for a directory it cannot
    read or remove (another user's, a race with a prterun ending): it is left."""
    directory = base(environ)
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        match = NAME.fullmatch(entry.name)
        if match is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid != uid or not entry.is_dir(follow_symlinks=False) or _running_runtime(int(match[1])):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed
