"""Where a feed session starts: at batch 0, or after the batches a checkpoint says were
already taken (:meth:`popdist_lite.Infeed.seek`).

A dataset is opened at batch ``skip`` of its shard by calling
``make_dataset(shard_index, num_shards, start=skip)`` when ``make_dataset`` has a
``start`` parameter (it can jump there, e.g. from a sample offset), else by computing
and dropping the first ``skip`` batches.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable, Iterator


def _accepts_start(make_dataset: Callable) -> bool:
    try:
        return "start" in inspect.signature(make_dataset).parameters
    except (TypeError, ValueError):  # builtins and C callables without a signature
        return False


def open_dataset(make_dataset: Callable[..., Iterable[Any]], shard_index: int, num_shards: int,
                 skip: int = 0) -> Iterator[Any]:
    """The batches of ``make_dataset(shard_index, num_shards)`` from batch ``skip`` on."""
    if skip and _accepts_start(make_dataset):
        return iter(make_dataset(shard_index, num_shards, start=skip))
    batches = iter(make_dataset(shard_index, num_shards))
    for _ in range(skip):
        if next(batches, _MISSING) is _MISSING:
            break
    return batches


def feeder_skip(first_step: int, num_feeders: int, feeder: int) -> int:
    """How many of its batches feeder ``feeder`` skips so that the replica's step
    ``first_step`` is the first served (step ``s`` comes from feeder ``s % F``)."""
    return len(range(feeder, max(first_step, 0), num_feeders))


_MISSING = object()
