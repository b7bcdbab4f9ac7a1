"""Data-parallel training helpers for dense numpy parameters.

The usual recipe (Graphcore's IPU performance optimisation guide, section 4.3 "Data
parallelism", and PopDist's documented practice): broadcast the initial weights from
replica 0, then on every step
all-reduce the gradients across replicas before the optimizer applies them
(``CrossReplicaOptimizer``).
"""

from __future__ import annotations

import numpy as np

from . import topology
from .collectives import Problem, agree, all_gather, all_reduce, broadcast, reduce_scatter
from .dense_optimizers import DenseOptimizer
from .stochastic_rounding import as_stochastic_rounding


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
    """Averages gradients over replicas, then applies a local optimizer (TensorFlow-IPU's
    ``cross_replica_optimizer.CrossReplicaOptimizer``), optionally with the optimizer
    state sharded over the replicas (replicated tensor sharding).

    Unsharded (default): one fused all-reduce per gradient dtype (float16 gradients
    travel as float16, see :func:`popdist_lite.all_reduce`), then every replica applies
    the same update to its full copy of the parameters. Replicas that start from the
    same weights (see :func:`broadcast_parameters`) stay bit-identical; float16
    parameters are rounded with the replica-identical stream of ``stochastic_rounding``.

    Sharded (``shard_optimizer_state=True``; IPU performance guide, section 4.7
    "Replicated tensor sharding", similar to ZeRO stage 1): per parameter dtype, the
    gradients are fused into one flat buffer zero-padded to ``r * c`` elements
    (``c = ceil(n / r)``), reduce-scattered so replica ``k`` receives the averaged
    elements ``[k*c, (k+1)*c)``, replica ``k`` updates that slice of the parameters and
    holds the optimizer state for it only (about ``1/r`` of the unsharded state), and
    the updated slices are all-gathered back into every replica's parameters. Bytes on
    the wire equal the unsharded all-reduce's (a reduce-scatter plus an all-gather);
    the result equals the unsharded optimizer within float rounding. Requires an
    element-wise optimizer (all of :mod:`popdist_lite.dense_optimizers` are).

    Args:
        optimizer: a :class:`popdist_lite.dense_optimizers.DenseOptimizer` (``SGD``,
            ``MomentumSGD``, ``Adam``) or any object with ``update(params, grads)``.
        op: ``"mean"`` (default) or ``"sum"`` of the replicas' gradients.
        shard_optimizer_state: replicated tensor sharding, as above.
        stochastic_rounding: ``None``/``"OFF"``, ``"ON"``, ``"REPLICA_IDENTICAL_ONLY"``
            or a :class:`popdist_lite.StochasticRounding`, for float16 parameters.
            Unsharded updates are replicated (stochastic in ``ON`` and
            ``REPLICA_IDENTICAL_ONLY``, with identical random numbers on every replica);
            sharded updates are owned by one replica (stochastic in ``ON`` only).
        seed: seed of the stochastic rounding streams (the same on every replica).

    Raises:
        ValueError: a bad ``op`` or stochastic rounding mode.

    Example:
        >>> opt = CrossReplicaOptimizer(Adam(1e-3), shard_optimizer_state=True)
        >>> opt.step(params, grads)   # collective; params updated in place
    """

    def __init__(self, optimizer, op: str = "mean", *, shard_optimizer_state: bool = False,
                 stochastic_rounding=None, seed: int = 0, comm=None):
        if op not in ("mean", "sum"):
            raise ValueError(f"CrossReplicaOptimizer: argument op: expected 'mean' or 'sum', got {op!r}")
        self.optimizer = optimizer
        self.op = op
        self.shard_optimizer_state = bool(shard_optimizer_state)
        self.stochastic_rounding = as_stochastic_rounding(stochastic_rounding, seed=seed)
        #: With ``shard_optimizer_state``: the unpadded length of each flat state buffer
        #: (``"shard:<dtype>"`` -> elements), known from the first step (checkpoints use it).
        self.shard_sizes: dict[str, int] = {}
        self._comm = comm

    def step(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray], *,
             loss_scale: float = 1.0) -> None:
        """Reduce ``grads`` over replicas and update ``params`` in place. Collective.

        Args:
            params: name -> float array; the same names, shapes and dtypes on every replica.
            grads: name -> float array of the parameter's shape, this replica's gradients
                (still multiplied by ``loss_scale``; they travel in their own dtype).
            loss_scale: the factor the loss was multiplied by; the reduced gradients are
                divided by it in float32 before the update (see
                :mod:`popdist_lite.loss_scaling`).

        Raises:
            KeyError: ``grads`` misses a parameter (checked locally, before any
                communication).
            ValueError, TypeError: on every replica, when the fused buffers differ
                between replicas.
        """
        missing = sorted(set(params) - set(grads))
        if missing:
            # Raised on every replica: the others are entering the first collective of
            # the step, so this replica joins its argument check with the error.
            agree("reduce_scatter_sum" if self.shard_optimizer_state else "all_reduce", None,
                  self._comm if self._comm is not None else topology.replica_comm(),
                  problem=Problem(KeyError, f"CrossReplicaOptimizer.step: argument grads: missing gradients "
                                            f"for {missing}"))
        if self.shard_optimizer_state:
            self._sharded_step(params, grads, loss_scale)
            return
        reduced = all_reduce_gradients({n: grads[n] for n in params}, op=self.op, comm=self._comm)
        if loss_scale != 1.0:
            reduced = {n: _unscale(g, loss_scale) for n, g in reduced.items()}
        self._update(params, reduced, replicated=True)

    def _update(self, params, grads, replicated: bool) -> None:
        if isinstance(self.optimizer, DenseOptimizer):
            self.optimizer.update(params, grads, rounding=self.stochastic_rounding, replicated=replicated)
        else:
            self.optimizer.update(params, grads)

    def _sharded_step(self, params, grads, loss_scale) -> None:
        comm = self._comm if self._comm is not None else topology.replica_comm()
        r, k = comm.size, comm.rank
        groups, wshards, gshards = [], {}, {}
        for dtype, group in _dtype_groups(params):
            total = int(sum(params[n].size for n in group))
            c = -(-total // r)
            gdtype = np.result_type(*(np.asarray(grads[n]).dtype for n in group))
            gbuf = np.zeros(r * c, dtype=gdtype)
            gbuf[:total] = np.concatenate([np.asarray(grads[n], dtype=gdtype).reshape(-1) for n in group])
            key = f"shard:{dtype}"
            self.shard_sizes[key] = total
            gshards[key] = _unscale(reduce_scatter(gbuf.reshape(r, c), self.op, comm=comm), loss_scale)
            flat = np.zeros(r * c, dtype=dtype)
            flat[:total] = np.concatenate([params[n].reshape(-1) for n in group])
            wshards[key] = flat[k * c:(k + 1) * c].copy()
            groups.append((key, group))
        self._update(wshards, gshards, replicated=False)  # one optimizer step over every shard
        for key, group in groups:
            full = all_gather(wshards[key], comm=comm).reshape(-1)
            offset = 0
            for n in group:
                size = params[n].size
                params[n][...] = full[offset:offset + size].reshape(params[n].shape)
                offset += size

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this replica (about ``1/r`` of the unsharded
        figure with ``shard_optimizer_state=True``)."""
        fn = getattr(self.optimizer, "state_bytes", None)
        return int(fn()) if fn else 0

    def init(self, params: dict[str, np.ndarray]) -> None:
        """Create the optimizer state for ``params`` now (Optax's ``init``; the first
        :meth:`step` does it otherwise), so that a checkpoint loads into arrays whose
        shapes and dtypes come from the parameters. Local (no communication)."""
        if not isinstance(self.optimizer, DenseOptimizer):
            return
        if not self.shard_optimizer_state:
            self.optimizer.init(params)
            return
        r = self._comm.size if self._comm is not None else topology.replica_comm().size
        shards = {}
        for dtype, group in _dtype_groups(params):
            total = int(sum(params[n].size for n in group))
            key = f"shard:{dtype}"
            self.shard_sizes[key] = total
            shards[key] = np.empty(-(-total // r), dtype)
        self.optimizer.init(shards)

    # -- checkpoints (the Stateful protocol of popdist_lite.checkpoint) -----------------
    def checkpoint_info(self) -> dict:
        return {"optimizer": type(self.optimizer).__name__, "shard_optimizer_state": self.shard_optimizer_state}

    def state_dict(self) -> dict:
        """The wrapped optimizer's slots (replicated, or with ``shard_optimizer_state`` the
        ``block`` partition of each flat state buffer) and step counter, and the
        stochastic-rounding generator states. Live references; local.

        Raises:
            TypeError: the wrapped optimizer is not a popdist-lite ``DenseOptimizer``.
        """
        from .checkpoint.partition import Partition
        from .checkpoint.stateful import Partitioned, PerReplica

        inner = self.optimizer
        if not isinstance(inner, DenseOptimizer):
            raise TypeError(f"the CrossReplicaOptimizer wraps a {type(inner).__name__}; only popdist_lite "
                            f"DenseOptimizers (SGD, MomentumSGD, Adam) can be saved")
        block = Partition("block", 0)
        tree = inner.state_dict(block if self.shard_optimizer_state else None)
        if self.shard_optimizer_state and inner.state:
            tree["state"] = {key: {slot: Partitioned(a, (self.shard_sizes[key],), block) for slot, a in slots.items()}
                             for key, slots in inner.state.items()}
        states = self.stochastic_rounding.generator_states()
        tree["generators"] = {"replica_identical": states["replica_identical"],
                              "per_replica": PerReplica(states["per_replica"])}
        return tree

    def validate_state_dict(self, state_dict: dict, saved) -> None:
        """Refuse a checkpoint of another optimizer, or of unsharded state into sharded
        (and back), or with bad generator states or step counter."""
        kind = type(self.optimizer).__name__
        if saved.info.get("optimizer", kind) != kind:
            raise ValueError(f"optimizer {saved.name!r} was a {saved.info['optimizer']}, the one being loaded is "
                             f"a {kind}")
        if bool(saved.info.get("shard_optimizer_state", self.shard_optimizer_state)) != self.shard_optimizer_state:
            raise ValueError(f"optimizer {saved.name!r} was saved with shard_optimizer_state="
                             f"{saved.info['shard_optimizer_state']}, the one being loaded has "
                             f"{self.shard_optimizer_state}")
        self.optimizer.validate_state_dict(state_dict, saved)
        try:
            self.stochastic_rounding.check_generator_states(state_dict.get("generators", {}))
        except ValueError as exc:
            raise ValueError(f"optimizer {saved.name!r}: {exc}") from None
        if self.shard_optimizer_state:
            for key, slots in state_dict.get("state", {}).items():
                if not key.startswith("shard:"):
                    raise ValueError(f"optimizer {saved.name!r}: sharded state {key!r} is not a flat buffer "
                                     f"'shard:<dtype>'")

    def load_state_dict(self, state_dict: dict) -> None:
        """Take the state of :meth:`state_dict` (see :meth:`DenseOptimizer.load_state_dict`)."""
        if self.shard_optimizer_state:
            for key, slots in state_dict.get("state", {}).items():
                for array in slots.values():
                    self.shard_sizes[key] = int(array.shape[0])
        self.optimizer.load_state_dict(state_dict)
        self.stochastic_rounding.set_generator_states(state_dict.get("generators", {}))


def _dtype_groups(params: dict[str, np.ndarray]):
    """``(dtype, sorted names)`` of the parameters of each dtype, dtypes in name order:
    the flat buffers of replicated tensor sharding."""
    names = sorted(params)
    for dtype in sorted({params[n].dtype for n in names}, key=str):
        yield dtype, [n for n in names if params[n].dtype == dtype]


def _unscale(g: np.ndarray, loss_scale: float) -> np.ndarray:
    """``g / loss_scale`` in float32 (float64 stays float64)."""
    g = g.astype(np.result_type(g.dtype, np.float32), copy=False)
    return g if loss_scale == 1.0 else g / np.asarray(loss_scale, g.dtype)
