"""What a checkpoint holds of each kind of state, and how it is put back.

``state`` is a dict (nested dicts allowed) whose leaves are:

===============================  ===========================================================
leaf                             saved as
===============================  ===========================================================
:class:`HostEmbedding`           its :meth:`~HostEmbedding.state`: master weights and every
                                 optimizer slot, partitioned as the table (``table``/``row``
                                 layouts) or replicated; stochastic-rounding generator states
:class:`CrossReplicaOptimizer`   the wrapped optimizer's slots (replicated, or the flat
                                 ``block`` partition of ``shard_optimizer_state=True``), its
                                 step counter and stochastic-rounding generator states
:class:`DenseOptimizer`          its slots (replicated) and step counter
:class:`LossScaler`              scale, counters
:class:`Infeed`                  the feed position (batches taken, replica and feeder counts)
``np.random.Generator``          its bit generator's state, per replica
``np.ndarray``                   one replicated array (dense parameters): replica 0 writes it
JSON value (int, float, str,     the value (replica 0's); loading replaces it in its dict
bool, None, list)
===============================  ===========================================================

Names are the keys joined with ``/`` (``"model/params/w"``). :func:`describe` turns a
state into :class:`Entry` arrays and JSON values for the writer; :func:`bind` matches a
state against a manifest and returns the arrays to fill plus the steps that finish the
load once every array is in place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..data_parallel import CrossReplicaOptimizer
from ..embedding.host_embedding import HostEmbedding
from ..infeed.stream import Infeed
from ..loss_scaling import LossScaler
from ..dense_optimizers import DenseOptimizer
from .partition import Partition


@dataclass
class Entry:
    """One array: ``name``, global ``shape`` and ``dtype``, its ``partition`` over the
    replicas, and this replica's ``local`` part (padded as the owner keeps it)."""

    name: str
    shape: tuple
    dtype: np.dtype
    partition: Partition
    local: np.ndarray
    meta: dict = field(default_factory=dict)


@dataclass
class Description:
    """A state as the writer sees it."""

    entries: list[Entry] = field(default_factory=list)
    values: dict = field(default_factory=dict)          # replica-identical JSON values
    replica_values: dict = field(default_factory=dict)  # this replica's JSON values
    objects: dict = field(default_factory=dict)         # name -> {"type": ..., ...}


@dataclass
class Binding:
    """A state matched against a manifest: arrays to fill, then ``finish`` in order."""

    targets: list[Entry] = field(default_factory=list)
    finish: list[Callable[[], None]] = field(default_factory=list)


def _json(value) -> bool:
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        return False
    return True


def _leaves(state: dict, prefix: str = "", json_names=()):
    """``(name, parent dict, key, value)`` for every leaf, in a fixed order; a dict
    named in ``json_names`` (saved as one JSON value) is a leaf."""
    if not isinstance(state, dict):
        raise TypeError(f"argument state: expected a dict of name -> state, got {type(state).__name__}")
    for key in sorted(state, key=str):
        if not isinstance(key, str) or not key or "/" in key:
            raise TypeError(f"argument state: keys must be non-empty str without '/', got {key!r} in "
                            f"{prefix or 'state'!r}")
        value, name = state[key], f"{prefix}{key}"
        if isinstance(value, dict) and not _plain_json_dict(value) and name not in json_names:
            yield from _leaves(value, name + "/", json_names)
        else:
            yield name, state, key, value


def _plain_json_dict(value: dict) -> bool:
    """A dict whose values are all JSON scalars/lists (kept as one JSON value), not state."""
    return bool(value) and all(not isinstance(v, (dict, np.ndarray)) and _json(v) for v in value.values())


