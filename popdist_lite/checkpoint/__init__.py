"""Durable, reshardable checkpoints of every kind of training state (docs/checkpoint.md).

::

    state = {"step": step, "params": params, "optimizer": opt, "embedding": emb,
             "scaler": scaler, "feed": feed}
    pl.save_checkpoint("ckpt", state, step=step, keep=3)          # collective
    latest = pl.latest_checkpoint("ckpt")                         # collective
    if latest is not None:
        pl.load_checkpoint(latest, state)                         # in place, any replica count

Objects join through the :class:`Stateful` protocol (``state_dict()`` /
``load_state_dict()``, as torch.distributed.checkpoint's), declaring split arrays with
:class:`Partitioned` and per-replica values with :class:`PerReplica`
(:mod:`.stateful`); the library's tables, optimizers, loss scalers and feed implement
it, and so can your own objects. Classes whose ``state_dict()`` means something else
join through an adapter (:func:`register_adapter`: torch's, by ``popdist_lite.torch``).

Modules: ``stateful`` (the protocol), ``state`` (walking a state: what is saved, where
a load puts it back), ``format`` (directory layout, ``.npy`` files), ``manifest`` (the
manifest, checked as untrusted input), ``partition`` (how arrays are split and
resharded), ``save`` (parallel writes and the atomic commit, background saves),
``load`` (verified, memory-mapped, resharded loads), ``reader`` (one checked, mapped
file); each step ends with :func:`popdist_lite.collectives.agree_objects`, so an error
on one replica is raised on every replica. ``python -m popdist_lite.checkpoint``
inspects and exports checkpoints.
"""

from .format import CheckpointError
from .load import latest_checkpoint, load_checkpoint
from .partition import Partition
from .save import save_checkpoint, wait
from .stateful import Allocate, Partitioned, PerReplica, Saved, Stateful, register_adapter

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "wait", "CheckpointError", "Stateful",
           "Partitioned", "PerReplica", "Allocate", "Partition", "Saved", "register_adapter"]
