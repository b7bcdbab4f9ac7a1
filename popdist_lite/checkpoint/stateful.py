"""The ``Stateful`` protocol: how an object joins a checkpoint.

An object is saved and restored by :func:`~popdist_lite.save_checkpoint` and
:func:`~popdist_lite.load_checkpoint` when it has the two methods of
torch.distributed.checkpoint's ``Stateful``::

    class Counter:
        def state_dict(self):
            return {"weights": self.weights,                       # replicated array
                    "rows": Partitioned(self.rows, shape=(n, 4),   # this replica's part of an (n, 4) array
                                        partition=Partition("cyclic", 0)),
                    "seed": PerReplica(self.seed),                 # differs per replica
                    "count": self.count}                           # JSON value
        def load_state_dict(self, state_dict):
            self.count = state_dict["count"]    # arrays were already filled in place
            self.seed = state_dict.get("seed", self.seed)

``state_dict()`` returns a tree: dicts with ``str`` keys (no ``/``) whose leaves are

- ``np.ndarray``: one array, identical on every replica (dense weights); replica 0
  writes it once;
- :class:`Partitioned`: this replica's part of a larger array split over the replicas
  (an embedding table's rows or columns, sharded optimizer state), resharded on load
  when the replica count or the partition changed;
- :class:`PerReplica`: a JSON value that differs per replica (a random generator's
  state); restored at the same replica count, or when every replica saved the same;
- a JSON value (``None``, bool, int, float, str, list, or a dict holding only JSON
  values, kept whole), identical on every replica (replica 0's is saved);
- :class:`Allocate`: state the object has not created yet (lazily made optimizer
  slots), to be taken from the checkpoint;
- or another ``Stateful`` object, or a dict of these.

Loading follows DCP: the loader calls ``state_dict()`` for the arrays to fill (shapes and
dtypes come from them, never from the checkpoint), checks everything on every replica,
copies the checkpoint's data into those arrays in place, then calls
``load_state_dict(tree)`` with the same tree in which arrays are filled, JSON leaves hold
the saved values (only where the saved value has the same JSON type), :class:`PerReplica`
leaves hold the saved value (the key is left out when it cannot be restored at this
replica count) and :class:`Allocate` leaves hold ``{name: array}`` of what the
checkpoint had there. An object that returned copies from ``state_dict()`` copies them
back in ``load_state_dict``.

Two optional methods: ``checkpoint_info()`` returns JSON saved in the manifest's entry of
the object (``"type"`` defaults to the class name; the loader requires the same type),
and ``validate_state_dict(state_dict, saved)`` is called on every replica before
anything changes, with the tree ``load_state_dict`` will get (arrays not yet filled;
an :class:`Allocate`'s arrays as read-only placeholders of their shape and dtype that
take no memory, allocated only once the files behind them were checked) and the
:class:`Saved` entry; it raises ``ValueError`` (or ``TypeError``) to refuse the load.
Validation belongs there, not in ``load_state_dict``: by the time ``load_state_dict``
runs, every array of the state has been overwritten. So ``validate_state_dict`` tries
every conversion ``load_state_dict`` will make, on copies (a generator state set on a
new bit generator of its class: :func:`check_bit_generator_state`), and
``load_state_dict`` cannot fail on the input.

Classes whose own ``state_dict()`` means something else (torch modules and optimizers,
whose ``state_dict()`` holds tensors) join through an adapter registered with
:func:`register_adapter`: the checkpoint walks ``adapter(value)`` instead of the value.
``np.random.Generator`` is adapted by :class:`GeneratorState`; ``import
popdist_lite.torch`` registers the adapters of ``torch.Tensor``, ``torch.nn.Module`` and
``torch.optim.Optimizer`` (popdist_lite/torch/checkpoint.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np

from .partition import Partition


@runtime_checkable
class Stateful(Protocol):
    """An object with ``state_dict()`` and ``load_state_dict(state_dict)`` (see the
    module docstring), as torch.distributed.checkpoint's ``Stateful``."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> None: ...


@dataclass
class Partitioned:
    """This replica's part of an array split over the replicas.

    Attributes:
        local: this replica's part, as the object keeps it: along the split axis the
            real indices first (:meth:`Partition.count` of them), possibly followed by
            padding, which is neither saved nor loaded.
        shape: the whole array's shape.
        partition: how it is split (:class:`~popdist_lite.checkpoint.partition.Partition`:
            ``cyclic`` or ``block`` on an axis; ``replicated`` is a plain array).
        meta: JSON saved with the array in the manifest (shown by ``inspect``).
    """

    local: np.ndarray
    shape: tuple
    partition: Partition
    meta: dict = field(default_factory=dict)