# --------------------------------------------------------------------------------------
# saving
# --------------------------------------------------------------------------------------
def describe(state: dict, replicas: int, replica: int) -> Description:
    """The arrays and values of ``state`` for a save.

    Raises:
        TypeError: a leaf of an unsupported type (names the key and the type).
    """
    out = Description()
    for name, _, _, value in _leaves(state):
        if isinstance(value, HostEmbedding):
            _describe_table(out, name, value)
        elif isinstance(value, CrossReplicaOptimizer):
            _describe_cross_replica(out, name, value)
        elif isinstance(value, DenseOptimizer):
            out.objects[name] = {"type": type(value).__name__}
            _describe_dense(out, name, value)
        elif isinstance(value, LossScaler):
            out.objects[name] = {"type": type(value).__name__}
            out.values[name] = _scaler_fields(value)
        elif isinstance(value, Infeed):
            from .. import topology
            out.objects[name] = {"type": "Infeed"}
            out.values[name] = {"steps": value.steps, "replicas": replicas,
                                "feeders": topology.feeders_per_replica()}
        elif isinstance(value, np.random.Generator):
            out.objects[name] = {"type": "Generator"}
            out.replica_values[name] = value.bit_generator.state
        elif isinstance(value, np.ndarray):
            if value.dtype.hasobject or value.dtype.fields is not None:
                raise TypeError(f"state {name!r}: arrays of dtype {value.dtype} cannot be saved (plain "
                                f"numeric/bool arrays only: no pickles)")
            out.objects[name] = {"type": "ndarray"}
            out.entries.append(Entry(name, value.shape, value.dtype, Partition("replicated"), value))
        elif isinstance(value, (np.integer, np.floating, np.bool_)):
            out.values[name] = value.item()
        elif _json(value):
            out.values[name] = value
        else:
            raise TypeError(f"state {name!r}: cannot save a {type(value).__name__} (expected a HostEmbedding, "
                            f"CrossReplicaOptimizer, DenseOptimizer, LossScaler, Infeed, np.random.Generator, "
                            f"numpy array, dict, or a JSON value)")
    return out


def _table_partition(layout: str, strategy: str, shape: tuple) -> tuple[Partition, tuple]:
    """Partition and global shape of a table array of ``layout`` (TableState contract)."""
    t, e = shape
    if layout == "table":
        return (Partition("cyclic", 0) if strategy == "TOKEN" else Partition("block", 1)), (t, e)
    if layout == "row":
        return (Partition("cyclic", 0) if strategy == "TOKEN" else Partition("replicated")), (t,)
    if layout == "replicated":
        return Partition("replicated"), None
    raise ValueError(f"unknown table array layout {layout!r}")


def _describe_table(out: Description, name: str, table: HostEmbedding) -> None:
    ts = table.state()
    out.objects[name] = {"type": "HostEmbedding", "shape": list(ts.shape), "dtype": str(np.dtype(ts.dtype)),
                         "master_dtype": str(np.dtype(ts.master_dtype)),
                         "partition_strategy": ts.partition_strategy, "arrays": sorted(ts.arrays)}
    for key in sorted(ts.arrays):
        local, layout = ts.arrays[key], ts.layouts[key]
        partition, shape = _table_partition(layout, ts.partition_strategy, ts.shape)
        out.entries.append(Entry(f"{name}/{key}", shape if shape is not None else local.shape, local.dtype,
                                 partition, local, {"strategy": ts.partition_strategy, "layout": layout}))
    for kind, state in sorted(ts.generators.items()):
        if kind == "per_replica":
            out.replica_values[f"{name}/generators/{kind}"] = state
        else:
            out.values[f"{name}/generators/{kind}"] = state


def _describe_dense(out: Description, name: str, optimizer: DenseOptimizer) -> None:
    for param in sorted(optimizer.state):
        for slot, array in sorted(optimizer.state[param].items()):
            out.entries.append(Entry(f"{name}/state/{param}/{slot}", array.shape, array.dtype,
                                     Partition("replicated"), array))
    if hasattr(optimizer, "steps"):
        out.values[f"{name}/steps"] = int(optimizer.steps)


def _describe_cross_replica(out: Description, name: str, opt: CrossReplicaOptimizer) -> None:
    inner = opt.optimizer
    if not isinstance(inner, DenseOptimizer):
        raise TypeError(f"state {name!r}: the CrossReplicaOptimizer wraps a {type(inner).__name__}; only "
                        f"popdist_lite DenseOptimizers (SGD, MomentumSGD, Adam) can be saved")
    out.objects[name] = {"type": "CrossReplicaOptimizer", "optimizer": type(inner).__name__,
                         "shard_optimizer_state": opt.shard_optimizer_state}
    if opt.shard_optimizer_state:
        totals = opt.shard_sizes
        for key in sorted(inner.state):
            for slot, array in sorted(inner.state[key].items()):
                out.entries.append(Entry(f"{name}/state/{key}/{slot}", (totals[key],), array.dtype,
                                         Partition("block", 0), array))
        if hasattr(inner, "steps"):
            out.values[f"{name}/steps"] = int(inner.steps)
    else:
        _describe_dense(out, name, inner)
    states = opt.stochastic_rounding.generator_states()
    out.values[f"{name}/generators/replica_identical"] = states["replica_identical"]
    out.replica_values[f"{name}/generators/per_replica"] = states["per_replica"]


