"""Progress of this replica for the stall inspector: which collective call it last
entered on each of its lanes and when, readable by its agent without MPI; its Python
stack on request.

A lane is one sequence of numbered calls: ``main`` for the replica communicator and
the communicators that share its numbering, and one lane of its own for a communicator
whose calls are issued independently of the main thread's (the JAX binding's dedicated
communicator, whose host callbacks run on XLA's threads; a background checkpoint save's
communicator, used by its writer thread): :func:`lane_index` names one,
:func:`popdist_lite.calls.set_lane` gives it to a communicator. The inspector compares
the replicas lane by lane.

Turned on by ``POPDIST_LITE_PROGRESS_FD=<fd>``: the poprun-lite agent creates an
unlinked file on the rank's own host (nothing is shared between hosts, nothing is left
behind) and passes its descriptor to the rank. The file is a small shared-memory slot
(:mod:`mmap`): :func:`record` writes the collective call number, the operation and the
entry time (``time.time()``) into the lane's fields, three stores and a clock read
(about 0.3 us; ``scripts/bench_collectives.py`` measures the checked call with the
inspector on and off), and the agent reads the slot with :func:`read_lanes` whenever it
looks. Off (the variable unset), :func:`record` is a function that returns at once, and
the collectives call nothing else.

``POPDIST_LITE_STACK_FD=<fd>`` makes :data:`STACK_SIGNAL` (SIGUSR2) dump the Python
stack of every thread into that file (:func:`faulthandler.register`; the agent opened
it for appending),
also while the main thread is blocked inside MPI or spinning in a Python loop: the
agent sends the signal and reads what was appended.

Slot layout (native byte order, :data:`SLOT_SIZE` bytes): :data:`MAX_LANES` lanes of
:data:`LANE_SIZE` bytes, lane ``i`` from byte ``i * LANE_SIZE``: ``int64`` call number
(-1 before the lane's first call), ``int64`` operation code, ``float64`` entry time
(seconds since the epoch), ``int64`` process id (lane 0 only), then the lane's name,
NUL-padded in :data:`LANE_NAME_SIZE` bytes (lane 0 is :data:`MAIN`; an unnamed lane is
unused); from byte :data:`NAMES_OFFSET`, one NUL-padded name of :data:`NAME_SIZE` bytes
per operation code, written the first time the operation is recorded; from byte
:data:`STORAGE_OFFSET`, the disk tables' counters of the process (:func:`add_storage`):
an ``int64`` flag (1 once a disk table counted), ``int64`` sums of the counts of
:data:`STORAGE_FIELDS` and the ``float64`` seconds the training loop waited for the disk.
"""

from __future__ import annotations

import faulthandler
import mmap
import os
import re
import signal
import sys
import time

PROGRESS_ENV = "POPDIST_LITE_PROGRESS_FD"
STACK_ENV = "POPDIST_LITE_STACK_FD"
#: The signal on which a rank dumps every thread's stack into the file of ``$POPDIST_LITE_STACK_FD``.
STACK_SIGNAL = signal.SIGUSR2
#: The disk tables' counters in the slot (:func:`add_storage`): counts, then ``wait_seconds``.
STORAGE_FIELDS = ("hits", "misses", "rows_read", "rows_written", "bytes_read", "bytes_written", "prefetched_rows",
                  "wait_seconds")
STORAGE_OFFSET = 4096
SLOT_SIZE = STORAGE_OFFSET + 8 * (1 + len(STORAGE_FIELDS))
#: Lanes in a slot, their size and the bytes of a lane's name (at most
#: ``LANE_NAME_SIZE - 1`` characters of :data:`LANE_NAME`).
MAX_LANES, LANE_SIZE, LANE_NAME_SIZE = 4, 64, 32
#: The lane of the replica communicator: lane 0.
MAIN = "main"
#: What a lane's name may be: a lowercase letter, then up to 15 lowercase letters,
#: digits or underscores (the launcher refuses any other name in a record).
LANE_NAME = re.compile(r"[a-z][a-z0-9_]{0,15}")
NAMES_OFFSET = MAX_LANES * LANE_SIZE
NAME_SIZE = 48  # an operation name: up to 47 bytes (EmbeddingCollection.lookup_in_jit: 33)
MAX_OPS = (STORAGE_OFFSET - NAMES_OFFSET) // NAME_SIZE
_CALL, _OP, _SINCE, _PID = range(4)  # 8-byte fields of a lane
_LANE_WORDS = LANE_SIZE // 8
_NAME_AT = 32  # the lane's name, from this byte of the lane

_state: dict = {"map": None, "words": None, "floats": None, "codes": {}, "stack_file": None}


def _off(op: str, call: int, lane: int = 0) -> None:
    return None


def _on(op: str, call: int, lane: int = 0) -> None:
    code = _codes.get(op)
    if code is None:
        code = _new_code(op)
    base = lane * _LANE_WORDS
    _words[base + _OP] = code
    _words[base + _CALL] = call
    _floats[base + _SINCE] = _now()


