"""Collectives over replicas on numpy arrays: one module per collective, buffer-based
mpi4py calls (no pickling), arguments checked across replicas so that bad input raises
the same error on every replica instead of hanging."""

from ._common import comm_stats
from .all_gather import all_gather, all_gather_v
from .all_reduce import all_reduce
from .all_to_all import all_to_all, all_to_all_v
from .broadcast import broadcast
from .reduce_scatter import reduce_scatter_sum

__all__ = ["comm_stats", "all_gather", "all_gather_v", "all_reduce", "all_to_all", "all_to_all_v", "broadcast",
           "reduce_scatter_sum"]
