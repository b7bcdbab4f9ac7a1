"""torch state in popdist-lite checkpoints: tensors, modules (with their host embeddings)
and ``torch.optim`` optimizers join :func:`popdist_lite.save_checkpoint` and
:func:`popdist_lite.load_checkpoint` as they are::

    state = {"step": step, "model": ddp_model, "optimizer": optimizer, "scaler": scaler, "feed": feed}
    pl.save_checkpoint("ckpt", state, step=step)
    pl.load_checkpoint(pl.latest_checkpoint("ckpt"), state)      # in place, at any replica count

``import popdist_lite.torch`` registers the adapters below with
:func:`popdist_lite.checkpoint.register_adapter` (a module's and an optimizer's own
``state_dict()`` hold tensors and integer keys; the adapters give the checkpoint their
state as the ``Stateful`` protocol's tree). The design is torch.distributed.checkpoint's
(DCP): a model's and an optimizer's ``state_dict()`` are what is saved, and loading
writes into the live tensors, whose shapes and dtypes come from the model, never from
the checkpoint.

- ``torch.Tensor`` (:class:`TensorState`): one replicated array (replica 0's copy is
  saved and every replica loads it, as for any replicated array; a value that differs
  per replica goes in a :class:`~popdist_lite.checkpoint.PerReplica`), the tensor's own memory
  (``Tensor.numpy()``: saved from it and loaded into it, no copy). dtypes numpy has no
  equivalent of (``bfloat16``, the ``float8`` types) travel as their bits (unsigned
  integers of the same width) with the dtype's name in the manifest. Dense CPU tensors.
- ``torch.nn.Module`` (:class:`ModuleState`): its ``state_dict()`` (parameters and
  persistent buffers, named by their fully qualified names, ``gru.weight_ih_l0``), each a
  tensor as above, and every :class:`~popdist_lite.torch.HostEmbedding` /
  :class:`~popdist_lite.torch.HostEmbeddingBag` inside it as its table (partitioned over
  the replicas and resharded across replica counts and strategies, as the numpy API's
  tables), and every :class:`~popdist_lite.torch.EmbeddingBagCollection` /
  :class:`~popdist_lite.torch.EmbeddingCollection` as its core collection (its tables by
  name and its plan; resharded across replica counts and plans). A
  :class:`~popdist_lite.torch.DistributedDataParallel` (or torch's) is saved
  as the module it wraps, so a checkpoint of a wrapped model loads into an unwrapped one
  and back, as DCP's ``get_model_state_dict`` does. A module loads whole: the
  checkpoint must hold exactly its tensors and tables (torch's ``strict=True``).
- A host embedding module on its own: its table, the same entry as a numpy
  :class:`popdist_lite.HostEmbedding` (either API loads the other's); a collection
  module on its own: the same entry as the core's numpy collection.
- ``torch.optim.Optimizer`` (:class:`OptimizerState`): per parameter (its index in
  ``optimizer.state_dict()``), its state tensors as above, loaded in place, and its
  non-tensor state (``SparseAdam``'s step count) as JSON; the ``param_groups``
  (hyperparameters) as JSON. A load hands the result to the optimizer's own
  ``load_state_dict``, so hyperparameters are restored as torch restores them.

Lazy optimizer state. ``torch.optim`` creates most state at the first ``step()``. A
parameter that has no state yet takes its slots from the checkpoint
(:class:`~popdist_lite.checkpoint.Allocate`), each accepted only with the live
parameter's shape (or as a scalar, the step counters) and a numeric dtype in the
machine's byte order (the bits of a ``bfloat16`` as ``uint16``), checked before anything
is allocated, so what a load allocates is bounded by the live parameters. DCP instead initialises the state with a
step of zero gradients at learning rate 0 and loads into it; that step is not neutral
(``SGD`` with ``dampening`` makes its first momentum buffer differently from the first
real step, weight decay and step counters run) and would change an optimizer whose
checkpoint has no state yet, so it is not taken here.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from popdist_lite.checkpoint import Allocate, Partition, register_adapter
from popdist_lite.checkpoint.state import is_json

from .data_parallel import DistributedDataParallel
from .collection import _CollectionModule
from .embedding import _HostTableModule

__all__ = ["TensorState", "ModuleState", "OptimizerState"]

_BITS = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}
_ARRAY = "array"


def host_view(t: torch.Tensor, what: str) -> tuple[np.ndarray, str]:
    """``(array, kind)``: a numpy view of ``t``'s memory and ``"array"``, or for dtypes
    numpy lacks a view of its bits and ``"bits:<dtype>"``.

    Raises:
        TypeError: ``t`` is not a dense CPU tensor (naming ``what``).
    """
    if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized:
        raise TypeError(f"{what}: a {t.device.type} {t.layout} tensor{' (quantized)' if t.is_quantized else ''} "
                        f"cannot be saved (dense CPU tensors only)")
    t, kind = t.detach(), _kind_of(t)
    return (t.numpy() if kind == _ARRAY else t.view(_BITS[t.element_size()]).numpy()), kind


def tensor_of(array: np.ndarray, kind: str) -> torch.Tensor:
    """The tensor sharing ``array``'s memory, of the dtype ``kind`` names (checked)."""
    t = torch.from_numpy(array)
    return t if kind == _ARRAY else t.view(getattr(torch, kind.removeprefix("bits:")))


