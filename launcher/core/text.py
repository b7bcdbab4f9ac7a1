"""The words of the launcher's messages, written once: its own lines on stderr
(:func:`say`), values shown in errors (:func:`shown`), lists of hosts, ranks and
replicas (:func:`counted`, :func:`hosts_text`), signal names, indented blocks, an
exception in one line, and the stack text that stands for a stopped process (written by
an agent, read by the stall report)."""

from __future__ import annotations

import os
import re
import signal
import sys
import traceback

#: Characters of a value shown in an error message before it is cut (``...``).
SHOWN_CHARS = 80
#: The stack text an agent sends for a process that is stopped (``T``, SIGSTOP or
#: SIGTSTP) or traced (``t``), which cannot dump its stack: see :func:`stopped_text`.
STOPPED = re.compile(r"stopped \(state [Tt]\)")


def say(text: str) -> None:
    """``poprun-lite: text`` on stderr, flushed: a line of the launcher's own."""
    print(f"poprun-lite: {text}", file=sys.stderr, flush=True)


def clipped(text: str) -> str:
    """``text``, cut after :data:`SHOWN_CHARS` characters (``...``)."""
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def shown(text: str) -> str:
    """A value as an error message shows it: quoted (``repr``) and :func:`clipped`, so
    that a hostile value can neither flood nor fake a message."""
    return repr(clipped(text))


def listed(items) -> str:
    """``a, b, c``."""
    return ", ".join(str(item) for item in items)


def counted(word: str, items) -> str:
    """``replica 1`` or ``replicas 0, 2``: ``word``, plural but for one item, and the
    items."""
    items = list(items)
    return f"{word}{'' if len(items) == 1 else 's'} {listed(items)}"


def host_names(hosts) -> list[str]:
    """The names of ``hosts``, ``this host`` for None (no ``-H``: this machine)."""
    return [host or "this host" for host in hosts]


def hosts_text(hosts) -> str:
    """``host a`` or ``hosts a, this host``."""
    return counted("host", host_names(hosts))


def indent(text: str, prefix: str = "  ", max_lines: int | None = None) -> list[str]:
    """The lines of ``text``, each after ``prefix``; with ``max_lines`` only the last
    that many, after a line saying how many earlier ones are not shown."""
    lines = text.rstrip("\n").splitlines()
    if max_lines is not None and len(lines) > max_lines:
        lines = [f"... ({len(lines) - max_lines} earlier lines not shown)"] + lines[-max_lines:]
    return [prefix + line for line in lines]


def stopped_text(state: str) -> str:
    """The stack text that stands for a process in ``state`` (``"T"`` or ``"t"`` from
    ``/proc/PID/stat``), which cannot run its stack dump until it is continued."""
    return f"stopped (state {state})"


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15; ``SIG40`` for a number without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"SIG{signum}"


def describe_exception(exc: BaseException) -> str:
    """``Type: message`` and where it was raised (the innermost frame)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in " \
            f"{frames[-1].name})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"
