"""Data-parallel training helpers for dense numpy parameters.

The seed's recipe (IPU performance guide, "data parallelism"; PopDist practice in
REFERENCE.md): broadcast the initial weights from replica 0, then on every step
all-reduce the gradients across replicas before the optimizer applies them
(``CrossReplicaOptimizer``).
"""

from __future__ import annotations

import numpy as np

from .collectives import all_reduce, broadcast


def broadcast_parameters(params: dict[str, np.ndarray], root: int = 0, *, comm=None) -> None:
    """Overwrite every replica's ``params`` in place with the root replica's. Collective.

    Args:
        params: name -> array; the same names, shapes and dtypes on every replica.
        root: source replica.

    Raises:
        ValueError, TypeError: on every replica when names, shapes or dtypes differ.
    """
    for name in sorted(params):
        value = broadcast(params[name], root=root, comm=comm)
        if value is not params[name]:
            params[name][...] = value


def all_reduce_gradients(grads: dict[str, np.ndarray], op: str = "mean", *, comm=None) -> dict[str, np.ndarray]:
    """All-reduce a dict of gradients with one fused all-reduce per dtype (Horovod's
    tensor fusion): fewer, larger messages than one call per tensor.

    Args:
        grads: name -> array; the same names, shapes and dtypes on every replica.
        op: ``"mean"`` (default) or ``"sum"``.

    Returns:
        name -> reduced array (new arrays).

    Raises:
        ValueError, TypeError: on every replica when the fused buffers differ.
    """
    out: dict[str, np.ndarray] = {}
    names = sorted(grads)
    for dtype in sorted({np.asarray(grads[n]).dtype for n in names}, key=str):
        group = [n for n in names if np.asarray(grads[n]).dtype == dtype]
        flat = np.concatenate([np.asarray(grads[n]).reshape(-1) for n in group])
        reduced = all_reduce(flat, op=op, comm=comm)
        offset = 0
        for n in group:
            size = np.asarray(grads[n]).size
            out[n] = reduced[offset:offset + size].reshape(np.shape(grads[n]))
            offset += size
    return out


class CrossReplicaOptimizer:
    """Averages gradients over replicas, then applies a local optimizer (the seed's
    ``cross_replica_optimizer.CrossReplicaOptimizer``).

    Replicas that start from the same weights (see :func:`broadcast_parameters`) stay
    identical: each applies the same averaged gradients.

    Example:
        >>> opt = CrossReplicaOptimizer(MomentumSGD(0.1, momentum=0.9))
        >>> opt.step(params, grads)   # collective; params updated in place
    """

    def __init__(self, optimizer, op: str = "mean", *, comm=None):
        if op not in ("mean", "sum"):
            raise ValueError(f"CrossReplicaOptimizer: argument op: expected 'mean' or 'sum', got {op!r}")
        self.optimizer = optimizer
        self.op = op
        self._comm = comm

    def step(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> None:
        """Reduce ``grads`` over replicas and update ``params`` in place. Collective.

        Raises:
            KeyError: ``grads`` misses a parameter (raised before any communication
                only if the names differ; names are compared across replicas by the
                fused all-reduce's shape check).
        """
        missing = sorted(set(params) - set(grads))
        if missing:
            raise KeyError(f"CrossReplicaOptimizer.step: argument grads: missing gradients for {missing}")
        reduced = all_reduce_gradients({n: grads[n] for n in params}, op=self.op, comm=self._comm)
        self.optimizer.update(params, reduced)