@dataclass
class PerReplica:
    """A JSON value that differs per replica (each replica's is saved)."""

    value: Any


@dataclass
class Allocate:
    """State an object has not created yet (an optimizer's slots before its first
    step): the load takes every array the checkpoint holds below this name, with its
    saved shape and dtype, once ``check(name, shape, dtype)`` (``name`` relative to this
    leaf, e.g. ``"w/m"``) accepted it; the arrays are split over the replicas by
    ``partition`` (the global shape is the saved one). ``check`` runs before anything
    is allocated (compare with the live parameters there when the object knows them);
    so does ``check_claims(claims, live)`` when given, once the whole state was matched:
    ``claims`` maps each accepted name to its saved ``(shape, dtype)``, ``live`` every
    plain numpy array of the state being loaded (in the user's dicts, e.g.
    ``"params/w"``) to its ``(shape, dtype)``, so that an object that does not know its
    parameters (a numpy optimizer before its first step) can compare its claims with
    them; it raises ``ValueError`` to refuse. The arrays are allocated only once their
    files were checked (size, header, crc32), so a checkpoint cannot make a load
    allocate more than it holds on disk.
    """

    partition: Partition
    check: Callable[[str, tuple, np.dtype], None]
    check_claims: Callable[[dict, dict], None] | None = None


@dataclass(frozen=True)
class Saved:
    """What a checkpoint says of one object: its ``name`` in the state and its manifest
    entry ``info`` (``{"type": ..., **checkpoint_info()}`` as saved)."""

    name: str
    info: dict


class GeneratorState:
    """``np.random.Generator`` as a :class:`Stateful`: its bit generator's state,
    per replica (the manifest entry's type is ``"Generator"``)."""

    def __init__(self, generator: np.random.Generator):
        self.generator = generator

    def checkpoint_info(self) -> dict:
        return {"type": "Generator"}

    def state_dict(self) -> PerReplica:
        return PerReplica(self.generator.bit_generator.state)

    def validate_state_dict(self, state, saved: Saved) -> None:
        """Refuse a state the generator cannot take: it is set on a new bit generator
        of the same class first, so :meth:`load_state_dict` cannot fail.

        Raises:
            ValueError: naming the generator, the bit generator and the state.
        """
        if state is not None:
            check_bit_generator_state(self.generator.bit_generator, state, f"generator {saved.name!r}")

    def load_state_dict(self, state) -> None:
        if state is not None:
            self.generator.bit_generator.state = state


def check_bit_generator_state(bit_generator: np.random.BitGenerator, state, what: str) -> None:
    """Raise ``ValueError`` unless ``bit_generator.state = state`` would succeed: the
    state is set on a new bit generator of the same class (its setter checks every
    field), never on ``bit_generator`` itself.

    Raises:
        ValueError: naming ``what``, the bit generator and the refused state.
    """
    kind = type(bit_generator).__name__
    if not isinstance(state, dict) or state.get("bit_generator") != kind:
        raise ValueError(f"{what}: expected a {kind} state, got {str(state)[:80]}")
    try:
        type(bit_generator)(0).state = state
    except Exception as exc:  # noqa: BLE001 - whatever the setter refuses
        raise ValueError(f"{what}: not a valid {kind} state ({type(exc).__name__}: {exc}): "
                         f"{str(state)[:80]}") from None


_ADAPTERS: dict[type, Callable[[Any], Stateful]] = {np.random.Generator: GeneratorState}


def register_adapter(cls: type, adapter: Callable[[Any], Stateful]) -> None:
    """Checkpoint instances of ``cls`` (and of its subclasses) as ``adapter(value)``, a
    :class:`Stateful` made afresh for each save and load. The adapter of the nearest
    class in the value's method resolution order applies; it comes before the value's own
    ``state_dict()``.

    Raises:
        TypeError: ``cls`` is not a class or ``adapter`` not callable.
    """
    if not isinstance(cls, type) or not callable(adapter):
        raise TypeError(f"register_adapter: expected a class and a callable, got {cls!r} and {adapter!r}")
    _ADAPTERS[cls] = adapter


def as_stateful(value) -> Stateful | None:
    """The registered adapter of ``value``'s class (:func:`register_adapter`), else
    ``value`` itself if it is :class:`Stateful`, else ``None``."""
    for cls in type(value).__mro__:
        adapter = _ADAPTERS.get(cls)
        if adapter is not None:
            return adapter(value)
    if isinstance(value, Stateful) and not isinstance(value, type):
        return value
    return None
