"""Host feed: run a dataset in feed processes (or a thread) and stream its batches to
the replica, with prefetch. See docs/infeed.md.

The reason for PopDist (Graphcore's IPU performance optimisation guide, section 4.3.2): one
host process cannot preprocess fast enough for many replicas, so more host processes
feed them; prefetch depth 3 "seems optimal" (section 4.4.1).

Modules: ``structure`` (batch layout), ``protocol`` (messages), ``feeder`` (feeder
loop), ``receiver`` (replica side with feeders), ``local`` (thread when F = 0),
``stream`` (the replicas' iterator and end-of-data agreement).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from .. import topology
from .position import takes_offset
from .stream import Infeed

__all__ = ["infeed", "Infeed", "feed_shard"]

DEFAULT_PREFETCH_DEPTH = 3  # the optimum of the IPU performance optimisation guide, section 4.4.1


def feed_shard(replica: int, num_replicas: int, feeders_per_replica: int,
               feeder_index: int = 0) -> tuple[int, int]:
    """``(shard_index, num_shards)`` given to ``make_dataset`` by feeder ``feeder_index``
    of ``replica`` (with ``feeders_per_replica == 0``: by the replica's thread).

    ``F == 0``: ``(replica, R)``. ``F > 0``: ``(replica + R * feeder_index, R * F)``.
    The replica takes its feeders' batches round robin, so if ``make_dataset(i, n)``
    yields batches ``i, i + n, i + 2n, ...`` of one global sequence (``tf.data``'s
    ``shard``), replica ``r`` sees batches ``r, r + R, r + 2R, ...`` whatever ``F`` is;
    with ``F == 1`` the shard is ``(replica, R)`` for any dataset.
    """
    if feeders_per_replica == 0:
        return replica, num_replicas
    return replica + num_replicas * feeder_index, num_replicas * feeders_per_replica


def infeed(make_dataset: Callable[[int, int], Iterable[Any]],
           prefetch_depth: int = DEFAULT_PREFETCH_DEPTH) -> Infeed:
    """Feed this replica with batches of ``make_dataset``, computed ahead by host feed
    processes (``poprun-lite --feeders-per-replica F``) or, with none, by a thread.

    The same script runs on every rank; call this before any replica collective::

        feed = popdist_lite.infeed(make_dataset)      # a feeder never returns from here
        for batch in feed: ...                        # replicas only

    Args:
        make_dataset: ``make_dataset(shard_index, num_shards)`` returns an iterable of
            batches: a tuple or dict (``str`` keys) of numpy arrays, or one array, with
            the same keys, dtypes and numbers of dimensions in every batch (shapes may
            change). Called with the shard of :func:`feed_shard`, on each feeder (or in
            a thread of the replica when F = 0), at the start of each session. With an
            ``offset`` parameter it is called as ``make_dataset(shard_index, num_shards,
            offset=P)`` and must yield batches ``P + shard_index, P + shard_index +
            num_shards, ...`` of one global sequence: a checkpoint then resumes exactly
            at its global position at any replica count (elastic jobs; the contract is
            in :mod:`popdist_lite.infeed.position`).
        prefetch_depth: most batches in flight per replica, >= 1 (default 3, section
            4.4.1 of the IPU performance optimisation guide): batches sent by feeders (or handed
            over by the thread) that the training loop has not released yet.

    Returns:
        On a replica, an :class:`Infeed` iterator (it starts at the first ``next()``);
        it stops on every replica at the same step, when any replica's data runs out.
        :meth:`Infeed.prefetch_rows` has it prefetch a disk table's rows for the
        batches ahead (``docs/offload.md``).
        On a feeder it does not return: the rank serves its replica, then finalizes MPI
        and exits with code 0 once the replica exits.

    Raises:
        ValueError: ``prefetch_depth < 1``.
        TypeError: (while iterating) a batch is not a tuple/dict of numpy arrays, or
            its structure differs from earlier batches or from another feeder's.
        Exception: whatever ``make_dataset`` raises (on a feeder the failure hook then
            ends the job, naming ``feeder K of replica N``).
    """
    if int(prefetch_depth) != prefetch_depth or prefetch_depth < 1:
        raise ValueError(f"infeed: prefetch_depth must be an integer >= 1, got {prefetch_depth!r}")
    prefetch_depth = int(prefetch_depth)
    topology.init()
    topo = topology.current()
    r, n, f = topo.replica_id, topo.num_replicas, topo.feeders_per_replica
    if topo.role == "feeder":
        from . import feeder

        k = topo.feeder_index
        shard_index, num_shards = feed_shard(r, n, f, k)
        feeder.serve(make_dataset, topo.feed, shard_index, num_shards, f"feeder {k} of replica {r}")
    exact = takes_offset(make_dataset)
    if f == 0:
        from .local import ThreadSource

        return Infeed(ThreadSource(make_dataset, r, n, prefetch_depth, r), prefetch_depth, exact)
    from .receiver import FeederSource

    return Infeed(FeederSource(topo.feed, prefetch_depth, r), prefetch_depth, exact)
