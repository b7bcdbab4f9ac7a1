"""The reachability probe, the host's side: ``python -m popdist_lite_launcher.node.probe
HOST:PORT INDEX``, run on a host through the launch agent before an attempt uses it.

A host is usable when a process started there through the launch agent can reach the
launcher over the job's network and prove it holds the key of the check: the probe
reads the key (hex) from its standard input (ssh passes its standard input on; the key
is never on a command line), connects to the launcher's check server at ``HOST:PORT``
within :data:`CONNECT_SECONDS` and authenticates as agents do
(:func:`popdist_lite_launcher.node.link.connect`: challenge, hello, welcome), with the
identity ``role="probe"``, ``rank = replica = INDEX`` (the host's place in the check).
It prints one line and exits 0 when welcomed; otherwise it prints one line on stderr,
``poprun-lite probe on NAME: `` and what failed in words (``cannot connect to
poprun-lite at ADDRESS over the job network: timed out after 5 s``, connection refused,
no route to host, the key not accepted), and exits with :data:`FAILED`. The launcher's
side is :func:`popdist_lite_launcher.launch.remote.probe_hosts`.
"""

from __future__ import annotations

import os
import select
import socket
import sys
import time

from popdist_lite import records

from .link import connect
from ..core import channel

#: Seconds the probe has to connect and be welcomed.
CONNECT_SECONDS = 5.0
#: Seconds the probe waits for the key on its standard input.
KEY_SECONDS = 5.0
#: The probe's exit code when it ran but could not reach the launcher (the launch
#: agent's own failures, e.g. ssh's 255, are told apart by it).
FAILED = 3
#: The first words of every line the probe prints.
PREFIX = "poprun-lite probe"


def read_key(stream=None, timeout: float = KEY_SECONDS) -> bytes | None:
    """The key (:data:`channel.KEY_BYTES` bytes, hex on the first line of ``stream``,
    default stdin), or None when none comes in time or it is not one."""
    fd = (stream or sys.stdin.buffer).fileno()
    text = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in text and len(text) <= 2 * channel.KEY_BYTES + 2:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 256)
        if not chunk:
            break
        text += chunk
    try:
        key = bytes.fromhex(text.split(b"\n", 1)[0].decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        return None
    return key if len(key) == channel.KEY_BYTES else None


def describe(exc: BaseException, timeout: float = CONNECT_SECONDS) -> str:
    """What went wrong, in words."""
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return f"timed out after {timeout:g} s"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, channel.ChannelError):
        return f"the launcher did not accept the check's key ({exc.reason})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    """Run the probe (see the module docstring); returns the exit code."""
    args = sys.argv[1:] if argv is None else argv
    host = socket.gethostname()
    if len(args) != 2 or not args[1].isdecimal():
        print("usage: python -m popdist_lite_launcher.node.probe HOST:PORT INDEX", file=sys.stderr)
        return 2
    address, index = args[0], int(args[1])
    key = read_key()
    if key is None:
        print(f"{PREFIX} on {host}: got no key on its standard input within {KEY_SECONDS:g} s "
              f"(the launch agent must pass its standard input on, as ssh does)", file=sys.stderr, flush=True)
        return FAILED
    ident = records.identity(rank=index, replica=index, role="probe", pid=os.getpid())
    try:
        sock, _, _ = connect(address, key, ident, time.monotonic() + CONNECT_SECONDS)
    except Exception as exc:  # noqa: BLE001 - every failure is reported in words
        print(f"{PREFIX} on {host}: cannot connect to poprun-lite at {address} over the job network: "
              f"{describe(exc)}", file=sys.stderr, flush=True)
        return FAILED
    sock.close()
    print(f"{PREFIX} on {host}: reached {address}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