def _scaler_fields(scaler: LossScaler) -> dict:
    fields = {"scale": scaler.scale, "skipped_steps": scaler.skipped_steps,
              "last_overflow_replica": scaler.last_overflow_replica}
    if hasattr(scaler, "clean_steps"):
        fields["clean_steps"] = scaler.clean_steps
    return fields


# --------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------
class _Manifest:
    """Lookups in a manifest for :func:`bind`, with errors naming the checkpoint."""

    def __init__(self, manifest: dict, path, replicas: int, replica: int):
        self.data, self.path, self.replicas, self.replica = manifest, path, replicas, replica
        self.writers = int(manifest["num_replicas"])

    def object(self, name: str, kind: str) -> dict:
        found = self.data.get("objects", {}).get(name)
        if found is None:
            raise ValueError(f"checkpoint {self.path} has no state {name!r} (it has: "
                             f"{', '.join(sorted(self.data.get('objects', {})) + sorted(self.data.get('values', {}))) or 'nothing'})")
        if found.get("type") != kind:
            raise ValueError(f"checkpoint {self.path}: state {name!r} was saved from a {found.get('type')}, "
                             f"cannot load it into a {kind}")
        return found

    def value(self, name: str):
        values = self.data.get("values", {})
        if name not in values:
            raise ValueError(f"checkpoint {self.path} has no value {name!r}")
        return values[name]

    def replica_value(self, name: str):
        """This replica's value when the replica count is unchanged, else the common
        value when every writer saved the same one, else ``None``."""
        saved = [v.get(name) for v in self.data.get("replica_values", [])]
        if not saved or saved[0] is None:
            return None
        if self.writers == self.replicas:
            return saved[self.replica]
        return saved[0] if all(s == saved[0] for s in saved) else None

    def arrays_under(self, prefix: str) -> list[str]:
        return sorted(n for n in self.data.get("arrays", {}) if n.startswith(prefix))

    def array(self, name: str) -> dict:
        found = self.data.get("arrays", {}).get(name)
        if found is None:
            raise ValueError(f"checkpoint {self.path} has no array {name!r}")
        return found


def bind(state: dict, manifest: dict, path, replicas: int, replica: int) -> Binding:
    """Match ``state`` against ``manifest``. Local (no communication); nothing changes yet.

    Raises:
        ValueError: the checkpoint lacks an entry of ``state``, or holds another kind,
            shape or dtype (messages name the entry, expected and found).
        TypeError: an unsupported leaf.
    """
    m = _Manifest(manifest, path, replicas, replica)
    out = Binding()
    for name, parent, key, value in _leaves(state, json_names=manifest.get("values", {})):
        if isinstance(value, HostEmbedding):
            _bind_table(out, m, name, value)
        elif isinstance(value, CrossReplicaOptimizer):
            _bind_cross_replica(out, m, name, value)
        elif isinstance(value, DenseOptimizer):
            m.object(name, type(value).__name__)
            _bind_dense(out, m, name, value, sharded=False)
        elif isinstance(value, LossScaler):
            m.object(name, type(value).__name__)
            out.finish.append(_set_fields(value, m.value(name)))
        elif isinstance(value, Infeed):
            m.object(name, "Infeed")
            _bind_feed(out, m, name, value)
        elif isinstance(value, np.random.Generator):
            m.object(name, "Generator")
            saved = m.replica_value(name)
            if saved is not None:
                out.finish.append(_set_generator(value, saved))
        elif isinstance(value, np.ndarray):
            m.object(name, "ndarray")
            out.targets.append(Entry(name, value.shape, value.dtype, Partition("replicated"), value))
        else:
            saved = m.value(name)
            out.finish.append(_set_item(parent, key, saved))
    return out


def _set_item(parent: dict, key: str, value):
    def finish():
        parent[key] = value
    return finish


def _set_fields(obj, fields: dict):
    def finish():
        for k, v in fields.items():
            setattr(obj, k, v)
    return finish


def _set_generator(gen: np.random.Generator, state: dict):
    def finish():
        gen.bit_generator.state = state
    return finish


