"""Walking a state for a checkpoint: what is saved, and where a load puts it back.

``state`` is a dict (nested dicts allowed) whose leaves are:

==============================  =============================================================
leaf                            saved as
==============================  =============================================================
a :class:`~.stateful.Stateful`  what its ``state_dict()`` returns, walked the same way under
                                the object's name (library objects: host embeddings, optimizers,
                                loss scalers, the feed; and your own)
``np.random.Generator``         its bit generator's state, per replica
                                (:class:`~.stateful.GeneratorState`)
``np.ndarray``                  one replicated array (dense parameters): replica 0 writes it
JSON value                      the value (replica 0's); a dict holding only JSON values is one
                                value; loading replaces it in its dict, if of the same JSON type
==============================  =============================================================

Inside a ``state_dict()`` tree, :class:`~.stateful.Partitioned` arrays are split over the
replicas, :class:`~.stateful.PerReplica` values differ per replica and
:class:`~.stateful.Allocate` marks state to be created from the checkpoint. Names are the
keys joined with ``/`` (``"model/params/w"``). :func:`describe` turns a state into
:class:`Entry` arrays and JSON values for the writer; :func:`bind` matches a state
against a manifest and returns the arrays to fill, the checks to run before anything
changes, and the steps that finish the load once every array is in place. Nothing here
knows a library class: objects take part through the protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .format import CheckpointError, file_name
from .partition import Partition
from .stateful import Allocate, Partitioned, PerReplica, Saved, Stateful, as_stateful


class CheckpointMismatch(CheckpointError, ValueError):
    """The state being loaded does not match the checkpoint (another shape, dtype,
    kind or JSON type, or a missing entry): a :class:`CheckpointError` that is also a
    ``ValueError``."""


@dataclass
class Entry:
    """One array: ``name``, global ``shape`` and ``dtype``, its ``partition`` over the
    replicas, and this replica's ``local`` part (padded as the owner keeps it; ``None``
    for a load's claimed array until :meth:`Binding.allocate`)."""

    name: str
    shape: tuple
    dtype: np.dtype
    partition: Partition
    local: np.ndarray | None
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
    """A state matched against a manifest: arrays to fill, ``checks`` to run before
    anything changes (the objects' own checks first, then the arrays' shapes and dtypes,
    so an object can name what differs in its own terms), ``allocations`` to make once
    every file was checked, then ``finish`` in order.

    The arrays of :class:`~.stateful.Allocate` claims are not allocated by :func:`bind`:
    their targets have ``local=None`` and the trees the objects see hold placeholders of
    the claimed shape and dtype that take no memory (read-only broadcasts of one
    element) until :meth:`allocate` puts the real arrays in their place."""

    targets: list[Entry] = field(default_factory=list)
    checks: list[Callable[[], None]] = field(default_factory=list)
    finish: list[Callable[[], None]] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    allocations: list[Callable[[], None]] = field(default_factory=list)
    live: dict = field(default_factory=dict)         # the user's plain arrays: name -> (shape, dtype)
    claim_checks: list[Callable[[], None]] = field(default_factory=list)  # run by bind at its end

    def allocate(self) -> None:
        """Allocate the claimed arrays (zeros, shaped as saved) and put them in the
        objects' trees in place of the placeholders. Call it only once every file behind
        the claims was checked.

        Raises:
            MemoryError: the arrays do not fit.
        """
        for allocate in self.allocations:
            allocate()

    def check(self) -> None:
        """Run the checks.

        Raises:
            CheckpointMismatch: an object refused the load (its ``ValueError``), or an
                array's shape or dtype differs from the checkpoint's.
        """
        for check in self.checks:
            try:
                check()
            except CheckpointError:
                raise
            except ValueError as exc:
                raise CheckpointMismatch(str(exc)) from None
        if self.mismatches:
            raise CheckpointMismatch(self.mismatches[0])


