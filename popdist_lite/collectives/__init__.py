"""Collectives over replicas on numpy arrays: one module per collective, buffer-based
mpi4py calls (no pickling), arguments checked across replicas so that bad input raises
the same error on every replica instead of hanging. Every call is counted in
:mod:`popdist_lite.counters` (``popdist_lite.stats()``)."""

from .fingerprint import set_collective_checks
from .all_gather import all_gather, all_gather_v
from .all_reduce import all_reduce
from .all_to_all import all_to_all, all_to_all_v
from .broadcast import broadcast
from .reduce_scatter import reduce_scatter_sum

__all__ = ["all_gather", "all_gather_v", "all_reduce", "all_to_all", "all_to_all_v", "broadcast",
           "reduce_scatter_sum", "set_collective_checks"]
