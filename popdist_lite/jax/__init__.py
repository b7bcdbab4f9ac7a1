"""popdist-lite for JAX: host embeddings and data-parallel training for jit-compiled
JAX and Flax models (``pip install 'popdist-lite[jax]'``; docs/jax.md).

``import popdist_lite`` never imports JAX; ``import popdist_lite.jax`` does (and Flax
only when :class:`SparseCoreEmbed` is used). Two ways in:

- the split API (the fast path): host lookups return ``jax.Array`` s, the user's jitted
  dense step computes the gradients of the loss with respect to them, host updates take
  them: :func:`create_host_embedding` (one table), :class:`EmbeddingCollection` (the
  tables of several :class:`FeatureSpec` s), :class:`TrainStep` (the whole step, with
  the next step's lookup overlapped where it can be);
- the in-jit path: :meth:`EmbeddingCollection.lookup_in_jit`, a ``custom_vjp`` whose
  host callbacks look up in the forward pass and update in the backward pass, for one
  jitted function (slower).

Flax: :class:`SparseCoreEmbed` (after jax-tpu-embedding's layer of that name). Dense
data parallelism: :func:`all_reduce_gradients`, :func:`broadcast_parameters` (aliases:
``allreduce_gradients``, ``broadcast_params``) and the Optax transformation
:func:`cross_replica_mean`. Checkpoints (``popdist_lite.save_checkpoint``
/ ``load_checkpoint``): :class:`PytreeState` holds a pytree (params, Optax state);
:class:`HostEmbedding` and :class:`EmbeddingCollection` join as they are.
"""

try:
    import jax  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("popdist_lite.jax needs JAX: pip install 'popdist-lite[jax]' (JAX, Flax and Optax for "
                      "the CPU: see docs/jax.md)") from exc

from .checkpoint import PytreeState
from .collection import EmbeddingCollection
from .data_parallel import (all_reduce_gradients, allreduce_gradients, broadcast_parameters, broadcast_params,
                            cross_replica_mean)
from .embedding import HostEmbedding, create_host_embedding
from .specs import PADDING_ID, FeatureSpec, TableSpec
from .train_step import TrainStep

_FLAX = {"SparseCoreEmbed", "EmbeddingLookupInput", "HANDLE_PARAM_NAME"}


def __getattr__(name):  # Flax is imported only when its layer is asked for
    if name in _FLAX:
        from . import linen

        return getattr(linen, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["HostEmbedding", "create_host_embedding", "TableSpec", "FeatureSpec", "PADDING_ID", "EmbeddingCollection",
           "TrainStep", "all_reduce_gradients", "broadcast_parameters", "allreduce_gradients", "broadcast_params",
           "cross_replica_mean", "PytreeState",
           "SparseCoreEmbed", "EmbeddingLookupInput", "HANDLE_PARAM_NAME"]
