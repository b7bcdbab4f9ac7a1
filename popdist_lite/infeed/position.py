"""Where a feed session starts: at the beginning, or after the batches a checkpoint says
the replicas have already taken (:meth:`popdist_lite.Infeed.seek`).

The feed's **position** is counted in global terms: the per-replica batches taken by all
replicas together, ``P``. A dataset is one global sequence of batches ``0, 1, 2, ...``
sharded as ``tf.data``'s ``shard`` (shard ``i`` of ``n`` yields ``i, i + n, ...``), so at R
replicas step ``s`` of replica ``r`` takes batch ``P0 + s*R + r`` and a step advances the
position by R. Counting per-replica batches rather than samples is the same thing when the
per-replica batch size is fixed (the batch policy of docs/elastic.md).

A session starts after ``P`` in one of two ways, chosen by ``make_dataset``'s signature:

* **offset** (exact): ``make_dataset(shard_index, num_shards, offset=P)`` yields batches
  ``P + shard_index, P + shard_index + num_shards, ...`` of the global sequence. Every
  session starts at step 0 of its own round robin over the feeders, so at any replica and
  feeder count the batches taken continue exactly after ``P``: none repeated, none
  skipped.
* **steps** (any other dataset): the session starts at the replica step ``s`` whose
  batches all come after the ``P`` taken, ``s = ceil(P / R)`` (``P / R`` when the count
  did not change): ``make_dataset(shard_index, num_shards, start=k)`` when it has a
  ``start`` parameter (``k`` batches of its shard to skip), else the first ``k`` batches
  are computed and dropped. Nothing is repeated; after a change of replica count fewer
  than R batches are skipped.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable, Iterator


def accepts(make_dataset: Callable, name: str) -> bool:
    """Whether ``make_dataset`` takes a parameter ``name`` (False when it has no signature)."""
    try:
        return name in inspect.signature(make_dataset).parameters
    except (TypeError, ValueError):  # builtins and C callables without a signature
        return False


def takes_offset(make_dataset: Callable) -> bool:
    """Whether ``make_dataset`` can start at a global position (an ``offset`` parameter)."""
    return accepts(make_dataset, "offset")


def open_dataset(make_dataset: Callable[..., Iterable[Any]], shard_index: int, num_shards: int,
                 skip: int = 0, offset: int | None = None) -> Iterator[Any]:
    """The batches of shard ``shard_index`` of ``num_shards``: from global position
    ``offset`` (``make_dataset(..., offset=offset)``), or from batch ``skip`` of the shard."""
    if offset is not None:
        return iter(make_dataset(shard_index, num_shards, offset=offset))
    if skip and accepts(make_dataset, "start"):
        return iter(make_dataset(shard_index, num_shards, start=skip))
    batches = iter(make_dataset(shard_index, num_shards))
    for _ in range(skip):
        if next(batches, _MISSING) is _MISSING:
            break
    return batches


def session_start(position: int, replicas: int, exact: bool) -> tuple[int, int | None]:
    """``(first_step, offset)`` of a session at ``replicas`` replicas that continues after
    ``position`` global batches: ``(0, position)`` for a dataset with an ``offset``
    parameter (``exact``), else ``(ceil(position / replicas), None)``."""
    if exact:
        return 0, position
    return -(-position // replicas), None


def feeder_skip(first_step: int, num_feeders: int, feeder: int) -> int:
    """How many of its batches feeder ``feeder`` skips so that the replica's step
    ``first_step`` is the first served (step ``s`` comes from feeder ``s % F``)."""
    return len(range(feeder, max(first_step, 0), num_feeders))


_MISSING = object()
