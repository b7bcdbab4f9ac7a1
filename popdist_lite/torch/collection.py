"""Collections of sharded tables as ``torch.nn.Module``\\ s at TorchRec's names:
:class:`EmbeddingBagCollection` (pooled features in, a ``KeyedTensor`` out) and
:class:`EmbeddingCollection` (sequence features in, a ``JaggedTensor`` per feature out).

Each module is a thin layer over the core's collection (:class:`popdist_lite.EmbeddingBagCollection`,
:class:`popdist_lite.EmbeddingCollection`, the module's :attr:`~_CollectionModule.core`):
the tables are stacked and placed by the core's plan (row-wise, column-wise, table-wise,
data-parallel), and one lookup of every feature is one call of the core's exchange (one
agreement, one all-to-all of IDs and one of rows, whatever the number of tables). The
lookup is one ``torch.autograd.Function`` (:class:`_CollectionLookup`), as for
:class:`popdist_lite.torch.HostEmbedding`: its forward is the core's
:meth:`~popdist_lite.TableCollection.forward`, its backward the core's
:meth:`~popdist_lite.TableCollection.backward` (one agreement, one all-to-all of gradient
sums), which applies every table's optimizer spec on the replicas that hold its rows
and returns no gradient. That is how FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen``
(TorchRec's fused tables) and the TF-IPU host-embedding guide's lookup gradient work.

Inputs and outputs are TorchRec's own types when the input is one: a
``torchrec.KeyedJaggedTensor`` in gives a ``torchrec.KeyedTensor``
(:class:`EmbeddingBagCollection`) or ``{feature: torchrec.JaggedTensor}``
(:class:`EmbeddingCollection`) out. A plain mapping of feature name to ``(values,
lengths[, weights])`` tensors, or the library's :class:`popdist_lite.KeyedJaggedArray`
(its ``KeyedJaggedTensor`` of numpy arrays: the keyed layout, checked at once for every
feature), gives a plain ``{feature: (B, e) tensor}`` (what ``KeyedTensor.to_dict()``
gives) or ``{feature: (values, lengths)}``, with or without torchrec installed. torchrec
is never imported here: its types are recognised through the modules the caller already
imported (``sys.modules``).

Tensors cross into the core without copies (``Tensor.numpy()`` views, ``torch.from_numpy``
of the outputs), and the binding adds no collective to a step and no work per table.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Mapping

import numpy as np
import torch

import popdist_lite as pl
from popdist_lite.collectives import Problem

from ._agree import agree_signatures
from .embedding import _numpy

__all__ = ["EmbeddingBagCollection", "EmbeddingCollection"]

_OPS = ("mean", "sum")
_OUTPUT_DTYPES = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}
_JAGGED = "torchrec.sparse.jagged_tensor"  # where TorchRec's KeyedJaggedTensor, KeyedTensor, JaggedTensor live
_CONFIGS = "torchrec.modules.embedding_configs"  # TorchRec's EmbeddingBagConfig, EmbeddingConfig


def _torchrec(module: str, name: str):
    """TorchRec's class ``name`` if the caller has imported it (``None`` otherwise)."""
    found = sys.modules.get(module)
    return getattr(found, name, None) if found is not None else None


class _Refused(Mapping):
    """A batch refused on this replica, handed to the core's lookup in place of the
    features: reading it raises ``error``, which the core's input check turns into the
    same error on every replica, carried by the lookup's own agreement (the binding
    adds no collective for its own checks)."""

    def __init__(self, error: Exception):
        self._error = error

    def _raise(self, *args):
        raise self._error

    __getitem__ = __iter__ = __len__ = __contains__ = _raise


