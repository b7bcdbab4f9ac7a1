"""Where a host embedding table keeps its partition: in memory (the default) or in a
file on local disk behind a bounded cache of hot rows (:class:`DiskStorage`).

The in-memory table holds its partition and optimizer state as numpy arrays; a disk
table holds them in a file of fixed-size records (:mod:`.rowfile`) with a cache in
front (:mod:`.cache`), seen by the table through :class:`.disk.DiskRows` (gather rows by
local index for lookups, read-modify-write of the touched rows for updates). Design and
figures: ``docs/offload.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...validation import check_integer

__all__ = ["DiskStorage", "CACHE_POLICIES", "as_storage"]

#: Eviction policies of the hot-row cache (FBGEMM's ``CacheAlgorithm`` offers the same two).
CACHE_POLICIES = ("lru", "lfu")


@dataclass(frozen=True)
class DiskStorage:
    """A table whose partition lives in a file on local disk, behind a cache of hot rows.

    Each replica writes its partition's rows and their optimizer state (Adagrad/Adam
    moments, the float32 master rows of a float16 table) as fixed-size records to a
    file of its own in ``directory``; at most ``cache_bytes`` of records are held in RAM.

    Args:
        cache_bytes: the cache's size in bytes (records plus 23 bytes of bookkeeping per
            cached row); it must hold the distinct rows of the largest lookup or update
            one replica serves (else :class:`CacheTooSmall` on every replica), and with
            prefetch (:meth:`popdist_lite.HostEmbedding.prefetch`) those of the batches in
            flight, ``prefetch_depth + 1`` of them (``docs/offload.md``). Beyond it
            a replica keeps 4 bytes per row of its partition (the row -> cache slot index).
        cache_policy: ``"lru"`` (evict the least recently used rows) or ``"lfu"`` (the
            least frequently used while cached; ties by slot).
        directory: where the partition files go (local disk; created, mode 0700, if
            missing); ``None``: :func:`tempfile.gettempdir`. A file is the table's
            working copy, with no name in the directory (``O_TMPFILE``, or unlinked right
            after it is made) and reached only through its descriptor: nobody can swap
            it, and its blocks are freed when the table is garbage-collected or the
            process ends, however it ends; the truth across restarts is the checkpoint.
            A directory writable by every user without the sticky bit, or owned by
            another user than this one or root, is refused.

    Raises:
        ValueError: ``cache_bytes`` not an integer >= 1 or an unknown ``cache_policy``
            (here); a refused ``directory`` is a ``RuntimeError`` on every replica when
            the table is made.
    """

    cache_bytes: int
    cache_policy: str = "lru"
    directory: str | None = None

    def __post_init__(self):
        check_integer("DiskStorage", "cache_bytes", self.cache_bytes)
        if self.cache_policy not in CACHE_POLICIES:
            raise ValueError(f"DiskStorage: argument cache_policy: expected one of {CACHE_POLICIES}, "
                             f"got {self.cache_policy!r}")
        if self.directory is not None and not isinstance(self.directory, (str, bytes)) \
                and not hasattr(self.directory, "__fspath__"):
            raise ValueError(f"DiskStorage: argument directory: expected a path or None, got {self.directory!r}")


def as_storage(storage) -> DiskStorage | None:
    """``None`` for the in-memory table (``None`` or ``"memory"``), else the :class:`DiskStorage`.

    Raises:
        TypeError: anything else.
    """
    if storage is None or storage == "memory":
        return None
    if isinstance(storage, DiskStorage):
        return storage
    raise TypeError(f"argument storage: expected None, 'memory' or a DiskStorage, got {storage!r}")
