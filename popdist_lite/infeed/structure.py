"""The structure of a batch: a tuple or dict of numpy arrays, or one array.

A batch is described once per stream by its *structure* (kind, keys, dtypes and
number of dimensions per field: small, picklable, compared across feeders) and per
batch by its *shapes* (sent as integers in the batch header). The arrays themselves
travel as raw bytes; :func:`flatten` and :func:`unflatten` go between a batch and its
list of C-contiguous arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: ``(kind, fields)``: kind is ``"dict"``, ``"tuple"`` or ``"array"``; fields is a
#: tuple of ``(key, dtype.str, ndim)`` (key: the dict key, else the position).
Structure = tuple


def _fields(batch: Any) -> tuple[str, list]:
    if isinstance(batch, np.ndarray):
        return "array", [(0, batch)]
    if isinstance(batch, dict):
        bad = [k for k in batch if not isinstance(k, str)]
        if bad:
            raise TypeError(f"infeed: batch dict keys must be str, got {bad[0]!r}")
        return "dict", list(batch.items())
    if isinstance(batch, (tuple, list)):
        return "tuple", list(enumerate(batch))
    raise TypeError(f"infeed: a batch must be a tuple or dict of numpy arrays (or one array), "
                    f"got {type(batch).__name__}")


def flatten(batch: Any) -> tuple[Structure, list[np.ndarray]]:
    """Return ``(structure, arrays)`` of ``batch``, arrays C-contiguous (copied only if
    they were not).

    Raises:
        TypeError: ``batch`` is not a tuple/list/dict of numpy arrays or one array, a
            dict key is not a ``str``, or an array has ``object`` dtype (no fixed size).
    """
    kind, items = _fields(batch)
    fields, arrays = [], []
    for key, value in items:
        if not isinstance(value, np.ndarray):
            raise TypeError(f"infeed: batch field {key!r} is a {type(value).__name__}, "
                            "expected a numpy array")
        if value.dtype.hasobject:
            raise TypeError(f"infeed: batch field {key!r} has dtype {value.dtype}, which cannot "
                            "be sent as bytes; use fixed-size dtypes")
        fields.append((key, value.dtype.str, value.ndim))
        arrays.append(np.ascontiguousarray(value))
    return (kind, tuple(fields)), arrays


def unflatten(structure: Structure, arrays: list[np.ndarray]) -> Any:
    """Inverse of :func:`flatten`: rebuild the tuple, dict or array."""
    kind, fields = structure
    if kind == "array":
        return arrays[0]
    if kind == "dict":
        return {key: a for (key, _, _), a in zip(fields, arrays)}
    return tuple(arrays)


def describe(structure: Structure | None) -> str:
    """Readable form, e.g. ``{'ids': int32 (2-d)}`` or ``(float32 (1-d), int64 (0-d))``."""
    if structure is None:
        return "no batches"
    kind, fields = structure
    parts = [f"{np.dtype(dt).name} ({nd}-d)" for _, dt, nd in fields]
    if kind == "dict":
        return "{" + ", ".join(f"{key!r}: {p}" for (key, _, _), p in zip(fields, parts)) + "}"
    if kind == "array":
        return f"array {parts[0]}"
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


def check_same(expected: Structure, got: Structure, where: str) -> None:
    """Raise a clear ``TypeError`` when ``got`` differs from ``expected`` (keys, dtypes,
    number of dimensions); ``where`` names the batch, e.g. ``"batch 7 of feeder 1"``."""
    if got != expected:
        raise TypeError(f"infeed: {where} has structure {describe(got)}, but earlier batches "
                        f"have {describe(expected)}; every batch must have the same keys, "
                        "dtypes and numbers of dimensions")


def num_shape_words(structure: Structure | None) -> int:
    """How many integers the shapes of one batch take in a header."""
    return 0 if structure is None else sum(nd for _, _, nd in structure[1])


def encode_shapes(arrays: list[np.ndarray]) -> list[int]:
    """All shapes, concatenated."""
    return [int(n) for a in arrays for n in a.shape]


def layout(structure: Structure) -> list[tuple[np.dtype, int, int]]:
    """Per field, its dtype and the slice ``[start, stop)`` of its shape among a header's
    shape words (computed once per stream, used by :func:`empty_arrays` per batch)."""
    fields, at = [], 0
    for _, dtype, ndim in structure[1]:
        fields.append((np.dtype(dtype), at, at + ndim))
        at += ndim
    return fields


def empty_arrays(fields: list, words, allocate=np.empty) -> list[np.ndarray]:
    """Allocate the arrays of one batch with ``allocate(shape, dtype)``, the shapes read
    from the shape integers ``words`` of its header (a list or array) by the
    :func:`layout` ``fields``."""
    words = words.tolist() if isinstance(words, np.ndarray) else words
    return [allocate(tuple(words[start:stop]), dtype) for dtype, start, stop in fields]