class _CollectionLookup(torch.autograd.Function):
    """forward(anchor, module, features, *tensors) = the core's lookup of ``features``
    (a tuple of output tensors); backward applies the core's update with the outputs'
    gradients once (a second backward through a retained graph applies nothing).
    ``tensors`` are the caller's values, lengths and weights, saved so that autograd's
    version counters reject an in-place change between forward and backward."""

    @staticmethod
    def forward(ctx, anchor, module, features, *tensors):
        ctx.module, ctx.applied = module, False
        ctx.save_for_backward(*tensors)
        outputs, ctx.context = module._lookup(features, keep=True)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.saved_tensors  # noqa: B018  (raises if the inputs were modified in place)
        if not ctx.applied:
            ctx.applied = True
            ctx.module._apply_gradients(ctx.context, grads)
            ctx.context = None
        return (None,) * len(ctx.needs_input_grad)


class _CollectionModule(torch.nn.Module):
    """What :class:`EmbeddingBagCollection` and :class:`EmbeddingCollection` share: the
    configs, the core collection, the input conversion, the autograd plumbing, the
    gradient reduction and loss scaling."""

    _core_class = None  # the core's collection class
    _bags = True  # EmbeddingBagConfig s (pooled) or EmbeddingConfig s (sequence)

    def __init__(self, tables, *, device, optimizer, storage, plan, planner, output_dtype, op, grad_scaler, comm,
                 extra: tuple):
        super().__init__()
        pl.init()
        comm = pl.replica_comm() if comm is None else comm
        kind = type(self).__name__
        problem, configs, given = None, [], []
        try:
            given = list(tables)
            configs = _configs(given, self._bags, optimizer, storage)
            _check_options(device, output_dtype, op)
        except (ValueError, TypeError, KeyError) as exc:
            problem = Problem.of(exc)
        agree_signatures(f"popdist_lite.torch.{kind}", (op, str(output_dtype), grad_scaler is not None, *extra),
                         comm, problem)
        #: The core's collection (:class:`popdist_lite.EmbeddingBagCollection` or
        #: :class:`popdist_lite.EmbeddingCollection`): its ``tables``, ``plan``, ``features``.
        self.core = self._core_class(configs, plan=plan, planner=planner, comm=comm)
        self._given = given
        self._device = torch.device("cpu")
        self.output_dtype, self.op, self.grad_scaler = output_dtype, op, grad_scaler
        self._cast = None if output_dtype is None else _OUTPUT_DTYPES[output_dtype]
        self._trainable = any(c.trainable for c in configs)
        self._comm = comm
        # A zero-element leaf that requires a gradient: autograd calls the lookup's
        # backward only when an input does. Not a Parameter: nothing else sees it.
        self._anchor = torch.empty(0, requires_grad=True)

    # -- TorchRec's accessors -----------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """``cpu``: the tables are host tables, and outputs are CPU tensors."""
        return self._device

    @property
    def tables(self) -> dict:
        """Table name -> the core's :class:`popdist_lite.ShardedTable` (``get_embedding_tensor()``,
        ``state()``, ``sharding``)."""
        return self.core.tables

    @property
    def plan(self):
        """The :class:`popdist_lite.ShardingPlan` in force (``print(module.plan)``)."""
        return self.core.plan

    @property
    def feature_names(self) -> list[str]:
        """The features, in output order (the tables' order, then each table's
        ``feature_names``)."""
        return self.core.features

    # -- one step ----------------------------------------------------------------------------
    def forward(self, features):
        batch, tensors, torchrec_input = self._convert(features)
        if self.training and torch.is_grad_enabled() and self._trainable:
            outputs = _CollectionLookup.apply(self._anchor, self, batch, *tensors)
        else:
            outputs, _ = self._lookup(batch, keep=False)
        return self._wrap(outputs, batch, torchrec_input)

    def _lookup(self, batch, keep: bool):
        """The core's lookup: ``(output tensors, context)``. Collective."""
        outputs, context = self.core.forward(batch, keep=keep)
        return self._tensors(outputs), context

    def _apply_gradients(self, context, grads: tuple) -> None:
        """The core's update with the outputs' gradients (scaled by the loss scale when a
        :class:`GradScaler` is attached). Collective."""
        arrays = tuple(g.detach().contiguous().numpy() for g in grads)
        scale = 1.0
        if self.grad_scaler is not None:
            scale = self.grad_scaler.get_scale()
            if self.grad_scaler._found_overflow(*arrays):
                return  # every replica skips: the verdict is agreed
        if self.op == "mean":
            scale *= self._comm.size
        self.core.backward(context, self._core_grads(arrays), loss_scale=scale)

    def _convert(self, features):
        """``(batch for the core, tensors to save, whether the input is TorchRec's)``;
        a batch this replica refuses becomes a :class:`_Refused` (raised on every
        replica by the core's lookup). Local."""
        kjt = _torchrec(_JAGGED, "KeyedJaggedTensor")
        try:
            if kjt is not None and isinstance(features, kjt):
                return (*self._from_kjt(features), True)
            if isinstance(features, pl.KeyedJaggedArray):  # the library's own (numpy) KeyedJaggedTensor
                if features.weights is not None and not self._uses_weights():
                    features = pl.KeyedJaggedArray(features.keys, features.values, features.lengths)
                return features, (), False
            if isinstance(features, Mapping):
                return (*self._from_mapping(features), False)
        except (ValueError, TypeError, KeyError) as exc:
            return _Refused(exc), (), isinstance(features, kjt) if kjt is not None else False
        return features, (), False  # the core names what it expected and what came

    def _from_kjt(self, kjt):
        if kjt.variable_stride_per_key():
            raise ValueError("argument features: a KeyedJaggedTensor with a variable batch size per feature is not "
                             "supported; every feature needs the same stride")
        values, lengths = kjt.values(), kjt.lengths()
        if self._uses_weights() and kjt.weights_or_none() is None:
            raise ValueError("argument features: is_weighted=True, so expected a KeyedJaggedTensor with weights, got "
                             "one without")
        weights = self._weights(kjt.weights_or_none(), "the KeyedJaggedTensor's")
        tensors = tuple(t for t in (values, lengths, weights) if t is not None)
        return pl.KeyedJaggedArray(kjt.keys(), _numpy(values), _numpy(lengths),
                                   None if weights is None else _numpy(weights)), tensors

    def _from_mapping(self, features: Mapping):
        jagged = _torchrec(_JAGGED, "JaggedTensor")
        batch, tensors = {}, []
        for name, item in features.items():
            if jagged is not None and isinstance(item, jagged):
                item = (item.values(), item.lengths(), item.weights_or_none())
            if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
                batch[name] = item  # the core names what it expected and what came
                continue
            weights = self._weights(item[2] if len(item) == 3 else None, f"feature {name!r}:")
            tensors.extend(t for t in (item[0], item[1], weights) if isinstance(t, torch.Tensor))
            batch[name] = (_numpy(item[0]), _numpy(item[1])) + (() if weights is None else (_numpy(weights),))
        return batch, tuple(tensors)

    def _weights(self, weights, where: str):
        """The weights the lookup uses: ``None`` where the module takes none."""
        if weights is None or not self._uses_weights():
            return None
        if isinstance(weights, torch.Tensor) and weights.requires_grad:
            raise ValueError(f"{where} weights require a gradient; they are constants of the lookup (no gradient "
                             f"reaches them)")
        return weights

    def _uses_weights(self) -> bool:
        return False

    def extra_repr(self) -> str:
        return (f"tables={[c.name for c in self.core.configs]}, features={self.core.features}, "
                f"plan={ {k: v.sharding_type.value for k, v in self.core.plan.shardings.items()} }, "
                f"output_dtype={self.output_dtype}, op={self.op!r}")


