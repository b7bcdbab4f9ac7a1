"""Dense data parallelism for JAX pytrees: the recipe of popdist_lite.data_parallel
(the IPU performance optimisation guide's section 4.3, Horovod's tensor fusion) on
``jax.Array`` leaves.

The fast path runs between two jitted functions::

    params = broadcast_parameters(params)              # once: every replica starts alike
    loss, grads = grad_fn(params, batch)               # jitted
    grads = all_reduce_gradients(grads)                # host: one fused all-reduce per dtype
    params, opt_state = update_fn(params, opt_state, grads)   # jitted (e.g. Optax)

For an Optax chain inside one jitted step, :func:`cross_replica_mean` is a
``GradientTransformation`` doing the same all-reduce (through an ordered host
callback when traced).

``allreduce_gradients`` and ``broadcast_params`` are aliases of
:func:`all_reduce_gradients` and :func:`broadcast_parameters` (the names of
``popdist_lite`` and ``popdist_lite.torch``), kept for existing code.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import io_callback

import popdist_lite as pl

from ._host import dedicated_comm, host_array, is_traced, to_jax


def all_reduce_gradients(grads, op: str = "mean", *, comm=None):
    """All-reduce a pytree of gradients over the replicas. Collective; on the host
    (outside ``jax.jit``).

    The leaves travel as one flat buffer per dtype (:func:`popdist_lite.all_reduce_gradients`:
    one ``pl.all_reduce`` of the concatenated leaves of each dtype; float16 stays float16).

    Args:
        grads: a pytree of float arrays (JAX or numpy); the same structure, shapes and
            dtypes on every replica.
        op: ``"mean"`` (default) or ``"sum"``.
        comm: parent communicator (default: the replica communicator).

    Returns:
        the pytree of reduced ``jax.Array`` s (dtypes as JAX uses them).

    Raises:
        ValueError, TypeError: on every replica, when the buffers differ between
            replicas or ``op`` is unknown (:func:`popdist_lite.all_reduce`).
        TypeError: a traced leaf (called inside jit: use :func:`cross_replica_mean`).
    """
    leaves, treedef = jax.tree.flatten(grads)
    reduced = _all_reduce_host([host_array(x, "all_reduce_gradients: argument grads") for x in leaves], op,
                              dedicated_comm(comm))
    return jax.tree.unflatten(treedef, [to_jax(x) for x in reduced])


def _all_reduce_host(leaves: list[np.ndarray], op: str, comm) -> list[np.ndarray]:
    keys = [f"{i:09d}" for i in range(len(leaves))]  # sorted as the leaves
    reduced = pl.all_reduce_gradients(dict(zip(keys, leaves)), op=op, comm=comm)
    return [reduced[k] for k in keys]


def broadcast_parameters(params, root: int = 0, *, comm=None):
    """Every replica's copy of the ``root`` replica's pytree ``params``. Collective; on
    the host (outside ``jax.jit``).

    Args:
        params: a pytree of arrays (JAX or numpy); the same structure, shapes and
            dtypes on every replica.
        root: source replica.
        comm: parent communicator (default: the replica communicator).

    Returns:
        a new pytree of ``jax.Array`` s (JAX arrays are immutable).

    Raises:
        ValueError, TypeError: on every replica, when shapes or dtypes differ or the
            root is out of range (:func:`popdist_lite.broadcast_parameters`).
    """
    leaves, treedef = jax.tree.flatten(params)
    keys = [f"{i:09d}" for i in range(len(leaves))]
    host = {k: np.array(host_array(x, "broadcast_parameters: argument params")) for k, x in zip(keys, leaves)}
    pl.broadcast_parameters(host, root=root, comm=dedicated_comm(comm))
    return jax.tree.unflatten(treedef, [to_jax(host[k]) for k in keys])


#: Alias of :func:`all_reduce_gradients` (the earlier spelling).
allreduce_gradients = all_reduce_gradients
#: Alias of :func:`broadcast_parameters` (the earlier spelling).
broadcast_params = broadcast_parameters


def cross_replica_mean(*, comm=None):
    """An Optax ``GradientTransformation`` replacing the updates by their mean over the
    replicas (no state), for chains such as
    ``optax.chain(cross_replica_mean(), optax.adam(1e-3))``.

    Called eagerly, it is :func:`all_reduce_gradients`. Traced (inside ``jax.jit``), it is
    one ``jax.experimental.io_callback(..., ordered=True)`` doing the same all-reduce on
    the host while the jitted function runs: correct, but every call of that function
    pays the callback and the fixed cost of an ordered effect (docs/jax.md), and
    ``jax.vmap`` of it is an error. The fast path keeps the all-reduce between two jitted
    functions (module docstring).
    """
    import optax  # only when asked for

    target = dedicated_comm(comm)  # made now, on every replica, not while one of them traces

    def init_fn(params):
        return optax.EmptyState()

    def update_fn(updates, state, params=None):
        del params
        if not is_traced(updates):
            return all_reduce_gradients(updates, comm=comm), state
        leaves, treedef = jax.tree.flatten(updates)
        shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]

        def host(*xs):
            return [np.asarray(r, s.dtype) for r, s in zip(_all_reduce_host([np.asarray(x) for x in xs], "mean", target),
                                                             shapes)]

        return jax.tree.unflatten(treedef, io_callback(host, shapes, *leaves, ordered=True)), state

    return optax.GradientTransformation(init_fn, update_fn)
