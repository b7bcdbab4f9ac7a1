"""The authenticated channel between an agent and the launcher's collector: the job's
key, the handshake and the framing of every line (standard library only: ``secrets``,
``hmac``, ``hashlib``).

Key: the launcher makes :data:`KEY_BYTES` random bytes for every attempt of a job
(:func:`new_key`), which reach every rank's agent in a key file of its own on its host
(:mod:`popdist_lite_launcher.node.keys`). Horovod's runner uses a job's random key and an
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
import secrets

from popdist_lite import records

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