class EmbeddingBagCollection(_CollectionModule):
    """TorchRec's ``EmbeddingBagCollection`` over host tables sharded across the
    replicas: pooled features, updated in the backward pass by each table's optimizer
    spec. Collective to create (every replica the same arguments).

    Args:
        tables: the tables: :class:`popdist_lite.EmbeddingBagConfig` s (every option:
            optimizer spec, master weights, stochastic rounding, ID limits, initializer,
            disk storage) or TorchRec's own ``torchrec.EmbeddingBagConfig`` s
            (``num_embeddings``, ``embedding_dim``, ``name``, ``feature_names`` (empty:
            the table's name), ``pooling`` ``SUM``/``MEAN``, ``data_type`` ``FP32``/``FP16``
            (a float16 table with stochastic rounding on, as FBGEMM's default), the
            initial values uniform in ``[weight_init_min, weight_init_max)``
            (TorchRec's defaults: ``-+sqrt(1 / num_embeddings)``) from the library's
            counter-based blocks of each table's own seed (from its name: ``seed=None``
            of :class:`popdist_lite.EmbeddingBagConfig`), the same at every replica
            count, placement and position; a custom ``init_fn`` is called on a
            float32 tensor of the whole table, the same on every replica).
        is_weighted: TorchRec's: pool with the input's per-ID weights (a ``SUM`` bag is
            ``sum_i w_i row_i``, a ``MEAN`` bag divides by the bag's weight sum);
            otherwise weights in the input are ignored.
        device: ``None``, ``"cpu"`` or ``"meta"`` (TorchRec's idiom before
            ``DistributedModelParallel``, accepted as is): the tables always live on
            the hosts, and outputs are CPU tensors.
        optimizer: the optimizer spec (``popdist_lite.HostEmbedding*OptimizerSpec``:
            SGD, SGD-GA, momentum, Adagrad element-wise or row-wise, Adam) of every table
            whose config has none, or a mapping of table name to spec. A table without
            a spec (or a learning rate of 0) is not trainable.
        storage: a :class:`popdist_lite.DiskStorage` for every table whose config has
            none, or a mapping of table name to one: those tables' rows live on local
            disk behind a cache (docs/offload.md).
        plan: placements the planner must keep: a :class:`popdist_lite.ShardingPlan`
            or a mapping of table name to a :class:`popdist_lite.ParameterSharding` or a
            sharding type name (``"row_wise"``, ``"column_wise"``, ``"table_wise"``,
            ``"data_parallel"``); the planner places the others.
        planner: a :class:`popdist_lite.EmbeddingShardingPlanner` (default: the
            core's, for this replica count and the replicas' memory).
        output_dtype: the outputs' dtype (``torch.float32``, TorchRec's: its
            collections return float32 for float16 tables too; ``torch.float16``,
            ``torch.float64``, or ``None``: the tables' widest lookup dtype).
        op: how the replicas' gradients combine: ``"mean"`` (default: the gradient of
            the mean of the replicas' losses, what ``DistributedDataParallel`` gives the
            dense layers and what TorchRec's sharded tables get) or ``"sum"``.
        grad_scaler: a :class:`popdist_lite.torch.GradScaler` when the loss is scaled
            (the update divides by its scale and skips on every replica when any
            replica's gradient has an inf or NaN).
        comm: the replica communicator (default: the library's).

    Forward ``(features)``: a ``torchrec.KeyedJaggedTensor`` whose keys are exactly the
    collection's features (any order, one stride ``B``), a
    :class:`popdist_lite.KeyedJaggedArray` alike, or a mapping of every feature name to
    ``(values, lengths[, weights])`` (integer ``values`` ``[n]``, ``lengths`` ``[B]``,
    float ``weights`` ``[n]``; or a ``torchrec.JaggedTensor``). Returns, for a
    ``torchrec.KeyedJaggedTensor``, a ``torchrec.KeyedTensor`` (keys
    :attr:`feature_names`, values ``(B, sum of dims)``), otherwise ``{feature: (B, e)
    tensor}`` (views of one ``(B, sum of dims)`` tensor). Collective: the core's lookup.

    Training: in training mode with gradients enabled (and a trainable table), the
    backward of the output applies one optimizer step to the rows looked up: per row,
    every replica's gradients summed (over features, bags and replicas), divided by the
    replica count for ``op="mean"``, stepped once by the replicas holding the row.
    Under ``torch.no_grad()`` or in eval mode, a lookup records nothing and never
    updates. The module has no ``nn.Parameter``: ``torch.optim`` optimizers,
    ``clip_grad_norm_`` and ``DistributedDataParallel`` never see the tables;
    checkpoints hold them through ``popdist_lite.save_checkpoint`` (docs/torch.md).

    Raises:
        ValueError, TypeError, KeyError: on every replica, for any replica's bad
            configs or arguments at construction, or a missing or unknown feature or a
            malformed batch in a lookup (naming the replica and the feature).
        IndexError: on every replica, for an ID outside its table.
    """

    _core_class = pl.EmbeddingBagCollection
    _bags = True

    def __init__(self, tables, is_weighted: bool = False, device=None, *, optimizer=None, storage=None, plan=None,
                 planner=None, output_dtype=torch.float32, op: str = "mean", grad_scaler=None, comm=None):
        super().__init__(tables, device=device, optimizer=optimizer, storage=storage, plan=plan, planner=planner,
                         output_dtype=output_dtype, op=op, grad_scaler=grad_scaler, comm=comm,
                         extra=(bool(is_weighted),))
        self._is_weighted = bool(is_weighted)
        self._dims = [self.core.configs[f.table].embedding_dim for f in self.core._features]

    def is_weighted(self) -> bool:
        """Whether lookups pool with the input's weights (TorchRec's ``is_weighted()``)."""
        return self._is_weighted

    def embedding_bag_configs(self) -> list:
        """The table configs as given (TorchRec's ``embedding_bag_configs()``)."""
        return list(self._given)

    def _uses_weights(self) -> bool:
        return self._is_weighted

    def _tensors(self, keyed) -> tuple:
        values = keyed.values if self._cast is None else keyed.values.astype(self._cast, copy=False)
        return (torch.from_numpy(values),)

    def _core_grads(self, arrays: tuple) -> np.ndarray:
        return arrays[0]  # (B, sum of dims), the core's keyed layout

    def _wrap(self, outputs: tuple, batch, torchrec_input: bool):
        (values,) = outputs
        if torchrec_input:
            keyed = _torchrec(_JAGGED, "KeyedTensor")
            return keyed(keys=list(self.core.features), length_per_key=list(self._dims), values=values, key_dim=1)
        return dict(zip(self.core.features, torch.split(values, self._dims, dim=1)))


