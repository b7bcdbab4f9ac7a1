"""The authenticated channel between an agent and the launcher's collector: the job's
key, the handshake and the framing of every line (standard library only: ``secrets``,
``hmac``, ``hashlib``).

Key: the launcher makes :data:`KEY_BYTES` random bytes for every attempt of a job
(:func:`new_key`). No process's environment ever holds them: every rank's agent gets its
own copy in a file, ``rank-N`` (N its MPI rank, mode 0600), in a private directory of its
host (``tempfile.mkdtemp``, mode 0700, named ``poprun-lite-key-<attempt mark>-*``, in
:data:`KEY_PARENT` when it is a writable directory, else the temporary directory), and
only that file's path in :data:`KEY_FILE_ENV`; it reads the file and removes it
(:func:`take_key`) before it connects or starts its program. The launcher writes the
files of the ranks on its own host itself (:func:`write_keys`); on every other host it
runs ``python -m popdist_lite_launcher.core.channel MARK RANK...`` with the launch agent
(``--launch-agent``, ssh; ``srun-agent`` under Slurm) and the key on that command's
standard input, never on a command line (:func:`main`), which prints the directory it
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
attempt's (:func:`remove_keys`). Horovod's runner uses a job's random key and an
HMAC-SHA256 on every message between its driver and tasks the same way.

Handshake (nothing a connection says counts before it is done):

1. the collector sends ``{"kind": "challenge", "nonce": NL}``, NL being 32 random bytes
   in hex (a plain line: it proves nothing);
2. the agent picks its own nonce NA and sends ``hello`` (its identity and NA) as the
   first frame (sequence number 0) of its direction, within
   :data:`HELLO_DEADLINE_SECONDS` of the connection's start;
3. the collector derives the same keys from NA, checks that frame and answers
   ``welcome`` as frame 0 of its direction; the agent checks it, so an agent obeys only
   the launcher that holds the key (mutual authentication).

Each direction has its own key, HMAC-SHA256(key, label | NL | NA) with a label naming the
direction, fresh for every connection: a frame recorded on one connection is refused on
any other (a replayed hello meets another NL), and a frame is refused in the other
direction. A frame is the line ``MAC SEQ PAYLOAD``: PAYLOAD one JSON record
(:mod:`popdist_lite.records`), SEQ its sequence number in its direction (0, 1, 2, ...),
MAC the hex HMAC-SHA256(direction key, SEQ as 8 big-endian bytes | PAYLOAD). The receiver
checks the MAC (``hmac.compare_digest``), then that SEQ is the next it expects (a replayed,
dropped or reordered frame is refused), then the record against its schema.

What this does not do: encrypt (records are not secret; a rank's traceback crosses the
job network in the clear) or protect MPI's own traffic. See docs/security.md.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import shutil
import stat
import sys
import tempfile

from popdist_lite import records

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
#: Bytes of the job's key and of each nonce.
KEY_BYTES = NONCE_BYTES = 32
#: Seconds a connection has, from its start, to authenticate with a valid ``hello``.
HELLO_DEADLINE_SECONDS = 10.0
#: Longest line before the handshake is done (a ``challenge`` or ``hello`` is < 1 KiB).
MAX_HELLO_BYTES = 4096

AGENT, LAUNCHER = "agent", "launcher"
_LABELS = {AGENT: b"poprun-lite agent to launcher", LAUNCHER: b"poprun-lite launcher to agent"}
_MAC_HEX = 2 * hashlib.sha256().digest_size
_MAX_SEQ_DIGITS = 19  # below 2**63


class ChannelError(ValueError):
    """A refused line. ``reason`` says what was wrong without echoing any of it (the
    collector counts refusals by reason)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def new_key() -> bytes:
    """A new job key: :data:`KEY_BYTES` bytes from ``secrets``."""
    return secrets.token_bytes(KEY_BYTES)


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


def _mac(key: bytes, seq: int, payload: bytes) -> bytes:
    return hmac.new(key, seq.to_bytes(8, "big") + payload, hashlib.sha256).hexdigest().encode()


def _split(line: bytes) -> tuple[bytes, int, bytes]:
    """``(mac, seq, payload)`` of a frame line (no newline).

    Raises:
        ChannelError: not a frame.
    """
    parts = line.split(b" ", 2)
    if len(parts) != 3 or len(parts[0]) != _MAC_HEX or not parts[1].isdigit() \
            or len(parts[1]) > _MAX_SEQ_DIGITS:
        raise ChannelError("not a frame")
    return parts[0], int(parts[1]), parts[2]


