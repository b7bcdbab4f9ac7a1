"""The on-disk format: a directory per checkpoint with plain ``.npy`` files and a JSON
manifest written last.

::

    DIR/step-00000020/
        manifest.json                       # written last: its presence marks a complete checkpoint
        emb.weights.r0.npy, emb.weights.r1.npy     # one file per writing replica (partitioned arrays)
        params.w.npy                        # replicated arrays: one file, written by replica 0

Every ``.npy`` file is NumPy's format version 1.0 (``np.load(path, allow_pickle=False)``
reads it); partitioned arrays hold only the writer's real rows or columns (no padding).
The manifest (``MANIFEST``) is a JSON object::

    {"format": "popdist-lite-checkpoint", "version": 1, "step": 20, "num_replicas": 2,
     "arrays": {name: {"shape": [...], "dtype": "<f4", "partition": {"kind": "cyclic", "axis": 0},
                       "writers": 2, "meta": {...},
                       "files": [{"file": "...npy", "replica": 0, "shape": [...], "bytes": N,
                                  "crc32": C}, ...]}},
     "values": {name: JSON},                  # replica-identical values (steps, loss scale, ...)
     "replica_values": [{name: JSON}, ...],   # one object per writing replica (RNG states)
     "objects": {name: {"type": ..., ...}}}   # what each state entry was (table, optimizer...)

``crc32`` is ``zlib.crc32`` of the whole file, header included.
"""

from __future__ import annotations

import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..collectives import Problem

FORMAT = "popdist-lite-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
#: Bytes written, checksummed or mapped at a time: the unit of extra memory a save or a
#: load uses beyond the replica's own arrays.
CHUNK_BYTES = 16 << 20
_STEP_DIR = re.compile(r"^step-(\d+)$")
#: Prefix of a save in progress (``.tmp-step-00000020-<token>``) and of a replaced checkpoint.
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".old-"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read (raised on every replica)."""


def problem_of(exc: BaseException) -> Problem:
    """What a checkpoint step reports to the agreement for an exception caught on this
    replica: ``TypeError``, ``ValueError`` and :class:`CheckpointError` keep their class,
    anything else becomes a :class:`CheckpointError` naming its type (an ``OSError``
    reads ``"strerror: filename"``)."""
    return Problem.of(exc, keep=(TypeError, ValueError, CheckpointError), otherwise=CheckpointError)


def step_dir_name(step: int) -> str:
    """``step-00000020``: zero-padded so names sort by step."""
    return f"step-{int(step):08d}"


def parse_step(name: str) -> int | None:
    """The step of a committed checkpoint directory name, else ``None``."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def committed(directory: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of the complete checkpoints in ``directory`` (directories, not
    symbolic links, with a manifest), oldest first."""
    found = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for name in names:
        step = parse_step(name)
        if step is not None and not (directory / name).is_symlink() and (directory / name / MANIFEST).is_file():
            found.append((step, directory / name))
    return sorted(found)


def file_name(array_name: str, replica: int | None) -> str:
    """The file of ``array_name`` written by ``replica`` (``None``: the one file of a
    replicated array): the name with characters other than ``[A-Za-z0-9_-]`` as ``.``."""
    stem = re.sub(r"[^A-Za-z0-9_-]+", ".", array_name).strip(".") or "array"
    return f"{stem}.npy" if replica is None else f"{stem}.r{replica}.npy"


def fsync_path(path: Path) -> None:
    """fsync a directory (so the names of files created or renamed in it are durable) or a
    closed file (Linux flushes the file's data whatever the descriptor's mode)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def npy_header(shape: tuple, dtype: np.dtype) -> bytes:
    """The ``.npy`` version 1.0 header of a C-order array (NumPy's own writer)."""
    import io

    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
                 "shape": tuple(int(s) for s in shape)})
    return buffer.getvalue()


@dataclass
class Written:
    """What the manifest records of one file."""

    file: str
    replica: int
    shape: tuple
    bytes: int
    crc32: int

    def record(self) -> dict:
        return {"file": self.file, "replica": self.replica, "shape": list(self.shape),
                "bytes": self.bytes, "crc32": self.crc32}


def write_npy(path: Path, array: np.ndarray, replica: int, slow: float = 0.0, sync: bool = True) -> Written:
    """Write ``array`` (any strides) as a ``.npy`` file, in blocks of about
    ``CHUNK_BYTES`` (so a non-contiguous array costs one block of memory, not a copy),
    computing its crc32 on the way, then fsync it (unless ``sync=False``: see
    :func:`fsync_path`).

    ``slow`` (seconds, a test hook) sleeps after each block.
    """
    import time

    header = npy_header(array.shape, array.dtype)
    crc = zlib.crc32(header)
    total = len(header)
    # (rows, the rest) without -1: a part with no rows (a replica of a table smaller than the replica count) has size 0
    rows = array.reshape(array.shape[0], int(np.prod(array.shape[1:]))) if array.ndim > 1 else \
        array.reshape(-1) if array.ndim else array.reshape(1)
    row_bytes = max(1, rows[0:1].nbytes) if len(rows) else 1
    step = max(1, CHUNK_BYTES // row_bytes)
    with open(path, "wb", buffering=0) as f:
        f.write(header)
        for first in range(0, len(rows) if rows.size else 0, step):
            block = np.ascontiguousarray(rows[first:first + step])
            view = memoryview(block.reshape(-1)).cast("B")
            crc = zlib.crc32(view, crc)
            written = 0
            while written < len(view):
                written += f.write(view[written:])
            total += len(view)
            if slow:
                time.sleep(slow)
        if sync:
            os.fsync(f.fileno())
    return Written(path.name, replica, tuple(array.shape), total, crc)