class EmbeddingCollection(_CollectionModule):
    """TorchRec's ``EmbeddingCollection`` over host tables sharded across the replicas:
    sequence features, one row per ID, updated in the backward pass (see
    :class:`EmbeddingBagCollection` for the tables, training and errors).

    Args:
        tables: :class:`popdist_lite.EmbeddingConfig` s or TorchRec's
            ``torchrec.EmbeddingConfig`` s (mapped as :class:`EmbeddingBagCollection`
            maps TorchRec's bag configs; the tables' dims may differ).
        device: as :class:`EmbeddingBagCollection`.
        need_indices: TorchRec's: each output ``JaggedTensor`` carries the input IDs as
            its ``weights``.
        optimizer, storage, plan, planner, output_dtype, op, grad_scaler, comm: as
            :class:`EmbeddingBagCollection`.

    Forward ``(features)``: as :class:`EmbeddingBagCollection` (weights are ignored).
    Returns, for a ``torchrec.KeyedJaggedTensor``, ``{feature: torchrec.JaggedTensor(values=(n,
    e), lengths=(B,))}``, otherwise ``{feature: (values (n, e), lengths (B,))}``.
    Collective: the core's lookup.
    """

    _core_class = pl.EmbeddingCollection
    _bags = False

    def __init__(self, tables, device=None, need_indices: bool = False, *, optimizer=None, storage=None, plan=None,
                 planner=None, output_dtype=torch.float32, op: str = "mean", grad_scaler=None, comm=None):
        super().__init__(tables, device=device, optimizer=optimizer, storage=storage, plan=plan, planner=planner,
                         output_dtype=output_dtype, op=op, grad_scaler=grad_scaler, comm=comm,
                         extra=(bool(need_indices),))
        self._need_indices = bool(need_indices)

    def need_indices(self) -> bool:
        """Whether outputs carry the input IDs as weights (TorchRec's ``need_indices()``)."""
        return self._need_indices

    def embedding_configs(self) -> list:
        """The table configs as given (TorchRec's ``embedding_configs()``)."""
        return list(self._given)

    def embedding_names_by_table(self) -> list[list[str]]:
        """Each table's features (TorchRec's ``embedding_names_by_table()``)."""
        return [list(c.feature_names) for c in self.core.configs]

    def embedding_dim(self) -> int:
        """The tables' common ``embedding_dim`` (TorchRec's ``embedding_dim()``).

        Raises:
            ValueError: the tables' dims differ (TorchRec requires one dim).
        """
        dims = {c.embedding_dim for c in self.core.configs}
        if len(dims) != 1:
            raise ValueError(f"EmbeddingCollection.embedding_dim: the tables' dims differ: {sorted(dims)}")
        return dims.pop()

    def _tensors(self, outputs: dict) -> tuple:
        cast = self._cast
        return tuple(torch.from_numpy(j.values if cast is None else j.values.astype(cast, copy=False))
                     for j in outputs.values())

    def _core_grads(self, arrays: tuple) -> dict:
        return dict(zip(self.core.features, arrays))

    def _wrap(self, outputs: tuple, batch, torchrec_input: bool):
        lengths, ids = _lengths_and_ids(batch, self.core.features)
        if torchrec_input:
            jagged = _torchrec(_JAGGED, "JaggedTensor")
            return {name: jagged(values=v, lengths=torch.from_numpy(lengths[name]),
                                 weights=torch.from_numpy(ids[name]) if self._need_indices else None)
                    for name, v in zip(self.core.features, outputs)}
        return {name: (v, torch.from_numpy(lengths[name])) for name, v in zip(self.core.features, outputs)}


