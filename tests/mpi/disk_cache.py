"""The cache size the disk-table test modules give DiskStorage: bytes for a number of
cached rows of a table, from its creation arguments."""

import numpy as np

from popdist_lite.embedding.storage.cache import SLOT_OVERHEAD


def cache_bytes(table_kwargs: dict, spec, e: int, r: int, rows: int) -> int:
    """``cache_bytes`` of a DiskStorage whose cache holds ``rows`` records (at least:
    replicated optimizer state, which has no place in a record, is counted too) of a
    table of ``e`` columns on ``r`` replicas made with ``table_kwargs``
    (``partition_strategy``, ``dtype`` (default float32), ``master_weights``) and the
    optimizer ``spec``."""
    cols = e if table_kwargs["partition_strategy"] == "TOKEN" else -(-e // r)
    master = np.dtype(table_kwargs.get("master_weights") or table_kwargs.get("dtype", np.float32))
    record = master.itemsize * cols + sum(a.nbytes for a in spec.init_state((1, cols)).values())
    return rows * (record + SLOT_OVERHEAD)