class Session:
    """One authenticated connection as seen from ``side`` (:data:`AGENT` or
    :data:`LAUNCHER`): :meth:`seal` frames the records it sends, :meth:`open` checks
    those it receives. Not thread-safe: the caller sends the frames in the order they
    were sealed (under one lock)."""

    def __init__(self, key: bytes, launcher_nonce: bytes, agent_nonce: bytes, side: str):
        derived = {direction: hmac.new(key, label + launcher_nonce + agent_nonce,
                                       hashlib.sha256).digest()
                   for direction, label in _LABELS.items()}
        other = LAUNCHER if side == AGENT else AGENT
        self._send_key, self._receive_key = derived[side], derived[other]
        self.sent = 0      # frames sealed
        self.received = 0  # frames accepted

    def seal(self, record: dict) -> bytes:
        """The frame line (newline-terminated) carrying ``record``."""
        payload = records.encode(record)[:-1]
        seq, self.sent = self.sent, self.sent + 1
        return b"%s %d %s\n" % (_mac(self._send_key, seq, payload), seq, payload)

    def open(self, line: bytes, kinds) -> dict:
        """The record in the frame ``line`` (no newline), which must be the next frame
        of the other side and carry a valid record of one of ``kinds``.

        Raises:
            ChannelError: ``reason`` ``"not a frame"``, ``"bad MAC"`` (not made with
                this connection's key: forged, or from another connection),
                ``"out of sequence"`` (authentic but replayed or reordered) or
                ``"invalid record"`` (authentic, in sequence, but not a valid record
                of ``kinds``; the frame is consumed).
        """
        mac, seq, payload = _split(line)
        if not hmac.compare_digest(mac, _mac(self._receive_key, seq, payload)):
            raise ChannelError("bad MAC")
        if seq != self.received:
            raise ChannelError("out of sequence")
        self.received += 1
        try:
            return records.decode(payload, kinds)
        except ValueError:
            raise ChannelError("invalid record") from None


# ---------------------------------------------------------------- the handshake

def challenge() -> tuple[bytes, bytes]:
    """Collector, on accepting a connection: ``(nonce, challenge line)``."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    return nonce, records.encode(records.make("challenge", nonce=nonce.hex()))


def answer(key: bytes, challenge_line: bytes, ident: dict) -> tuple[Session, bytes]:
    """Agent: its session and ``hello`` frame (identity fields ``ident``) answering the
    collector's ``challenge_line`` (no newline).

    Raises:
        ChannelError: ``challenge_line`` is not a challenge.
    """
    try:
        launcher_nonce = bytes.fromhex(records.decode(challenge_line, ("challenge",))["nonce"])
    except ValueError:
        raise ChannelError("not a challenge") from None
    agent_nonce = secrets.token_bytes(NONCE_BYTES)
    session = Session(key, launcher_nonce, agent_nonce, AGENT)
    return session, session.seal(records.fit(records.make("hello", ident, nonce=agent_nonce.hex())))


def accept(key: bytes, launcher_nonce: bytes, hello_line: bytes) -> tuple[Session, dict]:
    """Collector: the session and the ``hello`` record of a connection it challenged
    with ``launcher_nonce``, whose first line is ``hello_line`` (no newline).

    Raises:
        ChannelError: ``"not a hello"``, or ``"bad MAC"`` (the agent does not hold
            ``key``, or the hello was recorded on another connection).
    """
    try:
        hello = records.decode(_split(hello_line)[2], ("hello",))
    except ValueError:
        raise ChannelError("not a hello") from None
    session = Session(key, launcher_nonce, bytes.fromhex(hello["nonce"]), LAUNCHER)
    session.open(hello_line, ("hello",))
    return session, hello


def welcome(session: Session) -> bytes:
    """Collector: the ``welcome`` frame that answers an accepted hello."""
    return session.seal(records.make("welcome"))


def check_welcome(session: Session, line: bytes) -> None:
    """Agent: accept the collector's answer to its hello.

    Raises:
        ChannelError: ``line`` is not this session's ``welcome`` (the other end does not
            hold the key).
    """
    session.open(line, ("welcome",))


def main(argv: list[str] | None = None) -> int:
    """``python -m popdist_lite_launcher.core.channel MARK RANK...``, run by the launcher on
    another host with the launch agent: read the job's key (hex, one line) from standard
    input, write it for each RANK (:func:`write_keys`) and print the directory. Exit
    code 0, or 2 (a bad argument or no key on standard input, nothing written) or 1 (the
    files cannot be written)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or not _MARK.fullmatch(args[0]) or not all(a.isdigit() and len(a) < 10 for a in args[1:]):
        print("usage: python -m popdist_lite_launcher.core.channel MARK RANK... (the key on standard input)",
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