def _lengths_and_ids(batch, names: list) -> tuple[dict, dict]:
    """Every feature's lengths and IDs (numpy views) of a converted batch."""
    if isinstance(batch, pl.KeyedJaggedArray):
        parts = batch.to_dict()
        return {n: parts[n].lengths for n in names}, {n: parts[n].values for n in names}
    return {n: np.asarray(batch[n][1]) for n in names}, {n: np.asarray(batch[n][0]) for n in names}


# -- configs -----------------------------------------------------------------------------------
def _configs(tables: list, bags: bool, optimizer, storage) -> list:
    """The core's configs of ``tables`` (ours or TorchRec's), with the constructor's
    ``optimizer`` and ``storage`` filled in.

    Raises:
        ValueError, TypeError: a config that is neither, a TorchRec option that has no
            equivalent, a per-table mapping naming no table, or a table whose config
            and the constructor both set the same option.
    """
    names = [getattr(c, "name", None) for c in tables]
    per_table = {}
    for arg, value in (("optimizer", optimizer), ("storage", storage)):
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - set(names))
            if unknown:
                raise ValueError(f"argument {arg}: no table {unknown[0]!r} in this collection (tables: {names})")
        per_table[arg] = value
    out = []
    for c in tables:
        config = c if isinstance(c, pl.EmbeddingConfig) else _from_torchrec(c, bags)
        changes = {}
        for arg, value in per_table.items():
            mine = value.get(config.name) if isinstance(value, Mapping) else value
            if mine is None:
                continue
            if getattr(config, arg) is not None:
                if isinstance(value, Mapping):
                    raise ValueError(f"argument {arg}: table {config.name!r} has its own {arg} in its config; give it "
                                     f"in one place")
                continue  # the config's own
            changes[arg] = mine
        out.append(dataclasses.replace(config, **changes) if changes else config)
    return out


