"""The words of the launcher's messages, written once: its own lines on stderr
(:func:`say`), values shown in errors (:func:`shown`), lists of hosts, ranks and
replicas (:func:`counted`, :func:`hosts_text`), signal names, indented blocks, an
exception in one line, and the stack text that stands for a stopped process (written by
an agent, read by the stall report)."""

from __future__ import annotations

import os
import re
import signal
import traceback

#: Characters of a value shown in an error message before it is cut (``...``).
SHOWN_CHARS = 80
#: The stack text an agent sends for a process that is stopped (``T``, SIGSTOP or
#: SIGTSTP) or traced (``t``), which cannot dump its stack: see :func:`stopped_text`.
STOPPED = re.compile(r"stopped \(state [Tt]\)")


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
