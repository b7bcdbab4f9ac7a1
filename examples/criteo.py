"""Criteo's click logs for examples/dlrm.py: the TSV format, parsed and checked, in
batches sharded over the replicas' feed processes.

The format, shared by Criteo's Kaggle Display Advertising Challenge set (``train.txt``)
and its Terabyte click logs (``day_0`` ... ``day_23``, also read gzip-compressed as
``day_N.gz``): one sample per line, 40 tab-separated fields,

- field 0, the label: ``0`` or ``1`` (a click);
- fields 1-13, integer features ``int_0`` ... ``int_12``: empty (missing) or a decimal
  integer, an optional ``-`` and 1-18 digits;
- fields 14-39, categorical features ``cat_0`` ... ``cat_25``: empty (missing) or a
  32-bit hash as 1-8 hexadecimal digits (Criteo writes 8, lowercase).

The names are TorchRec's (``torchrec.datasets.criteo``'s ``DEFAULT_INT_NAMES`` and
``DEFAULT_CAT_NAMES``). The transformation is DLRM's reference preprocessing
(facebookresearch/dlrm, ``data_utils.py`` and ``dlrm_data_pytorch.py``): a missing value
reads as 0; an integer ``x`` becomes ``log(1 + max(x, 0))`` (negative values clipped to
0); a hash ``h`` becomes row ``h % num_embeddings`` of its feature's table (the
reference's ``--max-ind-range``), so one sample has exactly one ID per table.

Malformed input stops the job: a line that is not 40 fields of the forms above raises
:class:`CriteoFormatError` naming the file, the line number (from 1) and the field, in
the feed process that read it (the launcher's report shows it as the root cause). Lines
are never skipped: a skipped line would shift every later sample into another batch on
one feed process only. Criteo's Kaggle ``test.txt`` has no label column and is refused.

Sharding, as docs/infeed.md's ``tf.data``-style contract: the files, in the order given
(a directory: its files by name, digits compared as numbers, so ``day_2`` comes before
``day_10``), are one stream of lines; global batch ``g`` is lines ``[g*B, (g+1)*B)``;
``make_dataset(shard_index, num_shards, offset=P)`` yields batches ``P + shard_index,
P + shard_index + num_shards, ...``. So the data do not depend on the number of replicas
or feed processes, and a resumed run (at any replica count) continues exactly after the
``P`` batches already taken. Each feed process reads every line and parses only its own
batches' (skipping a line is a C-level read, parsing one ~7 us of Python); a last
partial batch is dropped.
"""

from __future__ import annotations

import gzip
import itertools
import re
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

INT_FEATURES, CAT_FEATURES = 13, 26
FIELDS = 1 + INT_FEATURES + CAT_FEATURES
#: TorchRec's names of the dense and sparse features (``torchrec.datasets.criteo``).
INT_NAMES = tuple(f"int_{i}" for i in range(INT_FEATURES))
CAT_NAMES = tuple(f"cat_{j}" for j in range(CAT_FEATURES))
FIELD_NAMES = ("label",) + INT_NAMES + CAT_NAMES
_HEX = b"0123456789abcdefABCDEF"
_SHOWN = 40  # bytes of a bad field shown in an error


class CriteoFormatError(ValueError):
    """A line of a Criteo file is malformed: the message names the file, the line (from
    1), the field and what was expected."""


def _bad(where: str, index: int, what: str, got: bytes) -> CriteoFormatError:
    shown = repr(got[:_SHOWN]) + ("..." if len(got) > _SHOWN else "")
    return CriteoFormatError(f"{where}: field {index} ({FIELD_NAMES[index]}) expected {what}, got {shown}")


def _integer(x: bytes, where: str, index: int) -> int:
    if not x:
        return 0
    digits = x[1:] if x[:1] == b"-" else x
    if not (digits.isdigit() and len(digits) <= 18):  # bytes.isdigit: ASCII digits only
        raise _bad(where, index, "empty or a decimal integer (an optional '-' and 1-18 digits)", x)
    return int(x)