def _from_torchrec(c, bags: bool):
    """Our config of TorchRec's ``EmbeddingBagConfig`` / ``EmbeddingConfig`` ``c``
    (the docstring of :class:`EmbeddingBagCollection`)."""
    base = _torchrec(_CONFIGS, "BaseEmbeddingConfig")
    if base is None or not isinstance(c, base):
        raise TypeError(f"argument tables: expected popdist_lite or torchrec EmbeddingBagConfig / EmbeddingConfig s, "
                        f"got {type(c).__name__}")
    if getattr(c, "use_virtual_table", False):
        raise ValueError(f"table {c.name!r}: use_virtual_table is not supported (a table has num_embeddings rows)")
    if not c.feature_names:
        c.feature_names = [c.name]  # what TorchRec's collections do
    low, high = c.get_weight_init_min(), c.get_weight_init_max()
    initializer = None
    init = c.init_fn
    if isinstance(init, functools.partial) and init.func is torch.nn.init.uniform_ and not init.args \
            and set(init.keywords) <= {"a", "b"}:
        low, high = init.keywords.get("a", 0.0), init.keywords.get("b", 1.0)  # TorchRec's default init_fn
    elif init is not None:
        initializer = functools.partial(_torch_initializer, init)
    fields = dict(num_embeddings=c.num_embeddings, embedding_dim=c.embedding_dim, name=c.name,
                  data_type=c.data_type, feature_names=list(c.feature_names), weight_init_min=float(low),
                  weight_init_max=float(high), initializer=initializer)
    if getattr(c.data_type, "name", None) == "FP16":
        fields["stochastic_rounding"] = "ON"  # FBGEMM's default for float16 weights
    bag = _torchrec(_CONFIGS, "EmbeddingBagConfig")
    if isinstance(c, bag):
        if not bags:
            raise TypeError(f"argument tables: an EmbeddingCollection takes EmbeddingConfig s, got "
                            f"EmbeddingBagConfig {c.name!r}")
        return pl.EmbeddingBagConfig(**fields, pooling=c.pooling)
    if bags:
        raise TypeError(f"argument tables: an EmbeddingBagCollection takes EmbeddingBagConfig s, got "
                        f"{type(c).__name__} {c.name!r}")
    return pl.EmbeddingConfig(**fields)


def _torch_initializer(init_fn, shape, dtype) -> np.ndarray:
    """A TorchRec ``init_fn`` as the core's initializer: called on a float32 tensor of
    the whole table (torch's random generator: seed it alike on every replica)."""
    t = torch.empty(tuple(shape), dtype=torch.float32)
    out = init_fn(t)
    return (out if isinstance(out, torch.Tensor) else t).detach().numpy().astype(dtype, copy=False)


def _check_options(device, output_dtype, op) -> None:
    try:
        kind = None if device is None else torch.device(device).type
    except (RuntimeError, TypeError, ValueError):
        kind = "unknown"
    if kind not in (None, "cpu", "meta"):
        raise ValueError(f"argument device: expected None, 'cpu' or 'meta' (the tables live on the hosts), got "
                         f"{device!r}")
    if output_dtype is not None and output_dtype not in _OUTPUT_DTYPES:
        raise TypeError(f"argument output_dtype: expected torch.float16, torch.float32, torch.float64 or None, "
                        f"got {output_dtype!r}")
    if op not in _OPS:
        raise ValueError(f"argument op: expected 'mean' or 'sum', got {op!r}")
