"""Collectives over replicas on numpy arrays: one module per collective, buffer-based
mpi4py calls (no pickling), arguments checked across replicas so that bad input raises
the same error on every replica instead of hanging. Every call is numbered (the stall
inspector sees it) and counted in :mod:`popdist_lite.counters` (``popdist_lite.stats()``).
:func:`all_reduce_start` is the one unchecked, non-blocking collective (in place; for
buffers agreed beforehand, such as the gradient buckets of
``popdist_lite.torch.DistributedDataParallel``).

:mod:`.agreement` is the check itself, public for the other packages' collectives
(embeddings, the feed, checkpoints): :class:`Problem`, :func:`agree` (buffer-based),
:func:`agree_objects` (pickled, for rare calls), :func:`register_op`; and, from the leaf
module :mod:`popdist_lite.calls`, :func:`next_call_number` and :func:`comm_cache` (state
kept on a communicator).
"""

from .agreement import (Problem, agree, agree_objects, comm_cache, next_call_number, register_op,
                        set_collective_checks)
from .all_gather import all_gather, all_gather_v
from .all_reduce import PendingAllReduce, all_reduce, all_reduce_start
from .all_to_all import all_to_all, all_to_all_v
from .broadcast import broadcast
from .reduce_scatter import reduce_scatter, reduce_scatter_sum

__all__ = ["all_gather", "all_gather_v", "all_reduce", "all_reduce_start", "PendingAllReduce", "all_to_all", "all_to_all_v", "broadcast",
           "reduce_scatter_sum", "reduce_scatter", "set_collective_checks", "Problem", "agree", "agree_objects", "register_op",
           "next_call_number", "comm_cache"]
