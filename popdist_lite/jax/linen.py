"""A Flax (linen) embedding layer over host tables, named as jax-tpu-embedding's
``SparseCoreEmbed`` (``jax_tpu_embedding.sparsecore.lib.flax.linen.embed``).

SparseCore keeps its tables among the model's variables and its ``custom_vjp``
returns updated tables in place of gradients. Here the tables are host tables
partitioned over the replicas (an :class:`EmbeddingCollection`), so they are not Flax
variables: the module carries the collection, and a step is, on the split API::

    embed = SparseCoreEmbed(embeddings=collection)
    inputs = embed.preprocess_inputs(features, weights)       # host lookup (outside jit)
    # in the model: activations = SparseCoreEmbed(embeddings=collection)(inputs)
    loss, (g_params, g_inputs) = jitted_value_and_grad(params, inputs, labels)  # argnums=(0, 1)
    embed.apply_gradient(g_inputs, inputs)                     # host update (outside jit)

or, with ``in_jit=True``, ``preprocess_inputs`` only pads and checks the IDs, the
lookup runs inside the jitted function and the update in its backward pass (the
module then owns one parameter, the zero ``handle``, which must be differentiated);
see :meth:`EmbeddingCollection.lookup_in_jit` for that path's costs and limits.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
from flax import linen as nn

from .collection import EmbeddingCollection

#: The parameter of an in-jit SparseCoreEmbed: the handle its update is attached to.
HANDLE_PARAM_NAME = "host_embedding_handle"


@jax.tree_util.register_pytree_node_class
class EmbeddingLookupInput:
    """What :meth:`SparseCoreEmbed.preprocess_inputs` returns and the model takes (a
    pytree; its leaves are the activations (split API) or the padded IDs and weights
    (in-jit)). The host inputs the update needs stay on the object returned by
    ``preprocess_inputs`` and are not part of the pytree, so a jitted function sees
    only static shapes.

    Attributes:
        activations: feature name -> ``jax.Array`` (split API), else None.
        ids, weights: feature name -> padded IDs and weights (in-jit), else None.
    """

    def __init__(self, activations=None, ids=None, weights=None, *, features=None, features_weights=None):
        self.activations, self.ids, self.weights = activations, ids, weights
        self.features, self.features_weights = features, features_weights

    def tree_flatten(self):
        return (self.activations, self.ids, self.weights), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


class SparseCoreEmbed(nn.Module):
    """The activations of the features of ``embeddings`` inside a Flax model.

    Attributes:
        embeddings: the :class:`EmbeddingCollection` (its ``feature_specs`` give the
            features, tables, combiners and ID limits).
        in_jit: look up inside the jitted function (:meth:`EmbeddingCollection.lookup_in_jit`)
            instead of on the host before it (the split API, faster).
        loss_scale: the updates divide the sum of every replica's gradients by it (the
            number of replicas follows the gradient of the replicas' mean loss).
    """

    embeddings: EmbeddingCollection
    in_jit: bool = False
    loss_scale: float = 1.0

    @property
    def feature_specs(self):
        return self.embeddings.feature_specs

    def preprocess_inputs(self, features: Mapping, features_weights: Mapping | None = None) -> EmbeddingLookupInput:
        """This step's inputs for the model: the host lookup of every feature (split
        API), or the checked and padded IDs (in-jit). Collective; outside ``jax.jit``
        and ``Module.apply``. Inputs and errors as :meth:`EmbeddingCollection.lookup`."""
        if self.in_jit:
            ids, weights = self.embeddings.prepare(features, features_weights)
            return EmbeddingLookupInput(ids=ids, weights=weights)
        return EmbeddingLookupInput(activations=self.embeddings.lookup(features, features_weights),
                                    features=features, features_weights=features_weights)

    @nn.compact
    def __call__(self, embedding_lookup_inputs: EmbeddingLookupInput) -> dict[str, jax.Array]:
        """Feature name -> activation of its ``output_shape``."""
        if not self.in_jit:
            return dict(embedding_lookup_inputs.activations)
        handle = self.param(HANDLE_PARAM_NAME, lambda key: EmbeddingCollection.handle())
        return self.embeddings.lookup_in_jit(handle, embedding_lookup_inputs.ids, embedding_lookup_inputs.weights,
                                             loss_scale=self.loss_scale)

    def apply_gradient(self, gradients, embedding_lookup_inputs: EmbeddingLookupInput) -> None:
        """Update the tables (split API) from ``gradients``, the gradient with respect to
        the :class:`EmbeddingLookupInput` (or a dict of activation gradients), for the
        inputs ``preprocess_inputs`` returned. Collective; outside ``jax.jit``.

        Raises:
            RuntimeError: with ``in_jit`` (the backward pass already updated the tables).
            As :meth:`EmbeddingCollection.apply_gradients` otherwise.
        """
        if self.in_jit:
            raise RuntimeError("SparseCoreEmbed(in_jit=True): the tables were updated in the backward pass; "
                               "apply_gradient is for the split API")
        grads = gradients.activations if isinstance(gradients, EmbeddingLookupInput) else gradients
        self.embeddings.apply_gradients(embedding_lookup_inputs.features, grads,
                                        embedding_lookup_inputs.features_weights, loss_scale=self.loss_scale)
