"""Host names: ``-H``, hostfiles (and the lines of a host discovery script), read with
one grammar and checked before anything runs.

A host is a hostname made of RFC 1123 labels (letters, digits and hyphens, 1 to 63
characters, neither first nor last a hyphen; at most 253 characters in all) or an IP
address (IPv4; IPv6 in brackets, ``[fe80::1]``, with a scope ID only of letters, digits,
``_``, ``.`` and ``-``: ``[fe80::1%eth0]``), optionally followed by ``:SLOTS``. So a host
never starts with ``-`` and no launch agent (ssh) can take it for an option such as
``-oProxyCommand=...``, and holds nothing a shell would act on (``;``, ``$``, spaces,
quotes: a custom launch agent may pass it through a shell); the commands poprun-lite runs
itself also put ``--`` before the host (:func:`popdist_lite_launcher.launch.remote.check_command`).
Two names of one host are told apart by :func:`host_key` (hostnames are
case-insensitive, RFC 4343; an address in any of its spellings).
"""

from __future__ import annotations

import ipaddress
import re
import socket

from .api import LauncherError
from .text import shown

_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
#: An IPv6 scope ID (an interface name or number): ``ipaddress`` accepts any text after
#: ``%``, a shell would not treat it as plain text.
_SCOPE_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
#: Longest hostname (RFC 1123 section 2.1).
MAX_HOSTNAME_CHARS = 253
_LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1"}


def check_host(name: str) -> str:
    """``name`` itself if it is a hostname (RFC 1123 labels) or an IPv4/IPv6 address.

    Raises:
        ValueError: naming ``name`` and the grammar.
    """
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        pass
    else:
        scope = getattr(address, "scope_id", None)
        if scope is None or _SCOPE_ID.fullmatch(scope):
            return name
        raise ValueError(f"{shown(name)}: an IPv6 scope ID is letters, digits, '_', '.' "
                         f"and '-' only")
    if 0 < len(name) <= MAX_HOSTNAME_CHARS and all(_LABEL.fullmatch(label)
                                                   for label in name.split(".")):
        return name
    raise ValueError(f"{shown(name)} is not a host name (letters, digits, '-' and '.', "
                     f"labels not starting or ending with '-') or an IP address")


def host_key(name: str) -> str:
    """What two names of one host have in common (``name`` already checked,
    :func:`check_host`): a hostname in lower case (``Node1`` is ``node1``), an address in
    its canonical form (``[FE80:0::1]`` is ``[fe80::1]``). Duplicates are found with it."""
    try:
        return str(ipaddress.ip_address(name)).lower()
    except ValueError:
        return name.lower()


def find_duplicate(names) -> tuple[str, str] | None:
    """The first name of ``names`` that names a host listed before it (:func:`host_key`),
    with that earlier name: ``(earlier, again)``; None when every host is listed once."""
    seen: dict[str, str] = {}
    for name in names:
        key = host_key(name)
        if key in seen:
            return seen[key], name
        seen[key] = name
    return None


def parse_host(text: str) -> tuple[str, int | None]:
    """``HOST`` or ``HOST:SLOTS`` (an IPv6 address in brackets: ``[ADDR]:SLOTS``) ->
    ``(host, slots or None)``.

    Raises:
        ValueError: a bad host (:func:`check_host`) or slots not an integer >= 1.
    """
    text = text.strip()
    if text.startswith("["):  # [IPv6] or [IPv6]:SLOTS
        address, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError(f"expected HOST or HOST:SLOTS, got {shown(text)}")
        name, sep, slots = address, rest[:1], rest[1:]
        try:
            ipaddress.IPv6Address(name)
        except ValueError:
            raise ValueError(f"{shown(text)}: brackets hold an IPv6 address") from None
    else:
        name, sep, slots = text.partition(":")
    if not name or (sep and not (slots.isascii() and slots.isdigit() and int(slots) >= 1)):
        raise ValueError(f"expected HOST or HOST:SLOTS (SLOTS >= 1), got {shown(text)}")
    return check_host(name), int(slots) if sep else None


def parse_host_list(text: str) -> list[tuple[str, int | None]]:
    """``h0,h1:2,...`` (``-H``) -> ``[(host, slots or None), ...]``.

    Raises:
        ValueError: a bad entry (naming it), or no hosts.
    """
    hosts = [parse_host(entry) for entry in text.split(",") if entry.strip()]
    if not hosts:
        raise ValueError("expected host0,host1,... (or host0:slots,...)")
    return hosts


def parse_hostfile_line(line: str) -> tuple[str, int | None] | None:
    """One hostfile line: Open MPI's ``host slots=N`` (other ``key=value`` fields
    ignored) or MPICH's ``host:N``; ``#`` starts a comment. None for a blank line.

    Raises:
        ValueError: a bad host or slots value.
    """
    fields = line.split("#", 1)[0].split()
    if not fields:
        return None
    name, slots = parse_host(fields[0])
    for field in fields[1:]:
        key, sep, value = field.partition("=")
        if not sep:
            raise ValueError(f"expected key=value after the host, got {shown(field)}")
        if key == "slots":
            if not (value.isascii() and value.isdigit() and int(value) >= 1):
                raise ValueError(f"bad slots value {shown(value)}")
            slots = int(value)
    return name, slots


def read_hostfile(path: str) -> list[tuple[str, int | None]]:
    """``(host, slots or None)`` for every host line of an Open MPI or MPICH hostfile
    (:func:`parse_hostfile_line`).

    Raises:
        OSError: the file cannot be read.
        LauncherError: naming the file and line: a bad line, text that is not UTF-8, or
            no hosts at all.
    """
    hosts = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                host = parse_hostfile_line(raw.decode("utf-8"))
            except ValueError as exc:  # UnicodeDecodeError too
                problem = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else exc
                raise LauncherError(f"hostfile {path}, line {number}: {problem}") from None
            if host is not None:
                hosts.append(host)
    if not hosts:
        raise LauncherError(f"hostfile {path} names no hosts")
    return hosts


def is_local_host(host: str | None) -> bool:
    """True when ``host`` is None or names this machine."""
    if host is None:
        return True
    names = {name.lower() for name in (*_LOCAL_HOSTS, socket.gethostname(), socket.getfqdn())}
    return host.lower() in names  # hostnames are case-insensitive
