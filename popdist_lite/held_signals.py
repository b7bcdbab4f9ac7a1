"""The scheduler's signals held by the program's own process, not by its children.

With preemption on (``poprun-lite --preemption``, docs/slurm.md), poprun-lite starts the
program with SIGTERM, the requeue signal (SIGUSR1 by default) and SIGINT ignored
(``POPRUN_LITE_HOLD_SIGNALS``; launcher/node/hold_signals.py), so that Slurm's signals to
every process of the job leave it running: its agent tells the launcher, which asks the
replicas for a checkpoint at their next step boundary
(:func:`popdist_lite.should_checkpoint`). An ignored signal stays ignored across
``fork`` and ``exec``, so every child the program starts would ignore them too (a
``Popen.terminate()`` that does nothing, a helper that outlives the job).
:func:`hold_signals`, run by :func:`popdist_lite.init`, keeps the hold to this process:
each ignored signal gets a handler that does nothing instead, which ``exec`` resets to
the default (POSIX), and ``os.fork``'s child gets the defaults back at once. Only the
standard library is used.
"""

from __future__ import annotations

import os
import signal

from .records import HOLD_ENV

_held: list[int] = []


def _ignore(signum, frame) -> None:
    """The held signals' handler: nothing (the agent tells the launcher)."""


def _default_in_child() -> None:
    for signum in _held:
        signal.signal(signum, signal.SIG_DFL)


def hold_signals() -> tuple[int, ...]:
    """Keep poprun-lite's hold of the scheduler's signals (``POPRUN_LITE_HOLD_SIGNALS``,
    and SIGINT) to this process: each of them this process ignores gets a handler that
    does nothing instead, which ``exec`` resets to the default in a child (subprocess,
    os.system, multiprocessing's spawn), and a child of ``os.fork`` (multiprocessing's
    fork) gets the default back at once (``os.register_at_fork``). The variable is
    removed from the environment, so that a child that imports popdist_lite keeps its
    default dispositions. Returns the signals it held; () outside such a job, off the
    main thread, or when called again. Called by :func:`popdist_lite.init`.

    A program that never calls ``init()`` keeps them ignored, and so do its children."""
    text = os.environ.pop(HOLD_ENV, None)
    if not text or _held:
        return ()
    names = {*text.split(","), "SIGINT"}
    held = []
    for name in sorted(names):
        try:
            signum = signal.Signals[name.strip()]
            if signal.getsignal(signum) == signal.SIG_IGN:
                signal.signal(signum, _ignore)
                held.append(signum)
        except (KeyError, ValueError, OSError):  # not a signal, not the main thread
            continue
    if held:
        _held.extend(held)
        os.register_at_fork(after_in_child=_default_in_child)
    return tuple(_held)