def is_json(value) -> bool:
    """A JSON value: None, bool, int, float, str, or a list or ``str``-keyed dict of them."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_json(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_json(v) for k, v in value.items())
    return False


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "list" if isinstance(value, (list, tuple)) else "object"


def _children(tree: dict, name: str):
    """``(key, child name)`` of a dict of state, in a fixed order, with checked keys."""
    for key in sorted(tree, key=str):
        if not isinstance(key, str) or not key or "/" in key:
            raise TypeError(f"argument state: keys must be non-empty str without '/', got {key!r} in "
                            f"{name or 'state'!r}")
        yield key, f"{name}/{key}" if name else key


def _type_name(obj) -> str:
    info = getattr(obj, "checkpoint_info", None)
    return (info() if info else {}).get("type") or type(obj).__name__


# --------------------------------------------------------------------------------------
# saving
# --------------------------------------------------------------------------------------
def describe(state: dict, replicas: int, replica: int) -> Description:
    """The arrays and values of ``state`` for a save.

    Raises:
        TypeError: a leaf of an unsupported type (names the key and the type).
        ValueError: two arrays whose names give the same file name (``"a.b"`` and
            ``"a/b"``).
    """
    if not isinstance(state, dict):
        raise TypeError(f"argument state: expected a dict of name -> state, got {type(state).__name__}")
    out = Description()
    for key, name in _children(state, ""):
        _describe(out, name, state[key], user=True)
    files: dict[str, str] = {}
    for entry in out.entries:  # file names keep [A-Za-z0-9_-]: "a.b" and "a/b" would share one
        other = files.setdefault(file_name(entry.name, None), entry.name)
        if other != entry.name:
            raise ValueError(f"state {other!r} and {entry.name!r} would be written to the same file "
                             f"{file_name(entry.name, None)[:-4]}.*: rename one of them")
    return out


def _describe(out: Description, name: str, value, user: bool) -> None:
    """``value`` at ``name``: ``user`` while in the dicts passed to save_checkpoint (whose
    arrays get a manifest entry of their own), False inside an object's state_dict()."""
    obj = as_stateful(value)
    if obj is not None:
        info = getattr(obj, "checkpoint_info", None)
        out.objects[name] = {"type": type(obj).__name__, **(info() if info else {})}
        _describe(out, name, obj.state_dict(), user=False)
        return
    if isinstance(value, dict) and not is_json(value):
        for key, child in _children(value, name):
            _describe(out, child, value[key], user)
    elif isinstance(value, Partitioned):
        _check_savable(name, value.local)
        out.entries.append(Entry(name, tuple(value.shape), value.local.dtype, value.partition, value.local,
                                 dict(value.meta)))
    elif isinstance(value, np.ndarray):
        _check_savable(name, value)
        if user:
            out.objects[name] = {"type": "ndarray"}
        out.entries.append(Entry(name, value.shape, value.dtype, Partition("replicated"), value))
    elif isinstance(value, PerReplica):
        out.replica_values[name] = _json_value(name, value.value)
    elif isinstance(value, Allocate):
        pass  # state not created yet: nothing to save
    else:
        out.values[name] = _json_value(name, value)


def _json_value(name: str, value):
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    if is_json(value):
        return value
    hint = "; torch objects join after 'import popdist_lite.torch'" if type(value).__module__.startswith("torch") \
        else ""
    raise TypeError(f"state {name!r}: cannot save a {type(value).__name__} (expected an object with "
                    f"state_dict() and load_state_dict(), an np.random.Generator, a numpy array, a dict, or a "
                    f"JSON value{hint})")


def _check_savable(name: str, array: np.ndarray) -> None:
    if array.dtype.kind not in "biufc" or array.dtype.fields is not None:
        raise TypeError(f"state {name!r}: arrays of dtype {array.dtype} cannot be saved (plain numeric/bool "
                        f"arrays only: no pickles)")


# --------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------
_MISSING = object()


