"""JAX state in popdist-lite checkpoints: :class:`PytreeState`, a pytree (Flax
variables, Optax state, any nest of dicts, lists, tuples, namedtuples and registered
pytree nodes) as a :class:`popdist_lite.checkpoint.Stateful`.

::

    dense = PytreeState({"params": params, "opt_state": opt_state})
    state = {"step": step, "dense": dense, "tables": collection, "feed": feed}
    pl.save_checkpoint("ckpt", state, step=step)
    pl.load_checkpoint(pl.latest_checkpoint("ckpt"), state)
    params, opt_state = dense.tree["params"], dense.tree["opt_state"]   # new jax.Arrays

Every leaf is named by its path in the tree, one path component per level as
``jax.tree_util`` names them (a dict's key, a sequence's index, a namedtuple's or
dataclass's field): ``dense/params/Dense_0/kernel``, ``dense/opt_state/0/mu/...``.
Components keep ``[A-Za-z0-9_]`` and write any other byte as ``-XX`` (its hex
UTF-8 value), so a key holding ``/`` (Haiku's ``"mlp/~/linear"``) stays one component
and two different paths never share a checkpoint file.

JAX arrays are immutable, so the checkpoint never writes into them: ``state_dict()``
returns host copies of the leaves, the load fills those copies, and
``load_state_dict`` builds a new tree of the live tree's structure from them
(``jax.Array`` leaves placed as the live leaf was, with ``jax.device_put`` to its
sharding), which becomes :attr:`PytreeState.tree`. Arrays the program holds keep their
values. Shapes and dtypes come from the live tree, never from the checkpoint.

A tree loads whole: the checkpoint must hold exactly the live tree's leaves (names and
kinds), each array of the live leaf's shape and dtype; anything else is refused on
every replica before any state changes (``popdist_lite.CheckpointError``, also a
``ValueError``).

Leaves (the kind each is saved as):

- ``jax.Array``, ``np.ndarray`` and numpy scalars with a numpy dtype: a replicated
  array (the tree is the same on every replica, as data-parallel parameters and
  optimizer states are; replica 0's is written);
- dtypes numpy does not have (``bfloat16``, the ``float8`` family: ``ml_dtypes``): their
  bits, as unsigned integers of the same width, and the dtype's name in the manifest;
- typed PRNG keys (``jax.random.key``): their ``jax.random.key_data`` (``uint32``)
  and the key's implementation;
- Python ``bool``, ``int``, ``float`` and ``str``: JSON values, loaded back as the same
  Python type.
"""

from __future__ import annotations

import re

import jax
import numpy as np

_KEY_ESCAPE = re.compile(r"[^A-Za-z0-9_]+")


class PytreeState:
    """A pytree in checkpoints (the module docstring): save it with
    ``pl.save_checkpoint(dir, {"name": PytreeState(tree), ...})``, load it with
    ``pl.load_checkpoint``, then read the loaded tree from :attr:`tree`.

    Attributes:
        tree: the pytree; replaced by a new tree of the same structure when a checkpoint
            is loaded (set it to the current tree before each save).

    Raises (from ``save_checkpoint``, on every replica):
        TypeError: a leaf that is none of the kinds above (naming its path), or a traced
            leaf (inside ``jax.jit``).
        ValueError: two leaves whose paths give the same name (dict keys whose ``str`` is
            the same).
    """

    def __init__(self, tree):
        self.tree = tree

    def checkpoint_info(self) -> dict:
        """The manifest's entry: every leaf's name and kind (``"array"``,
        ``"bits:bfloat16"``, ``"key<fry>"``, ``"int"``, ...), which a load compares."""
        return {"type": "PytreeState", "leaves": {name: kind for name, _, kind, _ in _leaves(self.tree)}}

    def state_dict(self):
        """Host copies of the leaves (numpy arrays and JSON values), nested by the path
        components; the root leaf itself for a tree that is one leaf. Local."""
        return _nest([(path, _to_host(leaf, kind)) for _, path, kind, leaf in _leaves(self.tree)])

    def validate_state_dict(self, state_dict, saved) -> None:
        """Refuse a checkpoint whose tree has other leaves or kinds than the live one, or
        whose JSON leaves have another Python type or do not convert to it (before
        anything changes; array leaves are host copies of the live leaves' shapes and
        dtypes, so :meth:`load_state_dict` converts them back without fail).

        Raises:
            ValueError: naming the pytree, the leaves that differ, expected and found.
        """
        where = f"pytree {saved.name!r}"
        theirs = saved.info.get("leaves")
        if not isinstance(theirs, dict) or not all(isinstance(v, str) for v in theirs.values()):
            raise ValueError(f"{where}: the checkpoint's entry lists no leaves (expected name -> kind)")
        leaves = _leaves(self.tree)
        mine = {name: kind for name, _, kind, _ in leaves}
        for what, names in (("lacks", sorted(set(mine) - set(theirs))), ("has", sorted(set(theirs) - set(mine)))):
            if names:
                extra = "" if what == "lacks" else " the live tree does not"
                raise ValueError(f"{where}: the checkpoint {what} the leaves {_listed(names)}{extra} (a pytree loads "
                                 f"whole: the same leaves as when it was saved)")
        for name, kind in mine.items():
            if theirs[name] != kind:
                raise ValueError(f"{where}: leaf {name or '(root)'!r} was saved as {theirs[name]!r}, the live leaf is "
                                 f"{kind!r}")
        for name, path, kind, _ in leaves:
            if kind in _JSON:
                try:
                    value = _at(state_dict, path)
                except (KeyError, TypeError):
                    raise ValueError(f"{where}: the checkpoint holds no value for leaf {name or '(root)'!r}") from None
                if not _is_a(value, kind):
                    raise ValueError(f"{where}: leaf {name or '(root)'!r}: expected a Python {kind}, the checkpoint "
                                     f"holds {type(value).__name__} {str(value)[:40]!r}")
                try:  # the conversion load_state_dict makes, tried now
                    _from_host(value, kind, None)
                except (ValueError, TypeError, OverflowError) as exc:
                    raise ValueError(f"{where}: leaf {name or '(root)'!r}: {str(value)[:40]!r} is no Python {kind} "
                                     f"({exc})") from None

    def load_state_dict(self, state_dict) -> None:
        """Build the new tree from the filled host copies (:attr:`tree`). Local."""
        treedef = jax.tree_util.tree_structure(self.tree)
        self.tree = jax.tree_util.tree_unflatten(
            treedef, [_from_host(_at(state_dict, path), kind, leaf) for _, path, kind, leaf in _leaves(self.tree)])

    def __repr__(self) -> str:
        return f"PytreeState({jax.tree_util.tree_structure(self.tree)})"


