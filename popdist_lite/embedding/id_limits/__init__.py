"""ID limits of TOKEN tables (SparseCore's per-partition limits), one module per part:

- :mod:`.settings`: :class:`IdLimits` (a table's limits and what to do beyond them)
  and :class:`IdLimitError`;
- :mod:`.partitions`: the per-partition counts, the error message, the rule that
  chooses dropped IDs (pure numpy);
- :mod:`.minibatch_split`: hash buckets and the binary-tree split into minibatches
  (pure numpy);
- :mod:`.enforcer`: the collective part, keeping one lookup or update within the
  limits (check, drop, or run in minibatches);
- :mod:`.stats`: the per-call ID statistics and the recorder that suggests limits.
"""

from .minibatch_split import bucket_of, minibatch_ranges, split_mask
from .settings import IdLimitError, IdLimits
from .stats import IdLimitRecorder, last_id_stats

__all__ = ["IdLimits", "IdLimitError", "IdLimitRecorder", "last_id_stats", "bucket_of", "split_mask",
           "minibatch_ranges"]
