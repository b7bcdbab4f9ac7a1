"""The tables of a collection, at TorchRec's names: :class:`EmbeddingBagConfig` (pooled
features) and :class:`EmbeddingConfig` (sequence features).

Source: TorchRec's ``torchrec.modules.embedding_configs`` (``BaseEmbeddingConfig``,
``EmbeddingBagConfig``, ``EmbeddingConfig``, ``PoolingType``), whose fields come first
and in TorchRec's order (``num_embeddings``, ``embedding_dim``, ``name``,
``data_type``, ``feature_names``, ``weight_init_max``, ``weight_init_min``; then
``pooling`` for bags), so a TorchRec config written with keywords or positionally
reads the same. popdist-lite's own fields are keyword-only: the host optimizer spec
(applied by the replica that owns each row, in backward), master weights and
stochastic rounding for float16 tables, SparseCore's ID limits, the initializer and
disk storage, as :func:`popdist_lite.create_host_embedding` takes them.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from .storage import as_storage
from .table_spec import TableSpec


class PoolingType(str, Enum):
    """How a bag's rows are pooled (TorchRec's ``PoolingType`` plus SparseCore's
    ``sqrtn``): ``SUM``, ``MEAN`` (divided by the bag's weight sum), ``SQRTN`` (by the
    square root of the sum of squared weights); ``NONE`` for sequence features."""

    SUM = "SUM"
    MEAN = "MEAN"
    SQRTN = "SQRTN"
    NONE = "NONE"


#: TorchRec's data types by name (``DataType.FP32`` ...), as numpy dtypes.
DATA_TYPES = {"FP32": np.dtype(np.float32), "FP16": np.dtype(np.float16), "FP64": np.dtype(np.float64)}


def pooling_of(value) -> PoolingType:
    """A :class:`PoolingType` from itself, its name in any case, or an enum member of
    that name (TorchRec's own ``PoolingType.SUM``).

    Raises:
        ValueError: anything else.
    """
    name = getattr(value, "name", value)
    try:
        return PoolingType(str(name).upper())
    except ValueError:
        raise ValueError(f"argument pooling: expected one of SUM, MEAN, SQRTN, NONE, got {value!r}") from None


def dtype_of(value) -> np.dtype:
    """The numpy dtype of a ``data_type``: a numpy dtype (or anything ``np.dtype``
    takes) or TorchRec's ``DataType`` (its name: ``FP32``, ``FP16``, ``FP64``).

    Raises:
        TypeError: anything else.
    """
    name = getattr(value, "name", value)
    if isinstance(name, str) and name.upper() in DATA_TYPES:
        return DATA_TYPES[name.upper()]
    try:
        return np.dtype(value)
    except TypeError:
        raise TypeError(f"argument data_type: expected a float dtype or FP32/FP16/FP64, got {value!r}") from None


def name_seed(name: str) -> int:
    """The seed of a table left at ``seed=None``: ``2**128`` plus the first 16 bytes of
    the SHA-256 of its name (UTF-8) read as a little-endian integer. Every name has its
    own (so tables of one shape start from different values, whatever their order), and
    none equals an explicit seed below ``2**128``."""
    return (1 << 128) + int.from_bytes(hashlib.sha256(name.encode()).digest()[:16], "little")


@dataclass(frozen=True)
class EmbeddingConfig:
    """One table of a collection whose features are looked up one row per ID (TorchRec's
    ``EmbeddingConfig``: sequence features, no pooling).

    Attributes:
        num_embeddings: rows ``t`` (int >= 1).
        embedding_dim: columns ``e`` (int >= 1).
        name: the table's name (non-empty, unique in its collection).
        data_type: the lookup dtype: ``np.float32`` (default), ``np.float16`` or
            ``np.float64`` (or TorchRec's ``DataType`` names FP32, FP16, FP64). Rows and
            gradients travel in it.
        feature_names: the features read from this table (at least one; names unique
            in the collection); several features share the table's rows.
        weight_init_max, weight_init_min: the default initializer's range (TorchRec's
            names): rows are uniform in ``[min, max)``; both ``None``: ``[-0.05, 0.05)``
            (popdist-lite's default). Either way from counter-based random blocks of
            the table's seed (``seed``, else its name's), so the table is the same at
            every replica count, placement and position in the collection.
        optimizer: a host optimizer spec (:class:`popdist_lite.HostEmbeddingOptimizerSpec`
            and the others), applied in the update by the replica(s) holding each row;
            ``None`` or a learning rate of 0: not trainable.
        master_weights: ``None`` or ``np.float32``/``np.float64``: store and update the
            table in this dtype, serve lookups rounded to ``data_type`` (the mixed
            precision tutorial's FP32 master weights).
        stochastic_rounding: how updated float16 rows are rounded (``None``/``"OFF"``,
            ``"ON"``, ``"REPLICA_IDENTICAL_ONLY"``): see
            :func:`popdist_lite.create_host_embedding`.
        initializer: ``None`` (the seeded uniform above), a full ``(t, e)`` array or
            ``initializer((t, e), dtype) -> array``, the same on every replica.
        seed: the default initializer's and the table's stochastic-rounding streams'
            seed, an int >= 0; ``None`` (default): one of the table's own, from its
            name (:func:`name_seed`), so tables of one shape start from different values
            (TorchRec gives every table its own random initial values) and no explicit
            seed below ``2**128`` gives the same values. ``spec.seed`` is the seed in
            force.
        max_ids_per_partition, max_unique_ids_per_partition, allow_id_dropping,
            enable_minibatching: SparseCore's ID limits for the IDs one replica sends
            to one owner of this table in one call (row-wise and table-wise placements
            only); docs/minibatching.md.
        storage: ``None`` (in memory) or a :class:`popdist_lite.DiskStorage`: the
            table's rows on local disk behind a cache of hot rows (docs/offload.md);
            not with the data-parallel placement.

    Raises:
        ValueError: a bad size, name, feature list, range or limit.
        TypeError: an unsupported dtype, master dtype, optimizer spec or storage.
    """

    num_embeddings: int
    embedding_dim: int
    name: str = ""
    data_type: Any = np.float32
    feature_names: tuple = ()
    weight_init_max: float | None = None
    weight_init_min: float | None = None
    optimizer: Any = field(default=None, kw_only=True)
    master_weights: Any = field(default=None, kw_only=True)
    stochastic_rounding: Any = field(default=None, kw_only=True)
    initializer: Any = field(default=None, kw_only=True, compare=False)
    seed: int | None = field(default=None, kw_only=True)
    max_ids_per_partition: int | None = field(default=None, kw_only=True)
    max_unique_ids_per_partition: int | None = field(default=None, kw_only=True)
    allow_id_dropping: bool = field(default=False, kw_only=True)
    enable_minibatching: bool = field(default=False, kw_only=True)
    storage: Any = field(default=None, kw_only=True)

    def __post_init__(self):
        owner = f"{type(self).__name__} {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"{type(self).__name__}: argument name: expected a non-empty str, got {self.name!r}")
        for arg in ("num_embeddings", "embedding_dim"):
            value = getattr(self, arg)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{owner}: argument {arg}: expected an int >= 1, got {value!r}")
            object.__setattr__(self, arg, int(value))
        names = (self.feature_names,) if isinstance(self.feature_names, str) else tuple(self.feature_names)
        if not names or not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
            raise ValueError(f"{owner}: argument feature_names: expected a non-empty list of distinct feature "
                             f"names, got {self.feature_names!r}")
        object.__setattr__(self, "feature_names", names)
        object.__setattr__(self, "data_type", dtype_of(self.data_type))
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
                raise ValueError(f"{owner}: argument seed: expected None or an int >= 0, got {self.seed!r}")
            object.__setattr__(self, "seed", int(self.seed))
        bounds = (self.weight_init_min, self.weight_init_max)
        if bounds != (None, None):
            ok = all(isinstance(b, (int, float, np.floating, np.integer)) and not isinstance(b, bool)
                     and math.isfinite(b) for b in bounds) and bounds[0] < bounds[1]
            if not ok:
                raise ValueError(f"{owner}: arguments weight_init_min, weight_init_max: expected two finite "
                                 f"numbers with min < max, got {bounds}")
        try:
            spec = self.table_spec()
            disk = as_storage(self.storage)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"{owner}: {exc}") from None
        object.__setattr__(self, "storage", disk)
        object.__setattr__(self, "_spec", spec)

    @property
    def pooling(self) -> PoolingType:
        """``PoolingType.NONE``: one output row per ID."""
        return PoolingType.NONE

    @property
    def trainable(self) -> bool:
        """Whether updates change the table (an optimizer with a learning rate > 0)."""
        return self.optimizer is not None and self.optimizer.trainable

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_embeddings, self.embedding_dim)

    @property
    def spec(self) -> TableSpec:
        """The checked :class:`~popdist_lite.embedding.table_spec.TableSpec` of the table
        (its optimizer, dtypes, rounding and ID limits as a host embedding holds them)."""
        return self._spec

    def table_spec(self) -> TableSpec:
        """A new :class:`TableSpec` from the fields (its own stochastic-rounding streams).

        Raises:
            ValueError, TypeError: as :func:`popdist_lite.create_host_embedding`.
        """
        seed = name_seed(self.name) if self.seed is None else self.seed
        return TableSpec.from_arguments(
            self.name, self.shape, self.data_type, "TOKEN", self.optimizer, seed,
            master_weights=self.master_weights, stochastic_rounding=self.stochastic_rounding,
            max_ids_per_partition=self.max_ids_per_partition,
            max_unique_ids_per_partition=self.max_unique_ids_per_partition,
            allow_id_dropping=self.allow_id_dropping, enable_minibatching=self.enable_minibatching)

    def signature(self) -> tuple:
        """What every replica must pass alike (compared when a collection is created)."""
        return (type(self).__name__, self.name, self.shape, tuple(self.feature_names), self.pooling.value,
                self.weight_init_min, self.weight_init_max, "disk" if self.storage is not None else "memory",
                self.spec.signature())


@dataclass(frozen=True)
class EmbeddingBagConfig(EmbeddingConfig):
    """One table of a collection whose features are bags pooled into one row per bag
    (TorchRec's ``EmbeddingBagConfig``): the fields of :class:`EmbeddingConfig` and

    Attributes:
        pooling: ``"SUM"`` (default), ``"MEAN"`` or ``"SQRTN"`` (a :class:`PoolingType`,
            its name in any case, or TorchRec's ``PoolingType``): bag ``b`` pools to
            ``sum_i w_i row_i / d_b`` with ``d_b`` = 1, the bag's weight sum or the
            square root of its squared weights' sum (SparseCore's combiners), always
            the whole bag's divisor (TorchRec#2362 divided by a shard's part); an empty
            bag pools to zeros.

    Raises:
        ValueError: as :class:`EmbeddingConfig`, or a pooling of ``NONE`` or unknown.
    """

    pooling: Any = PoolingType.SUM

    def __post_init__(self):
        pooling = pooling_of(self.pooling)
        if pooling is PoolingType.NONE:
            raise ValueError(f"EmbeddingBagConfig {self.name!r}: argument pooling: expected SUM, MEAN or SQRTN "
                             f"(use EmbeddingConfig for sequence features), got NONE")
        object.__setattr__(self, "pooling", pooling)
        super().__post_init__()

    @property
    def combiner(self) -> str:
        """The pooling as a combiner name of :mod:`popdist_lite.embedding.combiners`."""
        return self.pooling.value.lower()
