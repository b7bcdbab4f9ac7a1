"""Reading a checkpoint's manifest as untrusted input: every field checked before use.

A checkpoint directory may come from anywhere (another job, another user, a copy), so
:func:`read_manifest` checks the whole manifest against the format
(:mod:`popdist_lite.checkpoint.format`) before a loader looks at it: types and ranges of
every field, every array's dtype (plain numeric or bool: no object, no structured
dtype), its partition, its number of writers (at most :data:`MAX_WRITERS`), and, for
every file, that its name is the one the format gives that array and writer (so no
``../x``, no absolute path, no other file of the directory), that its shape is the one
the partition gives that writer, and that a value does not overlap an array or an
object (a value cannot stand in for state). Files are opened with
:func:`open_regular`: never through a symbolic link, never blocking on a FIFO, regular
files only. Python's ``tarfile`` extraction filters and DCP's load planner refuse paths
outside the archive or checkpoint in the same spirit.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import numpy as np

from .format import FORMAT, MANIFEST, VERSION, CheckpointError, file_name
from .partition import KINDS, Partition

#: The most writing replicas a checkpoint may name.
MAX_WRITERS = 1 << 16
#: The largest manifest read, in bytes.
MAX_MANIFEST_BYTES = 64 << 20
#: The most dimensions of a saved array.
MAX_NDIM = 32


def open_regular(path: Path) -> int:
    """A read-only descriptor of the regular file at ``path``, opened without following a
    symbolic link (``O_NOFOLLOW``) and without blocking on a FIFO or a device
    (``O_NONBLOCK``; anything but a regular file is then refused).

    Raises:
        FileNotFoundError: there is no such file.
        CheckpointError: a symbolic link, not a regular file, or it cannot be opened.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointError(f"{path} is a symbolic link; a checkpoint's files must be regular files in "
                                  f"its directory") from None
        raise CheckpointError(f"cannot open {path}: {exc.strerror or exc}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise CheckpointError(f"{path} is not a regular file (a FIFO, device, socket or directory); a "
                              f"checkpoint's files must be regular files in its directory")
    return fd