class _Manifest:
    """Lookups in a (checked) manifest for :func:`bind`, with errors naming the checkpoint."""

    def __init__(self, manifest: dict, path, replicas: int, replica: int):
        self.data, self.path, self.replicas, self.replica = manifest, path, replicas, replica
        self.writers = int(manifest["num_replicas"])
        self.values = manifest.get("values", {})
        self.objects = manifest.get("objects", {})
        self.arrays = manifest.get("arrays", {})

    def names(self) -> str:
        return ", ".join(sorted(set(self.objects) | set(self.values))) or "nothing"

    def object(self, name: str, kind: str) -> dict:
        found = self.objects.get(name)
        if found is None:
            raise CheckpointMismatch(f"checkpoint {self.path} has no state {name!r} (it has: {self.names()})")
        if found.get("type") != kind:
            raise CheckpointMismatch(f"checkpoint {self.path}: state {name!r} was saved from a {found.get('type')}, "
                                     f"cannot load it into a {kind}")
        return found

    def value(self, name: str, like):
        """The saved value of ``name``, which must have the JSON type of ``like`` (a
        dict saved by an earlier format as one value per key is put back together)."""
        if name in self.values:
            saved = self.values[name]
        elif isinstance(like, dict):
            saved = self._assembled(name, like)
        else:
            saved = _MISSING
        if saved is _MISSING:
            raise CheckpointMismatch(f"checkpoint {self.path} has no value {name!r} (it has: {self.names()})")
        if _json_type(saved) != _json_type(like):
            raise CheckpointMismatch(f"checkpoint {self.path}: value {name!r} is a JSON {_json_type(saved)} in the "
                                     f"checkpoint, the state being loaded has a JSON {_json_type(like)}")
        if isinstance(like, float) and isinstance(saved, int):
            saved = float(saved)
        return list(saved) if isinstance(like, tuple) else saved

    def _assembled(self, name: str, like: dict):
        """A JSON dict saved key by key (``name/key``), or ``_MISSING``."""
        parts = {}
        for key, sub in like.items():
            child = f"{name}/{key}"
            if child in self.values:
                parts[key] = self.values[child]
            elif isinstance(sub, dict):
                got = self._assembled(child, sub)
                if got is not _MISSING:
                    parts[key] = got
        return parts if parts or not like else _MISSING

    def replica_value(self, name: str):
        """This replica's value when the replica count is unchanged, else the common
        value when every writer saved the same one, else ``_MISSING``."""
        saved = [v.get(name, _MISSING) for v in self.data.get("replica_values", [])]
        if not saved or saved[0] is _MISSING:
            return _MISSING
        if self.writers == self.replicas:
            return saved[self.replica]
        return saved[0] if all(s == saved[0] for s in saved) else _MISSING

    def array(self, name: str) -> dict:
        found = self.arrays.get(name)
        if found is None:
            under = sorted(n for n in self.arrays if n.startswith(name.rsplit("/", 1)[0] + "/"))
            hint = f" (it has {', '.join(under[:8])}{', ...' if len(under) > 8 else ''})" if under else ""
            raise CheckpointMismatch(f"checkpoint {self.path} has no array {name!r}{hint}")
        return found


def bind(state: dict, manifest: dict, path, replicas: int, replica: int) -> Binding:
    """Match ``state`` against ``manifest`` (checked by :func:`~.manifest.read_manifest`).
    Local (no communication); nothing changes yet.

    Raises:
        CheckpointMismatch: the checkpoint lacks an entry of ``state``, or holds another
            kind, shape, dtype or JSON type (messages name the entry, expected and found).
        TypeError: an unsupported leaf.
    """
    if not isinstance(state, dict):
        raise TypeError(f"argument state: expected a dict of name -> state, got {type(state).__name__}")
    m = _Manifest(manifest, path, replicas, replica)
    out = Binding()
    for key, name in _children(state, ""):
        _bind_leaf(out, m, name, state, key)
    for check in out.claim_checks:  # once every live array is known
        check()
    return out


def _bind_leaf(out: Binding, m: _Manifest, name: str, parent: dict, key: str) -> None:
    """A leaf of the state passed to load_checkpoint (a plain dict of the user's)."""
    value = parent[key]
    obj = as_stateful(value)
    if obj is not None:
        _bind_object(out, m, name, obj)
    elif isinstance(value, dict) and not is_json(value):
        for child_key, child in _children(value, name):
            _bind_leaf(out, m, child, value, child_key)
    elif isinstance(value, np.ndarray):
        m.object(name, "ndarray")
        out.live[name] = (value.shape, value.dtype)
        out.targets.append(_target(out, m, name, value.shape, value.dtype, Partition("replicated"), value))
    elif isinstance(value, PerReplica):
        saved = m.replica_value(name)
        if saved is not _MISSING:
            out.finish.append(lambda: setattr(value, "value", saved))
    elif is_json(value) or isinstance(value, (np.integer, np.floating, np.bool_)):
        like = value.item() if isinstance(value, np.generic) else value
        saved = m.value(name, like)
        out.finish.append(lambda: parent.__setitem__(key, saved))
    else:
        raise TypeError(f"state {name!r}: cannot load into a {type(value).__name__}")


def _bind_object(out: Binding, m: _Manifest, name: str, obj: Stateful) -> None:
    info = m.object(name, _type_name(obj))
    loaded = _bind_tree(out, m, name, obj.state_dict())
    validate = getattr(obj, "validate_state_dict", None)
    tree = None if loaded is _MISSING else loaded
    if validate is not None:
        out.checks.append(lambda: validate(tree, Saved(name, info)))
    out.finish.append(lambda: obj.load_state_dict(tree))