def _hash(x: bytes, where: str, index: int) -> int:
    if not x:
        return 0
    if len(x) > 8 or x.strip(_HEX):
        raise _bad(where, index, "empty or a hash of 1-8 hexadecimal digits", x)
    return int(x, 16)


def parse_lines(lines: Sequence[bytes], num_embeddings: Sequence[int], source: str = "<lines>",
                first_line: int = 1, locate=None) -> dict[str, np.ndarray]:
    """Parse Criteo TSV lines into one batch.

    Args:
        lines: ``n`` lines as bytes (a trailing ``\\n`` or ``\\r\\n`` is removed).
        num_embeddings: the 26 tables' row counts (each >= 1): hash ``h`` of feature ``j``
            becomes ID ``h % num_embeddings[j]``.
        source, first_line: where ``lines[0]`` comes from, for errors (line numbers
            count from 1); ``locate(k) -> (source, line)`` overrides both for line ``k``
            (a batch that spans two files).

    Returns:
        ``{"label": float32 (n,), "dense": float32 (n, 13), "sparse": int64 (n, 26)}``:
        the labels, ``log(1 + max(x, 0))`` of the integers (missing: 0), the IDs.

    Raises:
        CriteoFormatError: a line is not 40 tab-separated fields of the documented forms
            (the first such line, by file, line number and field).
        ValueError: ``num_embeddings`` is not 26 integers >= 1.
    """
    sizes = np.asarray(num_embeddings)
    if sizes.shape != (CAT_FEATURES,) or sizes.dtype.kind not in "iu" or (sizes < 1).any():
        raise ValueError(f"argument num_embeddings: expected {CAT_FEATURES} integers >= 1, got {num_embeddings!r}")
    n = len(lines)
    label = np.empty(n, np.float32)
    ints = np.empty((n, INT_FEATURES), np.int64)
    hashes = np.empty((n, CAT_FEATURES), np.int64)
    for k, line in enumerate(lines):
        fields = line.rstrip(b"\n").removesuffix(b"\r").split(b"\t")
        where = None
        if len(fields) != FIELDS or fields[0] not in (b"0", b"1"):
            where = "%s:%d" % (locate(k) if locate else (source, first_line + k))
            if len(fields) != FIELDS:
                raise CriteoFormatError(f"{where}: expected {FIELDS} tab-separated fields (label, "
                                        f"{INT_FEATURES} integers, {CAT_FEATURES} hashes), got {len(fields)}")
            raise _bad(where, 0, "the label 0 or 1", fields[0])
        try:
            ints[k] = [_integer(x, "", i) for i, x in enumerate(fields[1:1 + INT_FEATURES], 1)]
            hashes[k] = [_hash(x, "", j) for j, x in enumerate(fields[1 + INT_FEATURES:], 1 + INT_FEATURES)]
        except CriteoFormatError as exc:  # name the line (only now: formatting it costs)
            where = "%s:%d" % (locate(k) if locate else (source, first_line + k))
            raise CriteoFormatError(where + str(exc)) from None
        label[k] = fields[0] == b"1"
    dense = np.log1p(np.maximum(ints, 0).astype(np.float32))
    return {"label": label, "dense": dense, "sparse": hashes % sizes}


def list_files(paths: Sequence[str | Path]) -> list[Path]:
    """The data files of ``paths``, in order: a file as given, a directory as its files
    (not hidden ones) by name with digits compared as numbers (``day_2`` before
    ``day_10``).

    Raises:
        FileNotFoundError: a path does not exist, or the paths hold no file.
    """
    def natural(p: Path):
        return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]

    files = []
    for path in map(Path, paths):
        if path.is_dir():
            files += sorted((p for p in path.iterdir() if p.is_file() and not p.name.startswith(".")), key=natural)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"Criteo data: {path} does not exist")
    if not files:
        raise FileNotFoundError(f"Criteo data: no file in {', '.join(map(str, paths))}")
    return files


