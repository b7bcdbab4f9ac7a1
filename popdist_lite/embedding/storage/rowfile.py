"""A file of fixed-size records, one per row of a replica's partition: positional
reads and writes of sorted rows, one system call per run of consecutive rows.

A row is a few hundred bytes at a random place in the file, so each transfer costs the
device's latency, not its bandwidth: one after another, a step's misses wait for every
latency in turn, while a device (an SSD, a virtual disk) serves a queue of them at once.
So a call with at least :data:`PARALLEL_RUNS` runs reads them from :data:`IO_THREADS`
threads (the system calls release the GIL). Writes cannot be spread that way: the
kernel serializes buffered writes to one file (the inode's lock), and a write into a
page not in the page cache first reads that page, under the lock. So such a write call
first reads its rows' pages in parallel (into a scratch buffer, not counted as rows
read), then writes into the cached pages one run after another. On the project's VM,
650 random 776-byte rows: read 39-45 ms one after another, 13-18 ms in parallel;
written 44-50 ms one after another, 15-18 ms with the parallel read first
(``docs/offload.md``).

The file's pages are not a second cache: once :data:`DROP_BYTES` of pages were read or
written since the last time (whole pages: a 776-byte row read alone brings in a 4 KiB
page, or two), the whole file is advised ``POSIX_FADV_DONTNEED``, which drops its
clean pages and starts the write-back of dirty ones (dropped by the next advice). The
file is also advised ``POSIX_FADV_RANDOM``: the kernel's read-ahead would otherwise read
far more than the rows asked for (a step's misses spread over the file pulled all of a
73 MiB file into the page cache in one step), uncounted by :data:`DROP_BYTES`. Why not
``O_DIRECT``: ``docs/offload.md``.

The file has no name: it is made with ``O_TMPFILE`` (a file in the directory's
filesystem that is in no directory), or, on a filesystem without it, created under a
random name and unlinked at once, and reached only through its descriptor (reads,
writes and the memory map of :meth:`RowFile.map`), so nobody can swap it for another
file, nothing is left behind when the process is killed, and a forked child's exit
removes nothing. The directory is opened and checked through its descriptor before
the file is made there (no path is looked up twice): one writable by every user
without the sticky bit, or owned by a user other than this one or root, is refused
(:func:`check_directory`).
"""

from __future__ import annotations

import errno
import mmap
import os
import pwd
import secrets
import stat
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from time import perf_counter

import numpy as np

from ... import counters

