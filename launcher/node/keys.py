"""The job's key files, on every host: how each rank's agent gets its copy of the key of
the attempt (:func:`popdist_lite_launcher.core.channel.new_key`) without any process's
environment or command line holding it.

The launcher makes :data:`~popdist_lite_launcher.core.channel.KEY_BYTES` random bytes for
every attempt of a job. No process's environment ever holds them: every rank's agent
gets its own copy in a file, ``rank-N`` (N its MPI rank, mode 0600), in a private directory of its
host (``tempfile.mkdtemp``, mode 0700, named ``poprun-lite-key-<attempt mark>-*``, in
:data:`KEY_PARENT` when it is a writable directory, else the temporary directory), and
only that file's path in :data:`KEY_FILE_ENV`; it reads the file and removes it
(:func:`take_key`) before it connects or starts its program. The launcher writes the
files of the ranks on its own host itself (:func:`write_keys`); on every other host it
runs ``python -m popdist_lite_launcher.node.keys MARK RANK...`` with the launch agent
(``--launch-agent``, ssh; ``srun-agent`` under Slurm) and the key on that command's
standard input, never on a command line (:func:`main`;
:func:`popdist_lite_launcher.launch.remote.deposit_keys`), which prints the directory it
made. This is the one path that reaches every host on every launch (ssh, Slurm,
Open MPI's daemons spawning daemons, MPICH's hydra): mpirun only carries environments
to other hosts, and the hosts share no ``/tmp``. ``/dev/shm`` rather than ``/tmp``: it is
a memory file system on every Linux host (the key never reaches a disk), and the same
directory for every process of a host, where a launch agent may give each command a
/tmp of its own (the test hosts' ``netns-agent`` does). One file per rank rather than
per host: each agent removes its own, so no agent has to know how many others read a
shared one.

The program cannot read the key: every agent has removed its file before sending its
``hello``, and no program runs before every rank has enrolled (the collector holds the
welcomes: :class:`popdist_lite_launcher.supervise.collector.Collector`, ``enrolment``), so when any
program starts every file is gone and the path in its environment leads nowhere. The
enrolment stays as defence in depth: a file left because its rank's agent never started
(its enrolment timed out) holds a key no hello can use any more. After the attempt the
launcher removes its own directory and the cleanup on every other host removes the
attempt's (:func:`remove_keys`).
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import sys
import tempfile

from ..core.channel import KEY_BYTES

#: The environment variable naming the file that holds an agent's copy of the job's key
#: (hex): a path, not the key.
KEY_FILE_ENV = "POPRUN_LITE_KEY_FILE"
#: The start of the name of a host's directory of key files (then the attempt's mark).
KEY_DIR_PREFIX = "poprun-lite-key-"
#: Where a host's key directory is made (when it is a writable directory; else the
#: temporary directory, ``tempfile.gettempdir()``).
KEY_PARENT = "/dev/shm"
#: Largest key file an agent reads (the key is 64 hex digits and maybe a newline).
MAX_KEY_FILE_BYTES = 256


def key_file_name(rank: int) -> str:
    """The name of rank ``rank``'s key file in its host's key directory."""
    return f"rank-{int(rank)}"


_MARK = re.compile(r"[0-9a-f]{16,64}")
_KEY_DIR = re.compile(r"/[A-Za-z0-9_./-]{1,4000}")


def key_parent() -> str:
    """The directory where this host's key directories are made: :data:`KEY_PARENT` when
    it is a writable directory, else the temporary directory."""
    if os.path.isdir(KEY_PARENT) and os.access(KEY_PARENT, os.W_OK | os.X_OK):
        return KEY_PARENT
    return tempfile.gettempdir()


def write_keys(key: bytes, ranks, mark: str, parent: str | None = None) -> str:
    """Write ``key`` (hex) into one file per rank of ``ranks`` (:func:`key_file_name`,
    mode 0600, created exclusively, never through a symbolic link) in a new private
    directory of ``parent`` (default :func:`key_parent`; ``tempfile.mkdtemp``, mode
    0700) named for the attempt ``mark``; returns that directory. On a failure the
    directory is removed.

    Raises:
        ValueError: ``mark`` is not an attempt mark (16 to 64 hex digits).
        OSError: the directory or a file cannot be made.
    """
    if not _MARK.fullmatch(mark):
        raise ValueError("not an attempt mark")
    directory = tempfile.mkdtemp(prefix=f"{KEY_DIR_PREFIX}{mark}-", dir=parent or key_parent())
    try:
        for rank in ranks:
            fd = os.open(os.path.join(directory, key_file_name(rank)),
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(key.hex() + "\n")
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory


def is_key_dir(path: str, mark: str) -> bool:
    """True when ``path`` (from another host: hostile until checked) can be a key
    directory :func:`write_keys` made there for the attempt ``mark``: an absolute path of
    plain characters (letters, digits, ``_ . / -``, no ``..``) whose last part starts
    with ``poprun-lite-key-MARK-``."""
    return bool(_KEY_DIR.fullmatch(path)) and ".." not in path.split("/") \
        and os.path.basename(path).startswith(f"{KEY_DIR_PREFIX}{mark}-")


def take_key(environ=None) -> bytes | None:
    """Remove :data:`KEY_FILE_ENV` from ``environ`` (default ``os.environ``), read the
    key in the file it names and remove that file (and its directory once empty).

    Returns:
        the key, or None if the variable is missing, or the file is missing, not a
        regular file of this user readable by nobody else (opened without following a
        symbolic link), or does not hold :data:`KEY_BYTES` bytes in hex.
    """
    environ = os.environ if environ is None else environ
    path = environ.pop(KEY_FILE_ENV, None)
    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            return None
        text = os.read(fd, MAX_KEY_FILE_BYTES + 1)
        private = not info.st_mode & 0o077
    except OSError:
        return None
    finally:
        os.close(fd)
    for remove, where in ((os.unlink, path), (os.rmdir, os.path.dirname(path))):
        try:  # the directory goes with the last of its files
            remove(where)
        except OSError:
            pass
    try:
        key = bytes.fromhex(text.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        return None
    return key if private and len(key) == KEY_BYTES and len(text) <= MAX_KEY_FILE_BYTES else None


def remove_keys(mark: str, parent: str | None = None) -> int:
    """Remove the key directories of the attempt ``mark`` left in ``parent`` (default
    :func:`key_parent`): directories of this user (not symbolic links) named
    ``poprun-lite-key-MARK-*``. Returns how many were removed."""
    parent = parent or key_parent()
    if not _MARK.fullmatch(mark):
        return 0
    removed = 0
    try:
        names = os.listdir(parent)
    except OSError:
        return 0
    for name in names:
        if name.startswith(f"{KEY_DIR_PREFIX}{mark}-"):
            path = os.path.join(parent, name)
            try:
                info = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid():
                shutil.rmtree(path, ignore_errors=True)
                removed += 1
    return removed


def main(argv: list[str] | None = None) -> int:
    """``python -m popdist_lite_launcher.node.keys MARK RANK...``, run by the launcher on
    another host with the launch agent: read the job's key (hex, one line) from standard
    input, write it for each RANK (:func:`write_keys`) and print the directory. Exit
    code 0, or 2 (a bad argument or no key on standard input, nothing written) or 1 (the
    files cannot be written)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or not _MARK.fullmatch(args[0]) or not all(a.isdecimal() and len(a) < 10 for a in args[1:]):
        print("usage: python -m popdist_lite_launcher.node.keys MARK RANK... (the key on standard input)",
              file=sys.stderr)
        return 2
    line = sys.stdin.buffer.readline(MAX_KEY_FILE_BYTES)
    try:
        key = bytes.fromhex(line.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        key = b""
    if len(key) != KEY_BYTES:
        print("poprun-lite: no job key on standard input", file=sys.stderr)
        return 2
    try:
        print(write_keys(key, [int(a) for a in args[1:]], args[0]))
    except OSError as exc:
        print(f"poprun-lite: cannot write the job's key files: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
