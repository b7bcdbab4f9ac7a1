"""popdist-lite for PyTorch: sharded host embeddings whose update runs in backward, and
data parallelism for the dense layers. Imported only when asked for
(``import popdist_lite.torch``); ``import popdist_lite`` never imports torch.

Install with the ``[torch]`` extra (``pip install 'popdist-lite[torch]'``: a CPU build of
torch). A training step::

    import popdist_lite as pl
    import popdist_lite.torch as pt

    emb = pt.HostEmbedding(256, 256, optimizer_spec=pl.HostEmbeddingOptimizerSpec(1.0))
    model = pt.DistributedDataParallel(MyDenseLayers())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = loss_fn(model(emb(ids)), labels)
    loss.backward()        # the table's update (collective) and the dense all-reduce
    optimizer.step()       # the dense update, on every replica alike

- :class:`HostEmbedding`, :class:`HostEmbeddingBag`: ``nn.Embedding``/``nn.EmbeddingBag``
  over a :func:`popdist_lite.create_host_embedding` table (:mod:`.embedding`);
- :class:`EmbeddingBagCollection`, :class:`EmbeddingCollection`: TorchRec's collections
  of tables (a ``KeyedJaggedTensor`` in, a ``KeyedTensor`` out) over the core's
  collection, one exchange for every table (:mod:`.collection`); with the core's
  :class:`EmbeddingBagConfig`, :class:`EmbeddingConfig`, :class:`PoolingType`
  (TorchRec's own configs work too);
- :class:`DistributedDataParallel`, :func:`broadcast_parameters`,
  :func:`all_reduce_gradients` (alias: ``allreduce_gradients``) (:mod:`.data_parallel`);
- :class:`GradScaler`: loss scaling agreed across replicas (:mod:`.grad_scaler`);
- checkpoints: tensors, modules (their host embeddings' tables included), ``torch.optim``
  optimizers and :class:`GradScaler` join ``popdist_lite.save_checkpoint`` /
  ``load_checkpoint`` as they are (:mod:`.checkpoint` registers their adapters).

See docs/torch.md.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("popdist_lite.torch needs PyTorch: pip install 'popdist-lite[torch]' "
                      "(a CPU build: see docs/torch.md)") from exc

from popdist_lite.embedding import EmbeddingBagConfig, EmbeddingConfig, PoolingType

from . import checkpoint as _checkpoint  # noqa: F401  (registers the checkpoint adapters)
from .collection import EmbeddingBagCollection, EmbeddingCollection
from .data_parallel import DistributedDataParallel, all_reduce_gradients, allreduce_gradients, broadcast_parameters
from .embedding import HostEmbedding, HostEmbeddingBag
from .grad_scaler import GradScaler

__all__ = ["HostEmbedding", "HostEmbeddingBag", "EmbeddingBagCollection", "EmbeddingCollection", "EmbeddingBagConfig",
           "EmbeddingConfig", "PoolingType", "DistributedDataParallel", "broadcast_parameters",
           "all_reduce_gradients", "allreduce_gradients", "GradScaler"]