def _bind_tree(out: Binding, m: _Manifest, name: str, tree):
    """The tree ``load_state_dict`` gets for ``tree`` (a ``state_dict()`` or part of
    one); registers its arrays as targets. ``_MISSING`` for a per-replica value that
    cannot be restored."""
    obj = as_stateful(tree)
    if obj is not None:
        _bind_object(out, m, name, obj)
        return tree
    if isinstance(tree, dict) and not is_json(tree):
        loaded = {}
        for key, child in _children(tree, name):
            got = _bind_tree(out, m, child, tree[key])
            if got is not _MISSING:
                loaded[key] = got
        return loaded
    if isinstance(tree, Partitioned):
        out.targets.append(_target(out, m, name, tuple(tree.shape), tree.local.dtype, tree.partition, tree.local))
        return tree
    if isinstance(tree, np.ndarray):
        out.targets.append(_target(out, m, name, tree.shape, tree.dtype, Partition("replicated"), tree))
        return tree
    if isinstance(tree, PerReplica):
        return m.replica_value(name)
    if isinstance(tree, Allocate):
        return _bind_allocation(out, m, name, tree)
    if is_json(tree) or isinstance(tree, (np.integer, np.floating, np.bool_)):
        return m.value(name, tree.item() if isinstance(tree, np.generic) else tree)
    raise TypeError(f"state {name!r}: cannot load into a {type(tree).__name__}")


def _target(out: Binding, m: _Manifest, name: str, shape: tuple, dtype: np.dtype, partition: Partition,
            local: np.ndarray) -> Entry:
    """The live array ``local`` to fill from array ``name``, whose shape and dtype the
    checkpoint must hold (a difference is recorded in ``out.mismatches``)."""
    saved = m.array(name)
    if tuple(saved["shape"]) != tuple(shape) or np.dtype(saved["dtype"]) != dtype:
        out.mismatches.append(f"array {name!r}: the checkpoint holds {np.dtype(saved['dtype'])}"
                              f"{list(saved['shape'])}, the state being loaded has {dtype}{list(shape)}")
    return Entry(name, tuple(shape), np.dtype(dtype), partition, local)


def _bind_allocation(out: Binding, m: _Manifest, name: str, leaf: Allocate) -> dict:
    """The arrays, shaped as saved, of every array below ``name`` that ``leaf.check``
    accepts, as a nested dict (``"w/m"`` -> ``{"w": {"m": array}}``; split arrays as
    :class:`~.stateful.Partitioned`, whose ``shape`` is the saved whole). Nothing is
    allocated here: the dict holds placeholders (no memory) until
    :meth:`Binding.allocate`, which runs once the files behind the claims were checked,
    so a manifest's claims cost nothing before its files back them."""
    loaded: dict = {}
    claims: dict = {}
    prefix = name + "/"
    for array_name in sorted(n for n in m.arrays if n.startswith(prefix)):
        record = m.arrays[array_name]
        relative = array_name[len(prefix):]
        shape, dtype = tuple(record["shape"]), np.dtype(record["dtype"])
        try:
            leaf.check(relative, shape, dtype)
        except (ValueError, TypeError) as exc:
            raise CheckpointMismatch(f"checkpoint {m.path}: array {array_name!r}: {exc}") from None
        if leaf.partition.kind != "replicated" and leaf.partition.axis >= len(shape):
            raise CheckpointMismatch(f"checkpoint {m.path}: array {array_name!r} has {len(shape)} dimension(s), "
                                     f"cannot be split on axis {leaf.partition.axis}")
        local_shape = list(shape)
        if leaf.partition.kind != "replicated":
            local_shape[leaf.partition.axis] = -(-shape[leaf.partition.axis] // m.replicas)
        entry = Entry(array_name, shape, dtype, leaf.partition, None)
        out.targets.append(entry)
        *parents, last = relative.split("/")
        node = loaded
        for part in parents:
            node = node.setdefault(part, {})
        wrap = (lambda a: a) if leaf.partition.kind == "replicated" else \
            (lambda a, shape=shape: Partitioned(a, shape, leaf.partition))
        node[last] = wrap(np.broadcast_to(np.zeros((), dtype), tuple(local_shape)))

        def allocate(entry=entry, node=node, last=last, wrap=wrap, local_shape=tuple(local_shape)):
            entry.local = np.zeros(local_shape, entry.dtype)
            node[last] = wrap(entry.local)
        out.allocations.append(allocate)
        claims[relative] = (shape, dtype)
    if leaf.check_claims is not None:
        def check_claims():
            try:
                leaf.check_claims(claims, out.live)
            except (ValueError, TypeError) as exc:
                raise CheckpointMismatch(f"checkpoint {m.path}: {name!r}: {exc}") from None
        out.claim_checks.append(check_claims)
    return loaded
