"""Durable, reshardable checkpoints of every kind of training state (docs/checkpoint.md).

::

    state = {"step": step, "params": params, "optimizer": opt, "embedding": emb,
             "scaler": scaler, "feed": feed}
    pl.save_checkpoint("ckpt", state, step=step, keep=3)          # collective
    latest = pl.latest_checkpoint("ckpt")                         # collective
    if latest is not None:
        pl.load_checkpoint(latest, state)                         # in place, any replica count

Modules: ``format`` (directory layout, ``.npy`` files, manifest), ``partition`` (how
arrays are split and resharded), ``state`` (what is saved of each kind of state),
``save`` (parallel writes and the atomic commit, background saves), ``load``
(verified, memory-mapped, resharded loads), ``reader`` (one mapped file); each step
ends with :func:`popdist_lite.collectives.agree_objects`, so an error on one replica
is raised on every replica. ``python -m popdist_lite.checkpoint`` inspects and exports
checkpoints.
"""

from .format import CheckpointError
from .load import latest_checkpoint, load_checkpoint
from .save import save_checkpoint, wait

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "wait", "CheckpointError"]
