"""One host embedding table for JAX programs: the split API's lookup and update.

The table is a :class:`popdist_lite.HostEmbedding` (partitioned over the replicas,
its exchange and optimizer on the host); this wrapper takes indices and gradients as
JAX or numpy arrays and returns lookups as ``jax.Array``. A step is::

    acts = emb.lookup(ids)                                   # host exchange -> jax.Array
    loss, (g_params, g_acts) = dense_step(params, acts)      # the user's jitted step
    emb.apply_gradients(ids, g_acts)                         # host exchange + optimizer

Both calls run on the host, outside ``jax.jit``; for one jitted function see
:meth:`popdist_lite.jax.EmbeddingCollection.lookup_in_jit`.
"""

from __future__ import annotations

import jax

import popdist_lite as pl

from ._host import dedicated_comm, host_array, to_jax


class HostEmbedding:
    """A ``(t, e)`` host embedding table for JAX. Create it with :func:`create_host_embedding`.

    Every method that moves data is a collective, as :class:`popdist_lite.HostEmbedding`'s:
    every replica calls it in the same order (indices may differ in shape between replicas).

    Attributes:
        table: the :class:`popdist_lite.HostEmbedding` (numpy API, checkpoints, ``state()``),
            or, for a table of an :class:`~popdist_lite.jax.EmbeddingCollection`, the
            core collection's :class:`popdist_lite.ShardedTable` (the same methods).
    """

    def __init__(self, table: pl.HostEmbedding):
        self.table = table

    @property
    def name(self) -> str:
        return self.table.name

    @property
    def shape(self) -> tuple[int, int]:
        return self.table.shape

    @property
    def dtype(self):
        """The dtype lookups return (the table's lookup dtype as JAX uses it: float64
        tables give float32 unless ``jax_enable_x64`` is set)."""
        return jax.dtypes.canonicalize_dtype(self.table.dtype)

    @property
    def trainable(self) -> bool:
        spec = self.table.optimizer_spec
        return spec is not None and spec.trainable

    def lookup(self, indices, clip_indices: bool = False) -> jax.Array:
        """Rows of ``indices`` (integer, any shape; JAX or numpy): ``indices.shape + (e,)``,
        :attr:`dtype`. Collective. Errors as :meth:`popdist_lite.HostEmbedding.lookup`
        (raised on every replica), plus ``TypeError`` for traced indices (inside jit)."""
        return to_jax(self.table.lookup(host_array(indices, f"{self.name}.lookup: argument indices"), clip_indices))

    def apply_gradients(self, indices, grads, clip_indices: bool = False, *, loss_scale: float = 1.0) -> None:
        """Update the rows of ``indices`` with ``grads`` (``indices.shape + (e,)``, e.g. the
        gradient of the loss with respect to :meth:`lookup`'s output). Collective. Every
        replica's gradients for a row are summed and divided by ``loss_scale``, then the
        table's optimizer steps once per row (:meth:`popdist_lite.HostEmbedding.apply_gradients`)."""
        where = f"{self.name}.apply_gradients"
        self.table.apply_gradients(host_array(indices, f"{where}: argument indices"),
                                   host_array(grads, f"{where}: argument grads"), clip_indices, loss_scale=loss_scale)

    def lookup_bags(self, values, lengths=None, weights=None, combiner: str = "sum", padding_id=None,
                    clip_indices: bool = False) -> jax.Array:
        """Pooled lookup of bags (ragged ``values``/``lengths`` or padded ``values``,
        optional ``weights``, combiner ``"sum"``, ``"mean"`` or ``"sqrtn"``). Collective.
        Shapes, pooling and errors as :meth:`popdist_lite.HostEmbedding.lookup_bags`."""
        where = f"{self.name}.lookup_bags"
        rows = self.table.lookup_bags(host_array(values, f"{where}: argument values"), _optional(lengths, where),
                                      _optional(weights, where), combiner, padding_id, clip_indices)
        return to_jax(rows)

    def apply_bag_gradients(self, values, grads, lengths=None, weights=None, combiner: str = "sum",
                            padding_id=None, clip_indices: bool = False, *, loss_scale: float = 1.0) -> None:
        """The update for :meth:`lookup_bags` from the gradient of its output. Collective.
        As :meth:`popdist_lite.HostEmbedding.apply_bag_gradients`."""
        where = f"{self.name}.apply_bag_gradients"
        self.table.apply_bag_gradients(host_array(values, f"{where}: argument values"),
                                       host_array(grads, f"{where}: argument grads"), _optional(lengths, where),
                                       _optional(weights, where), combiner, padding_id, clip_indices,
                                       loss_scale=loss_scale)

    # -- checkpoints: the table's own Stateful protocol (popdist_lite.checkpoint) ----------
    def checkpoint_info(self) -> dict:
        """As :meth:`popdist_lite.HostEmbedding.checkpoint_info` (the manifest's type is
        ``HostEmbedding`` either way: a table saved from either API loads into the other)."""
        return self.table.checkpoint_info()

    def state_dict(self) -> dict:
        """The table's partition and optimizer state (:meth:`popdist_lite.HostEmbedding.state_dict`),
        resharded on load as the numpy API's tables. Local."""
        return self.table.state_dict()

    def validate_state_dict(self, state_dict: dict, saved) -> None:
        self.table.validate_state_dict(state_dict, saved)

    def load_state_dict(self, state_dict: dict) -> None:
        self.table.load_state_dict(state_dict)

    def get_embedding_tensor(self, master: bool = False) -> jax.Array:
        """The full ``(t, e)`` table on every replica. Collective (an all-gather)."""
        return to_jax(self.table.get_embedding_tensor(master))

    def __repr__(self) -> str:
        return f"popdist_lite.jax.HostEmbedding({self.table!r})"


def _optional(x, where: str):
    return None if x is None else host_array(x, where)


def create_host_embedding(name: str, shape, *args, comm=None, **kwargs) -> HostEmbedding:
    """Create a host embedding table for JAX. Collective.

    Takes :func:`popdist_lite.create_host_embedding`'s arguments (shape ``[t, e]``,
    dtype, partition strategy, optimizer spec, initializer, ID limits, ...) and raises
    its errors; the table lives on the binding's own duplicate of the replica
    communicator (``comm``: of that communicator instead).

    Returns:
        :class:`HostEmbedding`.
    """
    return HostEmbedding(pl.create_host_embedding(name, shape, *args, comm=dedicated_comm(comm), **kwargs))
