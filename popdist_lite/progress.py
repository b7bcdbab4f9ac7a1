"""Progress of this replica for the stall inspector: which collective call it last
entered and when, readable by its agent without MPI; its Python stack on request.

Turned on by ``POPDIST_LITE_PROGRESS_FD=<fd>``: the poprun-lite agent creates an
unlinked file on the rank's own host (nothing is shared between hosts, nothing is left
behind) and passes its descriptor to the rank. The file is a small shared-memory slot
(:mod:`mmap`): :func:`record` writes the
collective call number, the operation and the entry time (``time.time()``) into it,
three stores and a clock read (about 0.3 us; ``scripts/bench_collectives.py`` measures
the checked call with the inspector on and off), and the agent reads the slot with
:func:`read_slot` whenever it looks. Off (the variable unset), :func:`record` is a
function that returns at once, and the collectives call nothing else.

``POPDIST_LITE_STACK_FD=<fd>`` makes :data:`STACK_SIGNAL` (SIGUSR2) dump the Python
stack of every thread into that file (:func:`faulthandler.register`; the agent opened
it for appending),
also while the main thread is blocked inside MPI or spinning in a Python loop: the
agent sends the signal and reads what was appended.

Slot layout (native byte order, :data:`SLOT_SIZE` bytes): ``int64`` call number (-1
before the first call), ``int64`` operation code, ``float64`` entry time (seconds since
the epoch), ``int64`` process id; from byte :data:`NAMES_OFFSET`, one NUL-padded name
of :data:`NAME_SIZE` bytes per operation code, written the first time the operation is
recorded.
"""

from __future__ import annotations

import faulthandler
import mmap
import os
import signal
import sys
import time

PROGRESS_ENV = "POPDIST_LITE_PROGRESS_FD"
STACK_ENV = "POPDIST_LITE_STACK_FD"
#: The signal on which a rank dumps every thread's stack into the file of ``$POPDIST_LITE_STACK_FD``.
STACK_SIGNAL = signal.SIGUSR2
SLOT_SIZE = 4096
NAMES_OFFSET = 64
NAME_SIZE = 32
MAX_OPS = (SLOT_SIZE - NAMES_OFFSET) // NAME_SIZE
_CALL, _OP, _SINCE, _PID = range(4)  # 8-byte fields

_state: dict = {"map": None, "words": None, "floats": None, "codes": {}, "stack_file": None}


def _off(op: str, call: int) -> None:
    return None


def _on(op: str, call: int) -> None:
    code = _codes.get(op)
    if code is None:
        code = _new_code(op)
    _words[_OP] = code
    _words[_CALL] = call
    _floats[_SINCE] = _now()


#: ``record(op, call)``: this replica entered collective call number ``call`` (an
#: operation name such as ``"all_reduce"``). Rebound by :func:`enable`; a no-op when off.
record = _off
_codes: dict[str, int] = {}
_words = _floats = None
_now = time.time


def _new_code(op: str) -> int:
    code = len(_codes)
    if code >= MAX_OPS:  # more distinct operations than names fit: share the last code
        code = MAX_OPS - 1
    else:
        name = op.encode("utf-8", "replace")[:NAME_SIZE - 1].ljust(NAME_SIZE, b"\0")
        start = NAMES_OFFSET + code * NAME_SIZE
        _state["map"][start:start + NAME_SIZE] = name
    _codes[op] = code
    return code


def _empty_slot() -> bytes:
    data = bytearray(SLOT_SIZE)
    memoryview(data).cast("q")[_CALL] = -1
    return bytes(data)


def create_slot(f) -> None:
    """Write an empty slot (no call entered yet) at the start of the open binary file
    ``f``. Used by the agent before it starts the rank."""
    os.pwrite(f.fileno(), _empty_slot(), 0)


def last_call() -> tuple[int, str, float, int] | None:
    """This process's own last ``(call, op, since, pid)`` (None when off or before the
    first call)."""
    mapped = _state["map"]
    return None if mapped is None else read_slot(mapped[:])


def enable(fd: int | None) -> None:
    """Record into the slot file open as descriptor ``fd`` (see :func:`create_slot`) from
    now on; ``None``: into this process's own memory (read back with :func:`last_call`).

    Raises:
        OSError: the file cannot be mapped.
    """
    global record, _words, _floats
    if _state["map"] is not None:
        return
    if fd is None:
        mapped = mmap.mmap(-1, SLOT_SIZE)
        mapped[:] = _empty_slot()
    else:
        mapped = mmap.mmap(fd, SLOT_SIZE)
    _state["map"] = mapped
    _words = memoryview(mapped).cast("q")
    _floats = memoryview(mapped).cast("d")
    _words[_PID] = os.getpid()
    record = _on


def set_recording(enabled: bool) -> bool:
    """Pause (False) or resume (True) recording into the slot :func:`enable` mapped (for
    measuring the recorder's cost; nothing to resume when it was never enabled).

    Returns:
        whether it was recording before.
    """
    global record
    before = record is _on
    record = _on if enabled and _state["map"] is not None else _off
    return before


def enable_stack_dumps(fd: int) -> None:
    """Dump every thread's Python stack into the file open as descriptor ``fd`` (kept
    open) on :data:`STACK_SIGNAL`.

    Raises:
        OSError: ``fd`` is not an open descriptor.
    """
    if _state["stack_file"] is not None:
        return
    os.fstat(fd)
    faulthandler.register(STACK_SIGNAL, file=fd, all_threads=True, chain=False)
    _state["stack_file"] = fd


def enable_from_env(environ=None) -> None:
    """Turn on what ``POPDIST_LITE_PROGRESS_FD`` / ``POPDIST_LITE_STACK_FD`` ask for
    (called by :func:`popdist_lite.init`). A file that cannot be opened leaves that part
    off with a warning on stderr: the job runs on without the inspector."""
    environ = os.environ if environ is None else environ
    for name, turn_on in ((PROGRESS_ENV, enable), (STACK_ENV, enable_stack_dumps)):
        value = environ.get(name, "")
        if value:
            try:
                turn_on(int(value))
            except (OSError, ValueError) as exc:
                print(f"popdist-lite: {name}={value}: {exc}; the stall inspector will not see "
                      f"this replica", file=sys.stderr, flush=True)


def read_slot(data: bytes) -> tuple[int, str, float, int] | None:
    """``(call, op, since, pid)`` from the bytes of a slot file, or None before the first
    call (or for a slot too short to hold one)."""
    if len(data) < NAMES_OFFSET:
        return None
    words = memoryview(data[:NAMES_OFFSET]).cast("q")
    call, code, pid = words[_CALL], words[_OP], words[_PID]
    if call < 0:
        return None
    since = memoryview(data[:NAMES_OFFSET]).cast("d")[_SINCE]
    start = NAMES_OFFSET + code * NAME_SIZE
    name = bytes(data[start:start + NAME_SIZE]).split(b"\0", 1)[0].decode("utf-8", "replace")
    return call, name or "?", since, pid