def read_manifest(path: Path) -> dict:
    """The checked manifest of the checkpoint at ``path``.

    Raises:
        CheckpointError: ``path`` is not a directory with a manifest of this format, or the
            manifest breaks the format anywhere (the message names the field).
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint: not a directory")
    try:
        fd = open_regular(path / MANIFEST)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a checkpoint: it has no {MANIFEST} (an incomplete save, "
                              f"or not a popdist-lite checkpoint)") from None
    with os.fdopen(fd, "rb") as f:
        text = f.read(MAX_MANIFEST_BYTES + 1)
    if len(text) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{path}: {MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise CheckpointError(f"{path} is not a checkpoint: {MANIFEST} is unreadable: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a checkpoint: {MANIFEST} is not a {FORMAT} manifest")
    if data.get("version") != VERSION:
        raise CheckpointError(f"{path}: manifest version {data.get('version')!r}, this popdist-lite "
                              f"reads version {VERSION}")
    try:
        check_manifest(data)
    except _Bad as exc:
        raise CheckpointError(f"{path}: {MANIFEST} is malformed: {exc}") from None
    return data


class _Bad(Exception):
    """A field of the manifest breaks the format."""


def _int(value, what: str, low: int = 0, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise _Bad(f"{what}: expected an integer {bound}, got {value!r:.80}")
    return value


def _dict(value, what: str) -> dict:
    if not isinstance(value, dict):
        raise _Bad(f"{what}: expected an object, got {type(value).__name__}")
    return value


def check_dtype(text, what: str) -> np.dtype:
    """The dtype a manifest names, if it is a plain numeric or bool dtype.

    Raises:
        _Bad: anything else (object, structured, sub-array, string dtypes).
    """
    if not isinstance(text, str) or len(text) > 16:
        raise _Bad(f"{what}: expected a dtype string such as '<f4', got {text!r:.80}")
    try:
        dtype = np.dtype(text)
    except (TypeError, ValueError):
        raise _Bad(f"{what}: {text!r} is not a dtype") from None
    if dtype.kind not in "biufc" or dtype.fields is not None or dtype.subdtype is not None or dtype.hasobject:
        raise _Bad(f"{what}: {text!r} is not a plain numeric or bool dtype")
    return dtype


def _shape(value, what: str) -> tuple:
    if not isinstance(value, list) or len(value) > MAX_NDIM:
        raise _Bad(f"{what}: expected a list of at most {MAX_NDIM} sizes, got {value!r:.80}")
    return tuple(_int(n, f"{what}[{i}]", 0, 1 << 48) for i, n in enumerate(value))


def check_manifest(data: dict) -> None:
    """Check every field of a manifest (see the module docstring).

    Raises:
        _Bad: naming the first field that breaks the format.
    """
    _int(data.get("step"), "step")
    writers = _int(data.get("num_replicas"), "num_replicas", 1, MAX_WRITERS)
    arrays = _dict(data.get("arrays"), "arrays")
    for name, record in arrays.items():
        _check_array(name, _dict(record, f"arrays[{name!r}]"), writers)
    values = _dict(data.get("values", {}), "values")
    objects = _dict(data.get("objects", {}), "objects")
    for name, obj in objects.items():
        if not isinstance(_dict(obj, f"objects[{name!r}]").get("type"), str):
            raise _Bad(f"objects[{name!r}]: expected a 'type' string")
    per_replica = data.get("replica_values", [])
    if not isinstance(per_replica, list) or len(per_replica) not in (0, writers):
        raise _Bad(f"replica_values: expected a list of {writers} objects")
    for i, item in enumerate(per_replica):
        _dict(item, f"replica_values[{i}]")
    state = set(arrays) | set(objects)
    for name in set(values) | {n for item in per_replica for n in item}:
        if name in arrays or any(other.startswith(name + "/") for other in state):
            raise _Bad(f"value {name!r} overlaps the array or state of the same name")


def _check_array(name: str, record: dict, manifest_writers: int) -> None:
    what = f"arrays[{name!r}]"
    if not isinstance(name, str) or not name or any(not part for part in name.split("/")):
        raise _Bad(f"{what}: not a valid array name")
    shape = _shape(record.get("shape"), f"{what}.shape")
    check_dtype(record.get("dtype"), f"{what}.dtype")
    spec = _dict(record.get("partition"), f"{what}.partition")
    if spec.get("kind") not in KINDS:
        raise _Bad(f"{what}.partition: kind must be one of {list(KINDS)}, got {spec.get('kind')!r:.40}")
    if spec["kind"] != "replicated" and not shape:
        raise _Bad(f"{what}.partition: a 0-d array cannot be split")
    writers = _int(record.get("writers"), f"{what}.writers", manifest_writers, manifest_writers)
    partition = Partition(spec["kind"], 0 if spec["kind"] == "replicated" else
                          _int(spec.get("axis"), f"{what}.partition.axis", 0, max(0, len(shape) - 1)),
                          _int(spec.get("replica"), f"{what}.partition.replica", 0, writers - 1)
                          if spec["kind"] == "single" else 0)
    files = record.get("files")
    expected = partition.writers(writers)
    if not isinstance(files, list) or len(files) != len(expected):
        raise _Bad(f"{what}.files: expected {len(expected)} file(s), one per writing replica")
    seen = set()
    for i, f in enumerate(files):
        where = f"{what}.files[{i}]"
        f = _dict(f, where)
        replica = _int(f.get("replica"), f"{where}.replica", 0, writers - 1)
        if replica not in expected or replica in seen:
            raise _Bad(f"{where}.replica: replica {replica} is not a writer of this array, or named twice")
        seen.add(replica)
        want = file_name(name, None if partition.kind == "replicated" else replica)
        if f.get("file") != want:
            raise _Bad(f"{where}.file: expected {want!r} (the format's name for this array and replica), "
                       f"got {f.get('file')!r:.120}")
        if _shape(f.get("shape"), f"{where}.shape") != partition.file_shape(shape, writers, replica):
            raise _Bad(f"{where}.shape: expected {list(partition.file_shape(shape, writers, replica))} (replica "
                       f"{replica}'s part of {list(shape)}), got {f.get('shape')!r:.80}")
        _int(f.get("bytes"), f"{where}.bytes")
        _int(f.get("crc32"), f"{where}.crc32", 0, 0xFFFFFFFF)
    if "meta" in record:
        _dict(record["meta"], f"{what}.meta")