_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", None)
_RANDOM = getattr(os, "POSIX_FADV_RANDOM", None)
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
#: ``os.O_TMPFILE`` where the platform has it (Linux); ``None`` makes every file the create-then-unlink way.
TMPFILE = getattr(os, "O_TMPFILE", None)
#: Bytes of the pages read or written between two advices (an advice walks the file's cached pages:
#: about 10 ms per 8192-ID step for a 160 MB file when given after every batch).
DROP_BYTES = 8 << 20
#: Threads issuing one call's reads at once (the queue of transfers in flight).
IO_THREADS = 16
#: Runs of consecutive rows below which a call issues its transfers one after another.
PARALLEL_RUNS = 32

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _io_pool() -> ThreadPoolExecutor:
    """The process's I/O threads, made at first use (and again in a forked child)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="popdist-rowfile")
        return _pool


def _forget_pool() -> None:
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()  # the parent's threads do not exist here


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _each(runs: list, transfer) -> None:
    """``transfer(first, stop, at)`` for every run, from :data:`IO_THREADS` threads when
    there are :data:`PARALLEL_RUNS` or more (each thread a share of the runs, in order);
    the first error (in the threads' order) is raised once every thread has stopped."""
    def share(part):
        for run in part:
            transfer(*run)

    if len(runs) < PARALLEL_RUNS:
        share(runs)
        return
    futures = [_io_pool().submit(share, runs[i::IO_THREADS]) for i in range(IO_THREADS)]
    errors = [f.exception() for f in futures]  # waits for every share
    for error in errors:
        if error is not None:
            raise error


class RowFileError(RuntimeError):
    """The partition file is not what this table wrote (truncated)."""


class RowFile:
    """``rows`` records of ``record`` (a numpy structured dtype) in a new file with no
    name (module docstring).

    Args:
        directory: where to make the file (created, mode 0700, if missing); checked by
            :func:`check_directory`.
        prefix: the start of the file's name in errors, and of its short-lived name on a
            filesystem without ``O_TMPFILE`` (table and replica).
        record: the record dtype (``itemsize`` bytes per row).
        rows: how many records.
        stats: dict of counters to add to (``rows_read``, ``rows_written``,
            ``bytes_read``, ``bytes_written``, ``disk_seconds``).
        label: the timeline's detail of each read and write (the table's name); each
            batch is also counted as the phase ``disk.read``/``disk.write`` of
            :mod:`popdist_lite.counters` (calls and seconds; no network bytes).

    Attributes:
        fd: the file's descriptor (``None`` once closed).
        name: how errors name the file (``"<prefix> in <directory>"``; it has no path).

    Raises:
        PermissionError: the directory is refused (:func:`check_directory`).
        OSError: the directory cannot be made, opened or written, or the disk cannot hold
            the file (``posix_fallocate`` reserves every block up front: ``ENOSPC`` here,
            not in the middle of a step).
    """

    def __init__(self, directory, prefix: str, record: np.dtype, rows: int, stats: dict, label: str | None = None):
        directory = tempfile.gettempdir() if directory is None else os.fspath(directory)
        self.name = f"{prefix.rstrip('-')} in {directory}"
        self.fd = _create(directory, prefix)
        self.record, self.rows, self.stats = np.dtype(record), int(rows), stats
        self.size = self.rows * self.record.itemsize
        self.label = label
        self.moved = 0  # bytes of the pages read or written since the last advice
        self._mmap: mmap.mmap | None = None
        try:
            if self.size:
                try:
                    os.posix_fallocate(self.fd, 0, self.size)
                except OSError as exc:
                    raise _explained(exc, f"reserving {self.size} bytes for the partition file", self.name) from None
            if _RANDOM is not None:
                os.posix_fadvise(self.fd, 0, 0, _RANDOM)  # this descriptor's reads: no read-ahead
        except BaseException:
            self.close()
            raise

    def map(self) -> np.ndarray:
        """The whole file as a ``(rows,)`` array of records: a shared memory map of the
        file's descriptor (writes to it reach the file; made once)."""
        if not self.size:
            return np.zeros(0, self.record)
        if self._mmap is None:
            self._mmap = mmap.mmap(self.fd, self.size)  # MAP_SHARED, read and write
        return np.ndarray((self.rows,), self.record, buffer=self._mmap)

    def release_map(self) -> None:
        """Write the map's dirty pages to the file and unmap every page of it from this
        process (``MADV_DONTNEED``; the next access maps them again from the file)."""
        if self._mmap is not None:
            self._mmap.flush()
            if _MADV_DONTNEED is not None:
                self._mmap.madvise(_MADV_DONTNEED)

    def check_size(self) -> None:
        """Raise :class:`RowFileError` unless the file still has its size (a file cut
        short under the table would fail reads, or SIGBUS a memory map)."""
        try:
            size = os.fstat(self.fd).st_size
        except OSError as exc:
            raise RowFileError(f"cannot stat the partition file {self.name}: {exc.strerror}") from None
        if size != self.size:
            raise RowFileError(f"the partition file {self.name} has {size} bytes, expected {self.size} "
                               f"({self.rows} rows of {self.record.itemsize} bytes): it was truncated")

    def read(self, rows: np.ndarray, out: np.ndarray, count: bool = True) -> None:
        """``out[i] = record rows[i]`` for sorted unique ``rows`` (``out``: C-contiguous
        records, ``len(rows)``). ``count=False``: the caller counts the read with
        :meth:`count` (a background reader does so under its cache's lock)."""
        start = perf_counter()
        self._read_runs(list(_runs(rows)), out)
        if count:
            self.count("read", rows, start)

    def _read_runs(self, runs: list, out: np.ndarray) -> None:
        """:meth:`read` of the runs ``runs`` (:func:`_runs`), uncounted."""
        size = self.record.itemsize

        def read_run(first: int, stop: int, at: int) -> None:
            want = (stop - first) * size
            view = memoryview(out[at:at + stop - first]).cast("B")
            try:
                got = os.preadv(self.fd, [view], first * size)
            except OSError as exc:
                raise _explained(exc, f"reading rows {first}..{stop - 1} of the partition file", self.name) from None
            if got != want:
                raise RowFileError(f"short read of rows {first}..{stop - 1} of the partition file {self.name}: "
                                   f"{got} of {want} bytes (the file was truncated)")

        _each(runs, read_run)

    def write(self, rows: np.ndarray, records: np.ndarray, count: bool = True) -> None:
        """Write ``records[i]`` to row ``rows[i]`` for sorted unique ``rows``.
        ``count=False``: the caller counts the write with :meth:`count` (as :meth:`read`)."""
        start = perf_counter()
        size = self.record.itemsize

        def write_run(first: int, stop: int, at: int) -> None:
            view = memoryview(np.ascontiguousarray(records[at:at + stop - first])).cast("B")
            offset, done = first * size, 0
            while done < len(view):
                try:
                    done += os.pwrite(self.fd, view[done:], offset + done)
                except OSError as exc:
                    doing = f"writing rows {first}..{stop - 1} of the partition file"
                    raise _explained(exc, doing, self.name) from None

        runs = list(_runs(rows))
        if len(runs) >= PARALLEL_RUNS:  # the pages in first, in parallel (module docstring)
            self._read_runs(runs, np.empty(len(rows), self.record))
        for run in runs:
            write_run(*run)
        if count:
            self.count("written", rows, start)

    def read_range(self, first: int, stop: int) -> np.ndarray:
        """Records ``[first, stop)`` as a new array."""
        out = np.empty(stop - first, self.record)
        self.read(np.arange(first, stop), out)
        return out

    def write_range(self, first: int, records: np.ndarray) -> None:
        self.write(np.arange(first, first + len(records)), records)

    def drop_pages(self) -> None:
        """Advise the whole file ``POSIX_FADV_DONTNEED`` (see the module doc)."""
        self.moved = 0
        if _DONTNEED is not None and self.size:
            os.posix_fadvise(self.fd, 0, 0, _DONTNEED)

    def count(self, what: str, rows: np.ndarray, start: float, phase: bool = True) -> None:
        """Count a read (``what="read"``) or write (``"written"``) of ``rows`` that began
        at ``start`` (``perf_counter``): :attr:`stats`, the page advice's tally, and
        (``phase``) the phase ``disk.read``/``disk.write`` of :mod:`popdist_lite.counters`
        (whose table only the training loop's thread may touch)."""
        n = len(rows)
        self.moved += _pages(rows, self.record.itemsize) * mmap.PAGESIZE
        if self.moved >= DROP_BYTES:
            self.drop_pages()
        self.stats[f"rows_{what}"] += n
        self.stats[f"bytes_{what}"] += n * self.record.itemsize
        self.stats["disk_seconds"] += perf_counter() - start
        if phase:
            counters.record("disk.read" if what == "read" else "disk.write", start, kind=counters.PHASE,
                            detail=self.label)

    def close(self) -> None:
        """Close the descriptor and drop the memory map (idempotent): the file's blocks are
        freed at once, or when the last array of :meth:`map` is gone (it keeps the map)."""
        self._mmap = None  # unmapped now, or with the last array of it
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def check_directory(fd: int, directory: str) -> None:
    """Refuse the directory open at ``fd`` (named ``directory``) for partition files
    when another user could change its entries under this one: owned by a user other
    than this process's effective user or root, or writable by every user without the
    sticky bit (``/tmp``'s ``1777`` has it: there only a file's owner can rename or
    remove it). A group-writable directory is taken: the file has no name its members
    could reach.

    Raises:
        PermissionError: naming the directory, its owner or mode, and why.
    """
    st = os.fstat(fd)
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise PermissionError(errno.EPERM, f"refused as the directory for partition files: it belongs to "
                                           f"{_user(st.st_uid)}, not to this user ({_user(me)}) or root", directory)
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        raise PermissionError(errno.EPERM, f"refused as the directory for partition files: every user may write "
                                           f"to it (mode {mode:04o}) and it has no sticky bit (as /tmp's 1777 "
                                           f"has), so another user could replace the files in it", directory)


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name!r} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _create(directory: str, prefix: str) -> int:
    """A new empty file with no name in ``directory`` (mode 0600), after
    :func:`check_directory`: its descriptor."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise _explained(exc, "opening the directory for the partition file", exc.filename or directory) from None
    try:
        check_directory(dir_fd, directory)
        if TMPFILE is not None:
            try:
                # O_EXCL: the file can never be given a name (no linkat through /proc/self/fd)
                return os.open(".", os.O_RDWR | TMPFILE | os.O_EXCL, 0o600, dir_fd=dir_fd)
            except OSError:
                pass  # a filesystem without O_TMPFILE; a real error (EACCES, ENOSPC) is met again below
        return _create_unlinked(dir_fd, directory, prefix)
    finally:
        os.close(dir_fd)


def _create_unlinked(dir_fd: int, directory: str, prefix: str) -> int:
    """A new file under a random name in the directory open at ``dir_fd``, unlinked at
    once (after checking the name is still that file's)."""
    for _ in range(100):
        name = f"{prefix}{secrets.token_hex(6)}.rows"
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
        except FileExistsError:
            continue
        except OSError as exc:
            raise _explained(exc, "creating the partition file", os.path.join(directory, name)) from None
        try:
            mine, there = os.fstat(fd), os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if (there.st_dev, there.st_ino) != (mine.st_dev, mine.st_ino):
                raise PermissionError(errno.EPERM, "the partition file was renamed by someone else before it "
                                                   "was unlinked", os.path.join(directory, name))
            os.unlink(name, dir_fd=dir_fd)
        except BaseException:
            os.close(fd)
            raise
        return fd
    raise FileExistsError(errno.EEXIST, "no free name for the partition file", os.path.join(directory, prefix))


def _explained(exc: OSError, doing: str, path) -> OSError:
    """``exc`` again, saying what was being done, the errno's name and the file: its
    message (``Problem.of``'s ``"strerror: filename"``) reads e.g. ``No space left on
    device (ENOSPC) reserving 4096 bytes for the partition file: popdist-t-r0 in /var/tmp``."""
    name = errno.errorcode.get(exc.errno, f"errno {exc.errno}")
    return type(exc)(exc.errno, f"{exc.strerror or os.strerror(exc.errno or 0)} ({name}) {doing}", path)


def _pages(rows: np.ndarray, size: int) -> int:
    """How many pages of the file sorted unique ``rows`` of ``size`` bytes touch (two
    rows next in ``rows`` may share a page; rows further apart share it only if the rows
    between do)."""
    if not len(rows):
        return 0
    rows = np.asarray(rows, dtype=np.int64)
    first, last = rows * size // mmap.PAGESIZE, ((rows + 1) * size - 1) // mmap.PAGESIZE
    return int((last - first + 1).sum() - np.count_nonzero(first[1:] == last[:-1]))


def _runs(rows: np.ndarray):
    """``(first, stop, position)`` of each run of consecutive values in sorted ``rows``."""
    if not len(rows):
        return
    rows = np.asarray(rows, dtype=np.int64)
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [len(rows)]))
    for a, b in zip(starts.tolist(), stops.tolist()):
        yield int(rows[a]), int(rows[b - 1]) + 1, a
