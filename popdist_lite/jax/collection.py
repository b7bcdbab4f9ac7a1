"""The host tables of a set of features, looked up and updated together: the split
API for several features (:meth:`EmbeddingCollection.lookup`,
:meth:`EmbeddingCollection.apply_gradients`) and the in-jit path
(:meth:`EmbeddingCollection.lookup_in_jit`).

The tables are the core's collection (:class:`popdist_lite.TableCollection`): one
exchange moves every table's IDs, rows and gradients per call (one agreement and one
all-to-all per kind of data, whatever the number of tables), and one optimizer step per
table and call whatever the number of features reading it. A TOKEN table is placed
row-wise, an ENCODING table column-wise. A table with a pooled feature is a bag
table (``EmbeddingBagConfig`` with the table's combiner): a feature of it that is not
pooled is a bag of one ID per position with weight 1, which every combiner returns
unchanged.

Shapes are static: a feature's activation always has its ``FeatureSpec.output_shape``
(the batch and the spec fix it; bags are padded to ``input_shape[-1]`` IDs with
``-1``), so a jitted step that takes them never recompiles for new IDs.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

import popdist_lite as pl

from ._host import agree_inputs, dedicated_comm, host_array, problem_of, to_jax
from .checkpoint import checkpoint_name
from .embedding import HostEmbedding
from .specs import PADDING_ID, FeatureSpec, TableSpec


class EmbeddingCollection:
    """The host tables of ``feature_specs``, created on the binding's communicator. Collective.

    Args:
        feature_specs: :class:`FeatureSpec` s (a sequence, or a mapping whose values are
            used); the same on every replica. Tables are the distinct ``table_spec`` s
            (by name).
        comm: parent communicator (default: the replica communicator).

    Attributes:
        feature_specs: the specs, in the order features are processed.
        tables: table name -> :class:`popdist_lite.jax.HostEmbedding` (its ``table`` the
            core collection's :class:`popdist_lite.ShardedTable`).
        core: the :class:`popdist_lite.TableCollection` holding the tables (one
            exchange for all of them per call).

    Inputs of one step (per replica): ``features`` maps each feature name to its IDs,
    an integer array of ``input_shape`` (JAX or numpy; ``-1`` pads bags) or, for a
    pooled feature with ``input_shape`` ``(B, L)``, a sequence of ``B`` 1-D arrays of at
    most ``L`` IDs each (ragged, as jax-tpu-embedding takes them); ``weights``
    (optional) maps pooled features to float weights of the same structure.

    Raises:
        ValueError: on every replica, for any replica's duplicate feature names or two
            different tables of one name, or specs that differ between replicas; table
            errors as :func:`popdist_lite.create_host_embedding`.
        TypeError: on every replica, for an element that is not a :class:`FeatureSpec`.
    """

    def __init__(self, feature_specs, *, comm=None):
        from popdist_lite.collectives import agree_objects  # imports MPI: not at import time

        self.comm = dedicated_comm(comm)
        problem, specs, tables = None, (), {}
        try:
            specs, tables = _tables_of(feature_specs)
        except Exception as exc:  # raised below on every replica, not here alone
            problem = problem_of(exc)
        _same_everywhere(agree_objects("EmbeddingCollection", _signature(specs), self.comm, problem=problem))
        self.feature_specs = specs
        names = sorted(tables)
        #: (table name, its features' indices in feature_specs), in table-name order.
        self._groups = [(name, [i for i, s in enumerate(specs) if s.table_spec.name == name]) for name in names]
        configs = [_config(tables[name], [specs[i] for i in members]) for name, members in self._groups]
        plan = {name: "row_wise" if tables[name].partition_strategy == "TOKEN" else "column_wise" for name in names}
        #: The core collection of the tables (popdist_lite.TableCollection).
        self.core = pl.TableCollection(configs, plan=plan, comm=self.comm)
        self.tables = {name: HostEmbedding(self.core.tables[name]) for name in names}
        self._in_jit = _in_jit_lookup(self)

    # -- the split API --------------------------------------------------------------
    def lookup(self, features: Mapping, weights: Mapping | None = None) -> dict[str, jax.Array]:
        """Every feature's activation: name -> ``jax.Array`` of its ``output_shape``, in
        the table's lookup dtype (as JAX uses it). Collective (one exchange for every table).

        Raises:
            KeyError, ValueError, TypeError: on every replica, for any replica's
                missing or unknown feature, IDs of the wrong shape or dtype, a ragged
                bag longer than ``input_shape[-1]``, or weights on a feature that is not
                pooled; the message names the replica and the feature.
            IndexError, popdist_lite.IdLimitError: as the tables' lookups.
        """
        inputs = self._host_inputs("EmbeddingCollection.lookup", features, weights)
        return {name: to_jax(rows) for name, rows in self._lookup_host(inputs).items()}

    def apply_gradients(self, features: Mapping, grads: Mapping, weights: Mapping | None = None, *,
                        loss_scale: float = 1.0) -> None:
        """Update every trainable table from the gradients of the activations
        (``grads``: name -> array of the feature's ``output_shape``) of the same
        ``features`` and ``weights``. Collective. Per table, every replica's gradients of
        a row are summed over features and replicas and divided by ``loss_scale`` (pass
        the number of replicas to follow the gradient of the replicas' mean loss), then
        the optimizer steps once (:meth:`popdist_lite.HostEmbedding.apply_gradients`).

        Raises:
            As :meth:`lookup`, plus ``ValueError``/``TypeError`` for a missing gradient
            or one of the wrong shape or dtype; nothing is updated.
        """
        inputs = self._host_inputs("EmbeddingCollection.apply_gradients", features, weights, grads)
        self._update_host(inputs, grads, loss_scale)

    def prepare(self, features: Mapping, weights: Mapping | None = None) -> tuple[dict, dict]:
        """The inputs of :meth:`lookup_in_jit` as JAX arrays of static shapes:
        ``(ids, weights)``, name -> IDs of ``input_shape`` (ragged bags padded with
        ``-1``) and name -> weights (pooled features given weights only). Collective
        (the check of every replica's inputs); raises as :meth:`lookup`."""
        inputs = self._host_inputs("EmbeddingCollection.prepare", features, weights)
        return ({s.name: to_jax(ids) for s, (ids, _) in zip(self.feature_specs, inputs)},
                {s.name: to_jax(w) for s, (_, w) in zip(self.feature_specs, inputs) if w is not None})

    # -- the in-jit path --------------------------------------------------------------
    @staticmethod
    def handle(dtype=jnp.float32) -> jax.Array:
        """The in-jit path's stand-in for the host tables: a zero scalar to keep among the
        differentiated parameters. Its gradient is always zero; computing it is what runs
        the tables' update (the backward pass of :meth:`lookup_in_jit`)."""
        return jnp.zeros((), dtype)

    def lookup_in_jit(self, handle, features: Mapping, weights: Mapping | None = None, *,
                      loss_scale: float = 1.0) -> dict[str, jax.Array]:
        """Every feature's activation, from inside ``jax.jit`` (traceable).

        A ``jax.custom_vjp``: the forward pass is one ``jax.pure_callback`` looking up
        every feature (:meth:`lookup`); the backward pass, when ``handle`` is
        differentiated, is one ``jax.experimental.io_callback(..., ordered=True)``
        applying every table's update (:meth:`apply_gradients` with ``loss_scale``) and
        returning a zero gradient for ``handle``. The callbacks run on the host while the
        jitted function executes; their collectives use the binding's communicator, in
        program order (the same on every replica: the same compiled program).

        Args:
            handle: :meth:`handle`, kept in the parameters the loss is differentiated by.
            features, weights: JAX (or numpy) arrays of static shapes: use
                :meth:`prepare` for ragged bags. Checked on the host when the function
                runs (errors raised on every replica, inside a ``JaxRuntimeError``).
            loss_scale: static; divides the summed gradients as in :meth:`apply_gradients`.

        Limits: slower than the split API (two host callbacks per call, and any ordered
        effect adds a fixed cost to each call of the jitted function; docs/jax.md);
        ``jax.vmap`` of it is an error; under ``jax.checkpoint`` (remat) the backward
        pass computes the forward callback again (with ``jax.value_and_grad`` the lookup,
        a collective, runs twice; the update once); the backward pass runs only
        where ``handle`` is differentiated; one call per collection per jitted function
        (two calls could update a table before the other looks it up).
        """
        ids = {s.name: jnp.asarray(features[s.name]) for s in self.feature_specs}
        ws = {s.name: jnp.asarray(weights[s.name]) for s in self.feature_specs if weights and s.name in weights}
        return self._in_jit(float(loss_scale), handle, ids, ws)

    # -- checkpoints (the Stateful protocol of popdist_lite.checkpoint) -------------------
    def checkpoint_info(self) -> dict:
        """The manifest's entry: the table names."""
        return {"tables": sorted(self.tables)}

    def state_dict(self) -> dict:
        """Every table (a :class:`popdist_lite.HostEmbedding`, saved and resharded as the
        numpy API's), under its name as a checkpoint name component
        (:func:`~popdist_lite.jax.checkpoint.checkpoint_name`). Local."""
        return {checkpoint_name(name): table.table for name, table in self.tables.items()}

    def validate_state_dict(self, state_dict: dict, saved) -> None:
        """Refuse a checkpoint of a collection with other tables.

        Raises:
            ValueError: naming the collection and both lists of tables.
        """
        theirs = saved.info.get("tables")
        if theirs != sorted(self.tables):
            raise ValueError(f"collection {saved.name!r}: the checkpoint holds the tables {str(theirs)[:200]}, this "
                             f"collection has {sorted(self.tables)}")

    def load_state_dict(self, state_dict: dict) -> None:
        """Nothing left to do: the tables loaded themselves."""

    # -- host side ----------------------------------------------------------------------
    def _host_inputs(self, op: str, features: Mapping, weights: Mapping | None, grads: Mapping | None = None):
        """Every feature's ``(ids, weights or None)`` as numpy arrays of ``input_shape``
        (ragged bags padded), after every replica's inputs were checked. Collective."""
        problem, inputs = None, []
        try:
            inputs = self._convert(features, weights)
            for extra, what in ((features, "features"), (weights or {}, "weights"), (grads or {}, "grads")):
                unknown = sorted(set(extra) - {s.name for s in self.feature_specs})
                if unknown:
                    raise KeyError(f"argument {what}: unknown features {unknown}")
            if grads is not None:
                for s in self.feature_specs:
                    _check_gradient(s, grads)
        except Exception as exc:  # raised below on every replica, not here alone
            problem = problem_of(exc)
        agree_inputs(op, problem, self.comm)
        return inputs

    def _convert(self, features: Mapping, weights: Mapping | None) -> list:
        """Every feature's ``(ids, weights or None)``, checked on this replica only."""
        return [_feature_input(s, features, weights) for s in self.feature_specs]

    def _batches(self, inputs, tables=None) -> dict:
        """The core's input of every feature: ``name -> (values, lengths, weights)``
        (bags of the padded IDs without their padding; one ID per bag for a feature
        that is not pooled); the features of tables outside ``tables`` pass nothing."""
        out = {}
        for spec, (ids, w) in zip(self.feature_specs, inputs):
            if tables is not None and spec.table_spec.name not in tables:
                out[spec.name] = (np.zeros(0, np.int64), np.zeros(0, np.int64))
            elif spec.pooled:
                bags = ids.reshape(-1, spec.input_shape[-1])
                real = bags != PADDING_ID
                out[spec.name] = (bags[real], real.sum(axis=1),
                                  None if w is None else np.asarray(w, np.float64).reshape(bags.shape)[real])
            else:
                flat = ids.reshape(-1)
                out[spec.name] = (flat, np.ones(flat.size, np.int64))
        return out

    def _lookup_host(self, inputs, tables=None) -> dict[str, np.ndarray]:
        """name -> numpy activation of every feature of ``tables`` (default: all). Collective
        (one exchange for every table)."""
        rows = self.core.lookup(self._batches(inputs, tables))
        return {spec.name: rows[spec.name].reshape(spec.output_shape) for spec in self.feature_specs
                if tables is None or spec.table_spec.name in tables}

    def _update_host(self, inputs, grads: Mapping, loss_scale: float) -> None:
        """Apply ``grads`` (name -> activation gradient) to every trainable table. Collective
        (one exchange for every table)."""
        given = {}
        for spec in self.feature_specs:
            e = spec.table_spec.embedding_dim
            given[spec.name] = host_array(grads[spec.name], "grads").reshape(-1, e)
        self.core.apply_gradients(self._batches(inputs), given, loss_scale=loss_scale)

    def __repr__(self) -> str:
        return (f"EmbeddingCollection(features={[s.name for s in self.feature_specs]}, "
                f"tables={list(self.tables)})")


def _config(table: TableSpec, features: list) -> pl.EmbeddingConfig:
    """The core's config of a JAX table and its features: a bag table with the table's
    combiner when a feature pools, else a sequence table."""
    args = dict(num_embeddings=table.vocabulary_size, embedding_dim=table.embedding_dim, name=table.name,
                data_type=table.dtype, feature_names=[f.name for f in features], optimizer=table.optimizer,
                initializer=table.initializer, seed=table.seed, max_ids_per_partition=table.max_ids_per_partition,
                max_unique_ids_per_partition=table.max_unique_ids_per_partition,
                allow_id_dropping=table.allow_id_dropping, enable_minibatching=table.enable_minibatching,
                storage=table.storage)
    if any(f.pooled for f in features):
        return pl.EmbeddingBagConfig(**args, pooling=table.combiner)
    return pl.EmbeddingConfig(**args)


def _tables_of(feature_specs) -> tuple[tuple, dict]:
    """``(feature specs, table name -> TableSpec)``, checked (local)."""
    specs = tuple(feature_specs.values() if isinstance(feature_specs, Mapping) else feature_specs)
    tables = {}
    for spec in specs:
        if not isinstance(spec, FeatureSpec):
            raise TypeError(f"argument feature_specs: expected FeatureSpecs, got {type(spec).__name__}")
        table = tables.setdefault(spec.table_spec.name, spec.table_spec)
        if table != spec.table_spec or table.initializer is not spec.table_spec.initializer:
            raise ValueError(f"argument feature_specs: two different TableSpecs are named {table.name!r}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"argument feature_specs: duplicate feature names in {names}")
    return specs, tables


def _signature(specs) -> list:
    """What every replica's feature specs must agree on: each feature's name, table,
    input and output shapes (the tables' own arguments are agreed by
    :func:`popdist_lite.create_host_embedding`)."""
    return [(s.name, s.table_spec.name, list(s.input_shape), list(s.output_shape)) for s in specs]


def _same_everywhere(signatures: list) -> None:
    """Raise on every replica (each checks the same gathered list) when a replica's
    feature specs differ from replica 0's, naming the replica and the first difference."""
    first = signatures[0]
    for replica, mine in enumerate(signatures):
        if mine != first:
            i = next((i for i, (a, b) in enumerate(zip(mine, first)) if a != b), min(len(mine), len(first)))
            got = f"feature {mine[i]}" if i < len(mine) else "no more features"
            want = f"feature {first[i]}" if i < len(first) else "no more features"
            raise ValueError(f"EmbeddingCollection: replica {replica} has other feature specs than replica 0: at "
                             f"position {i} (name, table, input_shape, output_shape) it has {got}, replica 0 has "
                             f"{want}; every replica must pass the same")


def _feature_input(spec: FeatureSpec, features: Mapping, weights: Mapping | None):
    """This replica's ``(ids, weights or None)`` of one feature, checked (local)."""
    if spec.name not in features:
        raise KeyError(f"argument features: no IDs for feature {spec.name!r}")
    value = features[spec.name]
    w = None if weights is None else weights.get(spec.name)
    where = f"feature {spec.name!r}"
    if w is not None and not spec.pooled:
        raise ValueError(f"{where}: weights apply to pooled features (bags) only; this one has output_shape "
                         f"{list(spec.output_shape)} = input_shape + (e,)")
    if _is_ragged(value):
        if not spec.pooled or len(spec.input_shape) != 2:
            raise ValueError(f"{where}: ragged IDs (a sequence of arrays) need a pooled feature with input_shape "
                             f"(B, L), got input_shape {list(spec.input_shape)}")
        ids = _pad_ragged(spec, value, "IDs")
        if w is None:
            return ids, None
        if not _is_ragged(w) or [np.size(x) for x in w] != [np.size(x) for x in value]:
            raise ValueError(f"{where}: expected ragged weights with as many values per sample as the IDs")
        return ids, _pad_ragged(spec, w, "weights")
    ids = host_array(value, where)
    if ids.shape != spec.input_shape or ids.dtype.kind not in "iu":
        raise (TypeError if ids.shape == spec.input_shape else ValueError)(
            f"{where}: expected integer IDs of shape {list(spec.input_shape)} (the FeatureSpec's input_shape), got "
            f"{ids.dtype}{list(ids.shape)}")
    if w is not None:
        w = host_array(w, where)
        if w.shape != ids.shape or w.dtype.kind not in "fiu":
            raise (TypeError if w.shape == ids.shape else ValueError)(
                f"{where}: expected real weights of the IDs' shape {list(ids.shape)}, got {w.dtype}{list(w.shape)}")
    return ids, w


def _is_ragged(value) -> bool:
    return isinstance(value, (list, tuple)) or isinstance(value, np.ndarray) and value.dtype == object


def _pad_ragged(spec: FeatureSpec, samples, what: str) -> np.ndarray:
    """``B`` 1-D arrays of at most ``L`` values as a ``(B, L)`` array padded with -1 (IDs)
    or 0 (weights)."""
    batch, width = spec.input_shape
    rows = [np.asarray(s) for s in samples]
    if len(rows) != batch or any(r.ndim != 1 for r in rows):
        raise ValueError(f"feature {spec.name!r}: expected ragged {what} as {batch} 1-D arrays (input_shape "
                         f"{list(spec.input_shape)}), got {len(rows)} arrays of {sorted({r.ndim for r in rows})} "
                         f"dimensions")
    lengths = np.array([r.size for r in rows], np.int64)
    if lengths.max(initial=0) > width:
        b = int(np.argmax(lengths))
        raise ValueError(f"feature {spec.name!r}: sample {b} has {int(lengths[b])} {what}, more than input_shape[-1] "
                         f"= {width}")
    flat = np.concatenate(rows) if rows else np.zeros(0)
    kind = "iu" if what == "IDs" else "fiu"
    if flat.size and flat.dtype.kind not in kind:
        raise TypeError(f"feature {spec.name!r}: expected {'integer' if what == 'IDs' else 'real'} {what}, got "
                        f"{flat.dtype}")
    out = np.full((batch, width), PADDING_ID, np.int64) if what == "IDs" else np.zeros((batch, width), np.float64)
    starts = np.cumsum(lengths) - lengths
    out[np.repeat(np.arange(batch), lengths), np.arange(flat.size) - np.repeat(starts, lengths)] = flat
    return out


def _check_gradient(spec: FeatureSpec, grads: Mapping) -> None:
    if spec.name not in grads:
        raise KeyError(f"argument grads: no gradient for feature {spec.name!r}")
    g = grads[spec.name]
    shape, dtype = tuple(np.shape(g)), np.dtype(g.dtype) if hasattr(g, "dtype") else np.asarray(g).dtype
    if shape != spec.output_shape or dtype.kind != "f":
        raise (TypeError if shape == spec.output_shape else ValueError)(
            f"feature {spec.name!r}: expected a floating gradient of the output_shape {list(spec.output_shape)}, got "
            f"{dtype}{list(shape)}")


def _in_jit_lookup(collection: EmbeddingCollection):
    """``f(loss_scale, handle, ids, weights) -> activations``, the custom_vjp of
    :meth:`EmbeddingCollection.lookup_in_jit`."""
    specs = collection.feature_specs
    out_shapes = {s.name: jax.ShapeDtypeStruct(s.output_shape, collection.tables[s.table_spec.name].dtype)
                  for s in specs}
    done = jax.ShapeDtypeStruct((), jnp.float32)

    def host_forward(ids, weights):
        inputs = collection._host_inputs("EmbeddingCollection.lookup_in_jit", ids, weights)
        rows = collection._lookup_host(inputs)
        return {name: np.asarray(rows[name], out_shapes[name].dtype) for name in out_shapes}, np.zeros((), np.float32)

    def host_backward(loss_scale, ids, weights, grads, _done):
        # the forward pass checked these very arrays on every replica
        collection._update_host(collection._convert(ids, weights), grads, loss_scale)
        return np.zeros((), np.float32)

    def forward(ids, weights):
        return jax.pure_callback(host_forward, (out_shapes, done), ids, weights)

    def lookup(loss_scale, handle, ids, weights):
        return forward(ids, weights)[0]

    def lookup_fwd(loss_scale, handle, ids, weights):
        acts, token = forward(ids, weights)
        return acts, (handle, ids, weights, token)

    def lookup_bwd(loss_scale, residuals, g_acts):
        handle, ids, weights, token = residuals
        # `token` (an output of the forward callback) orders this update after the lookup.
        zero = io_callback(lambda *a: host_backward(loss_scale, *a), done, ids, weights, g_acts, token, ordered=True)
        return jnp.broadcast_to(zero.astype(handle.dtype), handle.shape), None, None

    f = jax.custom_vjp(lookup, nondiff_argnums=(0,))
    f.defvjp(lookup_fwd, lookup_bwd)
    return f