def _kind_of(t: torch.Tensor) -> str:
    """``"array"`` for a dtype numpy has, else ``"bits:<dtype>"``."""
    return _ARRAY if t.dtype in _NUMPY_DTYPES else f"bits:{str(t.dtype).removeprefix('torch.')}"


_NUMPY_DTYPES = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16,
                 torch.uint32, torch.uint64, torch.float16, torch.float32, torch.float64, torch.complex64,
                 torch.complex128}


def _listed(names) -> str:
    names = sorted(names)
    return ", ".join(map(repr, names[:6])) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


class TensorState:
    """A tensor in checkpoints: one replicated array, its own memory (module docstring)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def checkpoint_info(self) -> dict:
        return {"type": "torch.Tensor", "kind": _kind_of(self.tensor)}

    def state_dict(self) -> np.ndarray:
        return host_view(self.tensor, "tensor")[0]

    def validate_state_dict(self, state_dict, saved) -> None:
        """Refuse a tensor saved as another dtype of the same width (bfloat16 bits into
        int16).

        Raises:
            ValueError: naming the entry and both kinds.
        """
        kind = _kind_of(self.tensor)
        if saved.info.get("kind", _ARRAY) != kind:
            raise ValueError(f"tensor {saved.name!r} was saved as {saved.info.get('kind')!r}, the live tensor is "
                             f"{kind!r}")

    def load_state_dict(self, state_dict) -> None:
        """Nothing left to do: the tensor's memory was filled in place."""


class ModuleState:
    """A ``torch.nn.Module`` in checkpoints (module docstring): its ``state_dict()``'s
    tensors by their fully qualified names, and its host embeddings' tables.

    Raises (from ``save_checkpoint`` / ``load_checkpoint``, on every replica):
        TypeError: a ``state_dict()`` entry that is not a dense CPU tensor (extra state).
        CheckpointError: the checkpoint lacks one of the module's tensors or tables, has
            one the module has not, or holds one of another shape, dtype or kind.
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def _parts(self) -> tuple[dict[str, torch.Tensor], dict]:
        tables = {name: _tables_of(m) for name, m in self.module.named_modules()
                  if isinstance(m, (_HostTableModule, _CollectionModule))}
        tensors = {}
        for name, value in self.module.state_dict(keep_vars=True).items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"module {type(self.module).__name__}: state_dict() entry {name!r} is a "
                                f"{type(value).__name__}; only tensors can be saved")
            tensors[name] = value
        return tensors, tables

    def checkpoint_info(self) -> dict:
        """The manifest's entry: the class, every tensor's kind, the tables' names."""
        tensors, tables = self._parts()
        return {"type": "torch.nn.Module", "class": type(self.module).__name__,
                "tensors": {name: _kind_of(t) for name, t in tensors.items()}, "tables": sorted(tables)}

    def state_dict(self) -> dict:
        tensors, tables = self._parts()
        tree: dict = {name: host_view(t, f"module {type(self.module).__name__}: {name!r}")[0]
                      for name, t in tensors.items()}
        tree.update(tables)
        return tree

    def validate_state_dict(self, state_dict, saved) -> None:
        """Refuse a checkpoint with tensors or tables the live module has not (one it
        lacks is refused as a missing array or state before this runs), or a tensor
        saved as another dtype of the same width.

        Raises:
            ValueError: naming the module's entry and the tensors that differ.
        """
        where = f"module {saved.name!r}"
        theirs, their_tables = saved.info.get("tensors"), saved.info.get("tables")
        if not isinstance(theirs, dict) or not all(isinstance(v, str) for v in theirs.values()) \
                or not isinstance(their_tables, list):
            raise ValueError(f"{where}: the checkpoint's entry lists no tensors and tables")
        tensors, tables = self._parts()
        mine = {name: _kind_of(t) for name, t in tensors.items()}
        extra = (set(theirs) - set(mine)) | (set(their_tables) - set(tables))
        if extra:
            raise ValueError(f"{where}: the checkpoint has {_listed(extra)}, which the live module has not (a module "
                             f"loads whole, as torch's load_state_dict(strict=True))")
        for name, kind in mine.items():
            if theirs[name] != kind:
                raise ValueError(f"{where}: tensor {name!r} was saved as {theirs[name]!r}, the live one is {kind!r}")

    def load_state_dict(self, state_dict) -> None:
        """Nothing left to do: tensors were filled in place, tables load themselves."""


