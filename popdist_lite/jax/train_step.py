"""One data-parallel training step with host embeddings, on the split API: the
lookup, the jitted dense step, the updates, in that order, with the next step's
lookup overlapped where the dependencies allow.

The order of one :meth:`TrainStep.__call__` and what runs at the same time (JAX
dispatch is asynchronous: a jitted function returns before it has computed)::

    host                                            XLA (asynchronously)
    lookup(features)  [or the prefetched result]
    dispatch grad_fn(params, acts, batch)  ------>  forward + backward
    next step's lookups of tables this step
      does not update (not trainable)               ... still computing
    all_reduce_gradients(g_params)  (waits for grad_fn)
    dispatch update_fn(params, opt_state, g)  --->  Optax update of the dense weights
    apply_gradients(features, g_acts)               ... still computing
    next step's lookups of the updated tables

When the overlap does not apply: a trainable table's next lookup always waits for
its update (rows of the next batch may be rows some replica updates in this step, and
no replica knows the others' IDs without another collective), so it overlaps only the
Optax update, not the forward and backward pass; without ``next_features`` the next
step starts with its own lookup (which still overlaps this step's Optax update, the
dispatch being asynchronous); a prefetched lookup is used only when the next call
passes the very same ``features`` (and ``weights``) objects, so the tables must not be
changed between the two calls other than by the step itself.
"""

from __future__ import annotations

import jax

from ._host import to_jax
from .collection import EmbeddingCollection
from .data_parallel import all_reduce_gradients, broadcast_parameters


class TrainStep:
    """A training step: host lookups, a jitted forward and backward pass, a
    cross-replica mean of the dense gradients, a jitted Optax update, the host
    embedding updates.

    Every replica computes the gradient of its own loss on its own batch; the step
    follows the gradient of the replicas' mean loss: the dense gradients are averaged
    (:func:`all_reduce_gradients`) and the tables divide the sum of every replica's
    gradients by the number of replicas (``loss_scale`` of
    :meth:`EmbeddingCollection.apply_gradients`).

    Args:
        embeddings: the :class:`EmbeddingCollection` of the features.
        loss_fn: ``loss_fn(params, activations, batch) -> loss`` (or ``(loss, aux)`` with
            ``has_aux``); ``activations`` maps feature names to arrays of their
            ``output_shape``. Traced once by ``jax.jit``.
        optimizer: an Optax ``GradientTransformation`` for the dense parameters.
        has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
        grad_transform: optional jittable ``(g_params, g_activations) -> (g_params,
            g_activations)`` applied to this replica's gradients before they are
            reduced (e.g. clipping by their joint global norm).

    Attributes:
        overlapped: the features whose lookup for the next step ran while the last
            dense step computed (module docstring).
    """

    def __init__(self, embeddings: EmbeddingCollection, loss_fn, optimizer, *, has_aux: bool = False,
                 grad_transform=None):
        import optax  # only when asked for

        self.embeddings, self.optimizer = embeddings, optimizer
        self.overlapped: tuple[str, ...] = ()
        self._prefetched = None
        value_and_grad = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=has_aux)

        def grads(params, acts, batch):
            out, (g_params, g_acts) = value_and_grad(params, acts, batch)
            if grad_transform is not None:
                g_params, g_acts = grad_transform(g_params, g_acts)
            return out, g_params, g_acts

        def update(params, opt_state, g_params):
            updates, opt_state = optimizer.update(g_params, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        self._grads, self._update = jax.jit(grads), jax.jit(update)

    def init(self, params):
        """``(params, opt_state)``: replica 0's ``params`` on every replica
        (:func:`broadcast_parameters`) and the optimizer's initial state. Collective."""
        params = broadcast_parameters(params, comm=self.embeddings.comm)
        # Placed as the update's outputs will be (committed to the parameters' device):
        # otherwise the second step would compile the update again for the new placement.
        leaves, state = jax.tree.leaves(params), self.optimizer.init(params)
        if leaves:
            state = jax.device_put(state, next(iter(leaves[0].devices())))
        return params, state

    def __call__(self, params, opt_state, features, batch, weights=None, *, next_features=None, next_weights=None):
        """One step. Collective.

        Args:
            params, opt_state: the dense parameters and the optimizer state.
            features, weights: this step's inputs of the embeddings (as
                :meth:`EmbeddingCollection.lookup`).
            batch: the rest of ``loss_fn``'s input (labels, dense features), any pytree.
            next_features, next_weights: the next step's inputs, when known: their
                lookups run in this call where the dependencies allow (module docstring)
                and the next call uses them if it gets these same objects. They are
                checked before anything is updated; a prefetch that fails later (an ID
                limit, say) is dropped, and the next call's own lookup raises the error.

        Returns:
            ``(params, opt_state, loss)`` (``(loss, aux)`` with ``has_aux``): the updated
            parameters and state and this replica's loss, as ``jax.Array`` s.

        Raises:
            As :meth:`EmbeddingCollection.lookup` for bad ``features`` or
            ``next_features`` (on every replica, before any update), and
            :func:`all_reduce_gradients`'s errors.
        """
        emb, r = self.embeddings, self.embeddings.comm.size
        inputs, acts = self._take_prefetched(features, weights)
        if inputs is None:  # checked once: the update reuses them
            inputs = emb._host_inputs("TrainStep: argument features", features, weights)
            acts = _to_jax(emb._lookup_host(inputs))
        out, g_params, g_acts = self._grads(params, acts, batch)  # returns before it has computed
        upcoming = None
        if next_features is not None:
            upcoming = emb._host_inputs("TrainStep: argument next_features", next_features, next_weights)
        frozen = {name for name, table in emb.tables.items() if not table.trainable}
        early = self._lookup(upcoming, frozen)
        self.overlapped = tuple(early or ())
        if r > 1:
            g_params = all_reduce_gradients(g_params, comm=emb.comm)
        params, opt_state = self._update(params, opt_state, g_params)
        # the gradients come from our own jitted function: their shapes are the specs'
        emb._update_host(inputs, g_acts, loss_scale=r)
        late = self._lookup(upcoming, set(emb.tables) - frozen)
        if early is not None and late is not None:
            self._prefetched = (next_features, next_weights, upcoming, {**early, **late})
        return params, opt_state, out

    def _lookup(self, inputs, tables: set) -> dict | None:
        """The activations of ``inputs`` (checked) in ``tables``; None when there are no
        inputs or the lookup failed (the next call's own lookup raises the error)."""
        if inputs is None:
            return None
        if not tables:
            return {}
        try:
            return _to_jax(self.embeddings._lookup_host(inputs, tables))
        except (ValueError, TypeError, IndexError, KeyError):  # raised on every replica alike
            return None

    def _take_prefetched(self, features, weights) -> tuple:
        """``(inputs, activations)`` prefetched for these very ``features`` and
        ``weights`` objects, else ``(None, None)``."""
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None and prefetched[0] is features and prefetched[1] is weights:
            return prefetched[2], prefetched[3]
        return None, None


def _to_jax(rows: dict) -> dict:
    return {name: to_jax(x) for name, x in rows.items()}