def checkpoint_name(key) -> str:
    """One component of a checkpoint name from a dict key, an index or a table name:
    ``str(key)`` with every byte outside ``[A-Za-z0-9_]`` written as ``-XX`` (hex);
    ``"-"`` for the empty string. Never contains ``/``; different strings give different
    names."""
    text = str(key)
    return _KEY_ESCAPE.sub(lambda m: "".join(f"-{b:02X}" for b in m.group().encode()), text) if text else "-"


# -- leaves ---------------------------------------------------------------------------------
_JSON = {"bool": bool, "int": int, "float": float, "str": str}


def _leaves(tree) -> list[tuple[str, tuple, str, object]]:
    """``(name, path components, kind, leaf)`` of every leaf, in ``jax.tree_util``'s
    order.

    Raises:
        TypeError: a leaf of no supported kind, or a tracer.
        ValueError: two leaves with the same name.
    """
    out, seen = [], {}
    for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        path = tuple(checkpoint_name(_key_text(k)) for k in keys)
        name = "/".join(path)
        where = jax.tree_util.keystr(keys) or "(the root)"
        if name in seen:
            raise ValueError(f"PytreeState: the leaves at {seen[name]} and {where} have the same name {name!r} (keys "
                             f"whose str() is the same)")
        seen[name] = where
        out.append((name, path, _kind(leaf, where), leaf))
    return out


def _key_text(key) -> str:
    for attr in ("key", "idx", "name"):  # DictKey / FlattenedIndexKey, SequenceKey, GetAttrKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _kind(leaf, where: str) -> str:
    if isinstance(leaf, jax.core.Tracer):
        raise TypeError(f"PytreeState: leaf {where} is a traced value: save and load outside jax.jit")
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return str(leaf.dtype)  # key<impl>
        dtype = np.dtype(leaf.dtype)
        return "array" if dtype.kind in "biufc" and dtype.fields is None else f"bits:{dtype.name}"
    for kind, python_type in _JSON.items():  # bool first: a bool is an int
        if isinstance(leaf, python_type):
            return kind
    raise TypeError(f"PytreeState: leaf {where} is a {type(leaf).__name__}; expected a JAX or numpy array, a numpy "
                    f"scalar, or a Python bool, int, float or str")


def _is_a(value, kind: str) -> bool:
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, _JSON[kind])


def _to_host(leaf, kind: str):
    if kind in _JSON:
        return _JSON[kind](leaf)
    if kind.startswith("key<"):
        return np.array(jax.random.key_data(leaf))
    host = np.array(leaf)  # a copy: the load fills it, never the live leaf
    return host if kind == "array" else host.view(f"u{host.dtype.itemsize}")


def _from_host(host, kind: str, live):
    """The new leaf from its filled host copy, of the live leaf's type and placement."""
    if kind in _JSON:
        return _JSON[kind](host)
    if kind.startswith("key<"):
        host = jax.random.wrap_key_data(host, impl=jax.random.key_impl(live))
    elif kind != "array":
        host = host.view(np.dtype(live.dtype))
    if isinstance(live, jax.Array):
        return jax.device_put(host, live.sharding)
    return host[()] if isinstance(live, np.generic) else host


# -- nesting --------------------------------------------------------------------------------
def _nest(items: list[tuple[tuple, object]]):
    """``{component: {component: value}}`` from ``(path, value)``; the value itself for
    the root's path ``()``."""
    if len(items) == 1 and not items[0][0]:
        return items[0][1]
    out: dict = {}
    for path, value in items:
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return out


def _at(tree, path: tuple):
    for part in path:
        tree = tree[part]
    return tree


def _listed(names: list[str]) -> str:
    shown = ", ".join(repr(n or "(root)") for n in names[:6])
    return shown + (f" and {len(names) - 6} more" if len(names) > 6 else "")