class OptimizerState:
    """A ``torch.optim.Optimizer`` in checkpoints (module docstring)::

        {"tensors": {"<index>": {slot: array}},   # live state, loaded in place; Allocate
                                                   # for a parameter without state yet
         "values": {"<index>": {slot: JSON}},     # non-tensor state
         "param_groups": [...]}                   # optimizer.state_dict()'s, as JSON

    Raises (from ``save_checkpoint`` / ``load_checkpoint``, on every replica):
        TypeError: state that is neither a dense CPU tensor nor a JSON value (``LBFGS``'s
            history lists), or a hyperparameter that is not JSON.
        CheckpointError: another optimizer class, other parameter groups or settings,
            other slots for a parameter that has state, a slot whose shape is neither the
            parameter's nor a scalar, or arrays of another shape or dtype.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._kinds: dict[str, dict[str, str]] = {}  # live state: index -> slot -> kind ("value": JSON)
        self._saved: dict = {}  # the checkpoint's, once validated

    def _layout(self):
        """``(torch's state_dict, the parameters in its index order)``."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return self.optimizer.state_dict(), params

    def checkpoint_info(self) -> dict:
        sd, _ = self._layout()
        slots = {str(i): {slot: (_kind_of(v) if isinstance(v, torch.Tensor) else "value") for slot, v in s.items()}
                 for i, s in sd["state"].items()}
        return {"type": f"torch.optim.{type(self.optimizer).__name__}", "slots": slots}

    def state_dict(self) -> dict:
        sd, params = self._layout()
        cls = type(self.optimizer).__name__
        tensors: dict = {}
        values: dict = {}
        self._kinds = {}
        for index, slots in sd["state"].items():
            key = str(index)
            for slot, v in slots.items():
                what = f"optimizer {cls}: parameter {index}'s state {slot!r}"
                if isinstance(v, torch.Tensor):
                    array, kind = host_view(v, what)
                    tensors.setdefault(key, {})[slot] = array
                elif is_json(v):
                    values.setdefault(key, {})[slot], kind = v, "value"
                else:
                    raise TypeError(f"{what} is a {type(v).__name__}: only tensors and JSON values can be saved")
                self._kinds.setdefault(key, {})[slot] = kind
        for index, p in enumerate(params):
            if str(index) not in tensors:  # no state yet: taken from the checkpoint, checked against p
                tensors[str(index)] = Allocate(Partition("replicated"), partial(_check_slot, index, p))
        groups = [{k: _hyperparameter(cls, g, k, v) for k, v in group.items()} for g, group in
                  enumerate(sd["param_groups"])]
        return {"tensors": tensors, "values": values, "param_groups": groups}

    def validate_state_dict(self, state_dict: dict, saved) -> None:
        """Refuse other parameter groups or settings, other slots for a parameter that
        has state, or slots of kinds the parameter cannot have, before anything changes
        (another optimizer class is refused by its entry's type, ``torch.optim.Adam``).

        Raises:
            ValueError: naming the optimizer's entry, what the checkpoint holds and what
                the live optimizer has.
        """
        where = f"optimizer {saved.name!r}"
        slots = saved.info.get("slots")
        if not isinstance(slots, dict) or not all(
                isinstance(kinds, dict) and all(isinstance(kind, str) for kind in kinds.values())
                for kinds in slots.values()):
            raise ValueError(f"{where}: the checkpoint's entry lists no slots (parameter index -> slot -> kind)")
        sd, params = self._layout()
        _check_groups(where, state_dict.get("param_groups"), sd["param_groups"])
        for key, kinds in self._kinds.items():
            if slots.get(key) != kinds:
                raise ValueError(f"{where}: parameter {key} has the state {sorted(kinds)}, the checkpoint has "
                                 f"{sorted(slots.get(key, {}))} for it")
        values = state_dict.get("values")
        if not isinstance(values, dict):
            raise ValueError(f"{where}: the checkpoint's non-tensor state is not a dict")
        for key, found in (*values.items(), *state_dict.get("tensors", {}).items()):
            if not key.isdecimal() or int(key) >= len(params) or not isinstance(found, dict):
                raise ValueError(f"{where}: the checkpoint holds state for parameter {key!r}; the optimizer has "
                                 f"{len(params)} parameters")
        for key, found in values.items():
            for slot, v in found.items():
                if slots.get(key, {}).get(slot) != "value" or not (v is None or isinstance(v, (bool, int, float, str))):
                    raise ValueError(f"{where}: parameter {key}'s state {slot!r}: expected a number, got {v!r}")
        for key, arrays in state_dict.get("tensors", {}).items():
            if key in self._kinds:
                continue
            allowed = {_ARRAY, _kind_of(params[int(key)])}
            for slot, array in arrays.items():
                kind = slots.get(key, {}).get(slot)
                if kind not in allowed:
                    raise ValueError(f"{where}: parameter {key}'s state {slot!r} was saved as {kind!r}; expected one "
                                     f"of {sorted(allowed)}")
                _check_tensor_source(f"{where}: parameter {key}'s state {slot!r}", getattr(array, "local", array),
                                     kind)
        for g, (saved, live) in enumerate(zip(state_dict["param_groups"], self.optimizer.param_groups)):
            for k, v in live.items():
                if isinstance(v, torch.Tensor) and k != "params":  # load_state_dict fills it: try on a copy
                    try:
                        torch.empty_like(v).fill_(saved[k])
                    except (RuntimeError, TypeError, ValueError, OverflowError) as exc:
                        raise ValueError(f"{where}: param group {g}: {k!r} is {saved[k]!r} in the checkpoint, which "
                                         f"its {v.dtype} tensor cannot hold ({exc})") from None
        self._saved = slots

    def load_state_dict(self, state_dict: dict) -> None:
        """Hand the filled arrays (as tensors sharing their memory), the JSON state and
        the hyperparameters to the optimizer's own ``load_state_dict``."""
        state: dict = {}
        for key, arrays in state_dict.get("tensors", {}).items():
            for slot, a in arrays.items():
                kind = self._saved.get(key, {}).get(slot, _ARRAY)
                state.setdefault(int(key), {})[slot] = tensor_of(getattr(a, "local", a), kind)
        for key, found in state_dict.get("values", {}).items():
            state.setdefault(int(key), {}).update(found)
        groups = []
        for saved, live in zip(state_dict["param_groups"], self.optimizer.param_groups):
            group = dict(saved)
            for k, v in live.items():
                if k == "params":
                    continue
                if isinstance(v, torch.Tensor):  # a tensor hyperparameter keeps its tensor
                    v.fill_(group[k])
                    group[k] = v
                elif isinstance(v, tuple):
                    group[k] = tuple(group[k])
            groups.append(group)
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})