#: ``record(op, call, lane=0)``: this replica entered collective call number ``call``
#: (an operation name such as ``"all_reduce"``) on lane number ``lane``
#: (:func:`lane_index`). Rebound by :func:`enable`; a no-op when off.
record = _off
_codes: dict[str, int] = {}
_lanes: dict[str, int] = {MAIN: 0}  # lane name -> its index in the slot
_words = _floats = None
_now = time.time


def lane_index(name: str) -> int | None:
    """The slot index of the lane ``name`` (:data:`LANE_NAME`), given to it at its first
    request (lane 0 is :data:`MAIN`); None when all :data:`MAX_LANES` lanes are taken
    (the calls of that lane are then not recorded).

    Raises:
        ValueError: ``name`` does not match :data:`LANE_NAME`.
    """
    index = _lanes.get(name)
    if index is not None:
        return index
    if not LANE_NAME.fullmatch(name):
        raise ValueError(f"progress lane name {name!r}: expected {LANE_NAME.pattern}")
    if len(_lanes) >= MAX_LANES:
        return None
    index = _lanes[name] = len(_lanes)
    if _state["map"] is not None:
        _write_lane_name(index, name)
    return index


def _write_lane_name(index: int, name: str) -> None:
    start = index * LANE_SIZE + _NAME_AT
    _state["map"][start:start + LANE_NAME_SIZE] = name.encode("ascii").ljust(LANE_NAME_SIZE, b"\0")


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


def recording() -> bool:
    """Whether calls are being recorded into a slot (:func:`enable`)."""
    return record is _on


def add_storage(deltas: dict) -> None:
    """Add a disk table's new counts (``{field of STORAGE_FIELDS: int, "wait_seconds":
    float}``, each >= 0) to the process's sums in the slot, which the agent sends with
    each ``progress`` record; nothing when recording is off. Training loop's thread only."""
    if record is _off:
        return
    base = STORAGE_OFFSET // 8
    _words[base] = 1
    for i, name in enumerate(STORAGE_FIELDS[:-1], start=1):
        _words[base + i] += int(deltas.get(name, 0))
    _floats[base + len(STORAGE_FIELDS)] += float(deltas.get("wait_seconds", 0.0))


def read_storage(data: bytes) -> dict | None:
    """The disk counters (``{field: value}`` of :data:`STORAGE_FIELDS`) from the bytes of
    a slot file, or None when no disk table counted (or the slot is short, or a value is
    not a count / a finite number >= 0)."""
    if len(data) < SLOT_SIZE:
        return None
    words = memoryview(data[STORAGE_OFFSET:SLOT_SIZE]).cast("q")
    floats = memoryview(data[STORAGE_OFFSET:SLOT_SIZE]).cast("d")
    if words[0] != 1:
        return None
    out = {name: words[i] for i, name in enumerate(STORAGE_FIELDS[:-1], start=1)}
    wait = floats[len(STORAGE_FIELDS)]
    if min(out.values()) < 0 or not 0.0 <= wait < float("inf"):
        return None
    out["wait_seconds"] = wait
    return out


def _empty_slot() -> bytes:
    data = bytearray(SLOT_SIZE)
    words = memoryview(data).cast("q")
    for lane in range(MAX_LANES):
        words[lane * _LANE_WORDS + _CALL] = -1
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
    for name, index in _lanes.items():
        _write_lane_name(index, name)
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
    """``(call, op, since, pid)`` of the :data:`MAIN` lane from the bytes of a slot file,
    or None before its first call (or for a slot too short to hold one)."""
    if len(data) < NAMES_OFFSET:
        return None
    lanes = read_lanes(data)
    if not lanes or lanes[0][0] != MAIN:
        return None
    _, call, name, since = lanes[0]
    return call, name, since, memoryview(data[:8 * (_PID + 1)]).cast("q")[_PID]


def read_lanes(data: bytes) -> list[tuple[str, int, str, float]]:
    """``(lane, call, op, since)`` of every lane that has entered a call, in slot order
    (:data:`MAIN` first), from the bytes of a slot file; a lane whose name is not a
    :data:`LANE_NAME` (lane 0: not :data:`MAIN`) or whose operation code is out of range
    is left out. Empty for a slot too short to hold the lanes."""
    if len(data) < NAMES_OFFSET:
        return []
    words = memoryview(data[:NAMES_OFFSET]).cast("q")
    floats = memoryview(data[:NAMES_OFFSET]).cast("d")
    out = []
    for lane in range(MAX_LANES):
        base = lane * _LANE_WORDS
        call, code = words[base + _CALL], words[base + _OP]
        if call < 0 or not 0 <= code < MAX_OPS:
            continue
        start = lane * LANE_SIZE + _NAME_AT
        raw = bytes(data[start:start + LANE_NAME_SIZE]).split(b"\0", 1)[0]
        lane_name = MAIN if lane == 0 and not raw else raw.decode("ascii", "replace")
        if not LANE_NAME.fullmatch(lane_name) or (lane == 0) != (lane_name == MAIN):
            continue
        start = NAMES_OFFSET + code * NAME_SIZE
        name = bytes(data[start:start + NAME_SIZE]).split(b"\0", 1)[0].decode("utf-8", "replace")
        out.append((lane_name, call, name or "?", floats[base + _SINCE]))
    return out