def _bind_table(out: Binding, m: _Manifest, name: str, table: HostEmbedding) -> None:
    saved = m.object(name, "HostEmbedding")
    ts = table.state()
    if tuple(saved["shape"]) != tuple(ts.shape):
        raise ValueError(f"checkpoint {m.path}: table {name!r} has shape {tuple(saved['shape'])}, the table "
                         f"being loaded has {tuple(ts.shape)}")
    for key in sorted(ts.arrays):
        local = ts.arrays[key]
        partition, shape = _table_partition(ts.layouts[key], ts.partition_strategy, ts.shape)
        out.targets.append(Entry(f"{name}/{key}", shape if shape is not None else local.shape, local.dtype,
                                 partition, local))
    generators = {}
    for kind in ts.generators:
        value = m.replica_value(f"{name}/generators/{kind}") if kind == "per_replica" else \
            m.data.get("values", {}).get(f"{name}/generators/{kind}")
        if value is not None:
            generators[kind] = value

    def finish():
        table.load_state(ts.arrays, generators or None)
    out.finish.append(finish)


def _bind_dense(out: Binding, m: _Manifest, name: str, optimizer: DenseOptimizer, sharded: bool,
                sizes: dict | None = None) -> None:
    """Fresh slot arrays (filled by the load) that replace ``optimizer.state`` at the end."""
    prefix = f"{name}/state/"
    new_state: dict[str, dict[str, np.ndarray]] = {}
    for array_name in m.arrays_under(prefix):
        key, _, slot = array_name[len(prefix):].rpartition("/")
        record = m.array(array_name)
        shape, dtype = tuple(record["shape"]), np.dtype(record["dtype"])
        if sharded:
            n = shape[0]
            local_shape = (-(-n // m.replicas),)
            partition = Partition("block", 0)
            if sizes is not None:
                sizes[key] = n
        else:
            local_shape, partition = shape, Partition("replicated")
        local = np.zeros(local_shape, dtype)
        new_state.setdefault(key, {})[slot] = local
        out.targets.append(Entry(array_name, shape, dtype, partition, local))
    steps = m.data.get("values", {}).get(f"{name}/steps")

    def finish():
        optimizer.state = new_state
        if steps is not None and hasattr(optimizer, "steps"):
            optimizer.steps = int(steps)
    out.finish.append(finish)


def _bind_cross_replica(out: Binding, m: _Manifest, name: str, opt: CrossReplicaOptimizer) -> None:
    saved = m.object(name, "CrossReplicaOptimizer")
    inner = opt.optimizer
    if saved["optimizer"] != type(inner).__name__:
        raise ValueError(f"checkpoint {m.path}: optimizer {name!r} was a {saved['optimizer']}, the one being "
                         f"loaded is a {type(inner).__name__}")
    if bool(saved["shard_optimizer_state"]) != opt.shard_optimizer_state:
        raise ValueError(f"checkpoint {m.path}: optimizer {name!r} was saved with shard_optimizer_state="
                         f"{saved['shard_optimizer_state']}, the one being loaded has "
                         f"{opt.shard_optimizer_state}")
    sizes: dict[str, int] = {}
    _bind_dense(out, m, name, inner, opt.shard_optimizer_state, sizes)
    identical = m.data.get("values", {}).get(f"{name}/generators/replica_identical")
    own = m.replica_value(f"{name}/generators/per_replica")

    def finish():
        if opt.shard_optimizer_state:
            opt.shard_sizes.update(sizes)
        states = {"replica_identical": identical, "per_replica": own}
        opt.stochastic_rounding.set_generator_states({k: v for k, v in states.items() if v is not None})
    out.finish.append(finish)


def _bind_feed(out: Binding, m: _Manifest, name: str, feed: Infeed) -> None:
    saved = m.value(name)
    steps, replicas = int(saved["steps"]), int(saved["replicas"])
    # The rule (docs/checkpoint.md): at the same replica count continue at the same
    # step; at another, at the first step whose batches follow every batch already
    # taken, ceil(steps * R / R') (no batch repeated, fewer than R' skipped).
    resume = steps if replicas == m.replicas else -(-steps * replicas // m.replicas)
    if feed.started:
        raise ValueError(f"state {name!r}: the Infeed has started; load the checkpoint before taking its "
                         f"first batch")
    out.finish.append(lambda: feed.seek(resume))
