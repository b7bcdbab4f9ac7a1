"""Reading one ``.npy`` file of a checkpoint: checked, memory-mapped, checksummed,
released as read.

The file is opened as a regular file only (:func:`~.manifest.open_regular`: no
symbolic link, no FIFO) and checked before anything is read from it: its size against
the manifest, its ``.npy`` header (shape, dtype, C order) against the manifest, and
its data's length against what that shape and dtype need. It is then mapped read-only
(``mmap``), so only the pages a replica touches are read; after each part of about
``CHUNK_BYTES`` the pages are released again (``madvise(MADV_DONTNEED)``), so reading
a file costs one chunk of memory beyond the destination, whatever the file's size.
"""

from __future__ import annotations

import mmap
import os
import zlib
from pathlib import Path

import numpy as np

from .format import CHUNK_BYTES, CheckpointError
from .manifest import open_regular

_PAGE = mmap.ALLOCATIONGRANULARITY


class ArrayFile:
    """One file of array ``array_name``, checked against its manifest ``record``
    (``{"file", "shape", "bytes", "crc32"}``) and the array's ``dtype``.

    Raises:
        CheckpointError: the file is missing, not a regular file, has another size, its
            header names another shape or dtype, or it holds fewer or more bytes of data
            than that shape needs (message names the file and the array).
    """

    def __init__(self, directory: Path, array_name: str, record: dict, dtype: np.dtype):
        self.path = Path(directory) / record["file"]
        self.array_name = array_name
        self.record = record
        what = f"{self.path} (array {array_name!r})"
        try:
            self._file = os.fdopen(open_regular(self.path), "rb")
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file missing: {what}") from None
        except CheckpointError as exc:
            raise CheckpointError(f"{exc} (array {array_name!r})") from None
        try:
            size = os.fstat(self._file.fileno()).st_size
            if size != record["bytes"]:
                raise CheckpointError(f"{what} has {size} bytes, the manifest says {record['bytes']} "
                                      f"(truncated or replaced)")
            try:
                version = np.lib.format.read_magic(self._file)
                if version not in ((1, 0), (2, 0)):
                    raise ValueError(f".npy format version {version}, expected 1.0 or 2.0")
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                    np.lib.format.read_array_header_2_0
                shape, fortran, file_dtype = read(self._file)
            except (ValueError, SyntaxError, TypeError) as exc:
                raise CheckpointError(f"{what} is not a valid .npy file: {exc}") from None
            if tuple(shape) != tuple(record["shape"]) or file_dtype != dtype or fortran:
                raise CheckpointError(f"{what}: the file holds {file_dtype}{list(shape)}"
                                      f"{' (Fortran order)' if fortran else ''}, the manifest says "
                                      f"{dtype}{list(record['shape'])}")
            self.shape, self.dtype, self.offset = tuple(shape), np.dtype(dtype), self._file.tell()
            data = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
            if self.offset + data != size:
                raise CheckpointError(f"{what} holds {size - self.offset} bytes of data, its shape and dtype "
                                      f"{self.dtype}{list(self.shape)} need {data} (truncated or padded)")
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        except BaseException:
            self._file.close()
            raise
        self._copied_to = 0  # the file offset up to which release_rows() released pages

    def verify(self) -> None:
        """Check the whole file's crc32 against the manifest, one chunk at a time.

        Raises:
            CheckpointError: a mismatch (names the file and the array).
        """
        crc, size = 0, len(self._map)
        with memoryview(self._map) as view:
            for first in range(0, size, CHUNK_BYTES):
                crc = zlib.crc32(view[first:first + CHUNK_BYTES], crc)
                self._drop(first, min(size, first + CHUNK_BYTES))
        if crc != self.record["crc32"]:
            raise CheckpointError(f"checksum mismatch in {self.path} (array {self.array_name!r}): crc32 "
                                  f"{crc:#010x}, the manifest says {self.record['crc32']:#010x}; the file is "
                                  f"corrupted")

    def array(self) -> np.ndarray:
        """The file's array, a read-only view of the mapping (nothing read yet)."""
        count = int(np.prod(self.shape, dtype=np.int64))
        if count == 0:
            return np.empty(self.shape, self.dtype)
        return np.frombuffer(self._map, self.dtype, count, self.offset).reshape(self.shape)

    def release_rows(self, last_row: int) -> None:
        """Release the pages of rows ``<= last_row`` (axis 0) read so far."""
        row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        end = self.offset + (last_row + 1) * row_bytes
        self._drop(self._copied_to, end)
        self._copied_to = max(self._copied_to, end // _PAGE * _PAGE)

    def _drop(self, start: int, end: int) -> None:
        """Release the whole pages in ``[start, end)`` (rounded down to pages)."""
        start = start // _PAGE * _PAGE
        end = end // _PAGE * _PAGE
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:  # a view is still alive; the mapping goes with it
            pass
        self._file.close()