def _hyperparameter(cls: str, g: int, key: str, value):
    """A parameter group's setting as JSON (a one-element tensor as its number)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if not is_json(value):
        raise TypeError(f"optimizer {cls}: param group {g}'s {key!r} is a {type(value).__name__}; only JSON "
                        f"values (numbers, booleans, None, strings, lists) can be saved")
    return value


def _json_kind(value) -> str:
    """What a setting must stay: a flag (``None`` or a bool: ``foreach``, ``fused``), a
    number, a string, a list of so many items."""
    if value is None or isinstance(value, bool):
        return "flag"
    if isinstance(value, (int, float, torch.Tensor)):
        return "number"
    if isinstance(value, str):
        return "string"
    return f"list of {len(value)}" if isinstance(value, (list, tuple)) else type(value).__name__


def _check_groups(where: str, theirs, mine: list[dict]) -> None:
    """Raise ``ValueError`` unless the checkpoint's parameter groups have the live ones'
    parameters and settings, each of the same JSON kind."""
    if not isinstance(theirs, list) or len(theirs) != len(mine):
        got = f"{len(theirs)} parameter groups" if isinstance(theirs, list) else "no parameter groups"
        raise ValueError(f"{where}: the checkpoint has {got}, the live optimizer {len(mine)}")
    for g, (saved, live) in enumerate(zip(theirs, mine)):
        if not isinstance(saved, dict) or set(saved) != set(live):
            got = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
            raise ValueError(f"{where}: param group {g}: the checkpoint has the settings {got}, the live optimizer "
                             f"{sorted(live)}")
        if saved["params"] != live["params"]:
            raise ValueError(f"{where}: param group {g}: the checkpoint's holds parameters {saved['params']}, the "
                             f"live one {live['params']} (build the optimizer over the same parameters in the same "
                             f"order)")
        for key, value in live.items():
            if key != "params" and _json_kind(saved[key]) != _json_kind(value):
                raise ValueError(f"{where}: param group {g}: {key!r} is {saved[key]!r} in the checkpoint; the live "
                                 f"optimizer's is a {_json_kind(value)}")


def _check_slot(index: int, param: torch.Tensor, relative: str, shape: tuple, dtype: np.dtype) -> None:
    """Accept a checkpoint's slot for a parameter that has no state yet: the parameter's
    shape or a scalar, a numeric dtype in native byte order (checked before anything is
    allocated for it)."""
    if "/" in relative:
        raise ValueError(f"parameter {index}: {relative!r} is not a slot name")
    if tuple(shape) not in (tuple(param.shape), ()):
        raise ValueError(f"parameter {index} has shape {list(param.shape)}: a slot of its optimizer state has that "
                         f"shape or is a scalar, the checkpoint's {relative!r} has {list(shape)}")
    if np.dtype(dtype).kind not in "biuf" or not np.dtype(dtype).isnative:
        raise ValueError(f"parameter {index}'s state {relative!r}: expected a numeric dtype in the machine's byte "
                         f"order, got {np.dtype(dtype).str}")


def _check_tensor_source(what: str, array: np.ndarray, kind: str) -> None:
    """Raise ``ValueError`` unless :func:`tensor_of` takes an array of ``array``'s dtype
    as ``kind`` and keeps its shape: native byte order, a dtype torch has, and for
    ``"bits:<dtype>"`` the unsigned integers of that dtype's width. Tried on a
    one-element array of the dtype (``array`` may be a placeholder of a claim)."""
    dtype = array.dtype
    if kind != _ARRAY:
        width = torch.empty((), dtype=getattr(torch, kind.removeprefix("bits:"))).element_size()
        if dtype != np.dtype(f"=u{width}"):
            raise ValueError(f"{what}: the bits of a {kind.removeprefix('bits:')} are uint{8 * width}, the "
                             f"checkpoint holds {dtype}")
    if not dtype.isnative:
        raise ValueError(f"{what}: the checkpoint holds {dtype.str} (byte order {dtype.byteorder!r}); torch tensors "
                         f"take the machine's byte order only")
    try:
        tensor_of(np.zeros(1, dtype), kind)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"{what}: the checkpoint's {dtype} makes no tensor ({exc})") from None


def _tables_of(module: torch.nn.Module):
    """What a host embedding module is saved as: its table, or a collection's core
    collection (its tables and plan)."""
    return module.table if isinstance(module, _HostTableModule) else module.core


def _module_adapter(module: torch.nn.Module):
    """A module's adapter: wrappers are saved as what they wrap; a host embedding
    module as its table, a collection module as the core's collection."""
    while isinstance(module, (DistributedDataParallel, torch.nn.parallel.DistributedDataParallel)):
        module = module.module
    if isinstance(module, (_HostTableModule, _CollectionModule)):
        return _tables_of(module)
    return ModuleState(module)


register_adapter(torch.Tensor, TensorState)
register_adapter(torch.nn.Module, _module_adapter)
register_adapter(torch.optim.Optimizer, OptimizerState)