def _open(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")


class _Stream:
    """The lines of ``files``, in order, ``epochs`` times: :meth:`skip` and :meth:`take`
    move through them, remembering where each taken line came from."""

    def __init__(self, files: list[Path], epochs: int):
        self._order = itertools.chain.from_iterable(itertools.repeat(files, epochs))
        self._file = self._path = None
        self._line = 0  # lines of the current file already passed

    def _next_file(self) -> bool:
        if self._file is not None:
            self._file.close()
        self._path = next(self._order, None)
        self._file = _open(self._path) if self._path is not None else None
        self._line = 0
        return self._file is not None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def skip(self, n: int) -> bool:
        """Pass ``n`` lines; False when the stream ends first."""
        while n > 0:
            if self._file is None and not self._next_file():
                return False
            # count the lines passed at C speed, in slices of bounded memory
            got = len(list(itertools.islice(self._file, min(n, 1 << 14))))
            self._line += got
            n -= got
            if got == 0:
                self._file.close()
                self._file = None
        return True

    def take(self, n: int) -> tuple[list[bytes], list[tuple[Path, int, int]]] | None:
        """The next ``n`` lines and their origins ``[(file, first line number, count)]``;
        None when fewer than ``n`` are left."""
        lines, origins = [], []
        while len(lines) < n:
            if self._file is None and not self._next_file():
                return None
            got = list(itertools.islice(self._file, n - len(lines)))
            if got:
                origins.append((self._path, self._line + 1, len(got)))
                self._line += len(got)
                lines += got
            else:
                self._file.close()
                self._file = None
        return lines, origins


def batches(files: Sequence[Path], batch_size: int, num_embeddings: Sequence[int], shard_index: int = 0,
            num_shards: int = 1, offset: int = 0, epochs: int = 1) -> Iterator[dict[str, np.ndarray]]:
    """Global batches ``offset + shard_index, offset + shard_index + num_shards, ...`` of
    the stream of ``files`` (``epochs`` times over), each parsed by :func:`parse_lines`;
    global batch ``g`` is lines ``[g * batch_size, (g + 1) * batch_size)``. Ends at the
    last complete batch.

    Raises:
        CriteoFormatError: a line of one of this shard's batches is malformed.
        ValueError: bad arguments.
    """
    if batch_size < 1 or num_shards < 1 or not 0 <= shard_index < num_shards or offset < 0 or epochs < 0:
        raise ValueError(f"criteo.batches: batch_size {batch_size}, shard {shard_index} of {num_shards}, "
                         f"offset {offset}, epochs {epochs}: expected batch_size, num_shards >= 1, "
                         f"0 <= shard_index < num_shards, offset, epochs >= 0")
    stream = _Stream(list(files), epochs)
    try:
        if not stream.skip((offset + shard_index) * batch_size):
            return
        while True:
            taken = stream.take(batch_size)
            if taken is None:
                return
            lines, origins = taken
            yield parse_lines(lines, num_embeddings, locate=_locator(origins))
            if not stream.skip((num_shards - 1) * batch_size):
                return
    finally:
        stream.close()


def _locator(origins: list[tuple[Path, int, int]]):
    """``k -> (file, line number)`` for the ``k``-th line of a batch taken from ``origins``."""
    def locate(k: int) -> tuple[str, int]:
        for path, first, count in origins:
            if k < count:
                return str(path), first + k
            k -= count
        raise IndexError(k)
    return locate


def make_dataset(paths: Sequence[str | Path], *, batch_size: int, num_embeddings: Sequence[int], epochs: int = 1):
    """The ``make_dataset`` argument of :func:`popdist_lite.infeed` for the Criteo files
    of ``paths`` (:func:`list_files`): ``make_dataset(shard_index, num_shards, offset=0)``
    yields :func:`batches`; with its ``offset`` parameter a resumed feed starts exactly
    after the batches already taken, at any replica count (docs/checkpoint.md, "Feed
    position"). The files are listed when a session starts, where the feed runs (the
    replica's feed processes, or its thread)."""
    def load(shard_index: int, num_shards: int, offset: int = 0):
        return batches(list_files(paths), batch_size, num_embeddings, shard_index, num_shards, offset, epochs)
    return load
