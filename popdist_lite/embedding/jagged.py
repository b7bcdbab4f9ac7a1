"""Jagged batches as numpy arrays, at TorchRec's names: :class:`JaggedArray` (one
feature), :class:`KeyedJaggedArray` (several features keyed by name) and
:class:`KeyedArray` (pooled outputs side by side).

They mirror ``torchrec.sparse.jagged_tensor``'s ``JaggedTensor``, ``KeyedJaggedTensor``
and ``KeyedTensor`` with numpy arrays, so that the PyTorch binding wraps them without
copies (``torch.from_numpy`` / ``Tensor.numpy()`` share memory) and JAX and numpy
programs use them as they are. Layouts are TorchRec's:

- a feature's batch: ``values`` ``int[n]`` (the IDs, bag after bag), ``lengths``
  ``int[B]`` (IDs per bag; bag ``b`` is the next ``lengths[b]`` values) or ``offsets``
  ``int[B + 1]`` (``offsets[0] == 0``, bag ``b`` is ``values[offsets[b]:offsets[b+1]]``),
  optional ``weights`` ``float[n]`` (one per ID);
- a keyed batch: the features' values concatenated key after key, ``lengths``
  ``int[F * B]`` key-major (``lengths.reshape(F, B)[f]`` are feature ``f``'s), one
  ``stride`` ``B`` for every key;
- pooled outputs: ``values`` ``(B, sum of dims)``, feature ``f``'s columns
  ``[offset_f, offset_f + dim_f)`` in key order (``KeyedTensor``'s ``key_dim=1``).

The constructors store what they are given as numpy arrays and check nothing that
could differ between replicas: a collection checks its inputs on every replica at
once (so a bad batch on one replica raises the same error on all of them, never a
hang).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def _array(x) -> np.ndarray | None:
    return None if x is None else np.asarray(x)


@dataclass
class JaggedArray:
    """One feature's jagged batch (TorchRec's ``JaggedTensor``).

    Attributes:
        values: ``int[n]`` IDs (inputs), or ``(n, e)`` rows (a sequence lookup's output).
        lengths: ``int[B]`` values per bag, or ``None`` when ``offsets`` are given.
        offsets: ``int[B + 1]``, or ``None`` when ``lengths`` are given.
        weights: ``float[n]`` per-ID weights, or ``None`` (all 1).
    """

    values: np.ndarray
    lengths: np.ndarray | None = None
    offsets: np.ndarray | None = None
    weights: np.ndarray | None = None

    def __post_init__(self):
        self.values, self.lengths = np.asarray(self.values), _array(self.lengths)
        self.offsets, self.weights = _array(self.offsets), _array(self.weights)

    def lengths_or_offsets(self) -> np.ndarray:
        """``lengths`` (from ``offsets`` when only those were given: ``np.diff``)."""
        return self.lengths if self.lengths is not None else np.diff(self.offsets)

    def to_dense(self) -> list[np.ndarray]:
        """The bags as a list of arrays (``values`` split at the bag boundaries)."""
        lengths = self.lengths_or_offsets()
        return np.split(self.values, np.cumsum(lengths)[:-1]) if lengths.size else []


@dataclass
class KeyedJaggedArray:
    """Several features' jagged batches, keyed by feature name (TorchRec's
    ``KeyedJaggedTensor``): ``keys``, ``values`` of every key concatenated, ``lengths``
    ``int[len(keys) * stride]`` key-major, optional ``weights`` ``float[n]``.

    Make one with :meth:`from_lengths`, :meth:`from_offsets` or :meth:`from_dict`.
    """

    keys: list
    values: np.ndarray
    lengths: np.ndarray
    weights: np.ndarray | None = None

    def __post_init__(self):
        self.keys = list(self.keys)
        self.values, self.lengths, self.weights = np.asarray(self.values), np.asarray(self.lengths), \
            _array(self.weights)

    @classmethod
    def from_lengths(cls, keys, values, lengths, weights=None) -> "KeyedJaggedArray":
        """TorchRec's ``KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights)``."""
        return cls(keys, values, lengths, weights)

    @classmethod
    def from_offsets(cls, keys, values, offsets, weights=None) -> "KeyedJaggedArray":
        """From ``offsets`` ``int[len(keys) * stride + 1]`` into ``values``
        (``KeyedJaggedTensor.from_offsets_sync``)."""
        return cls(keys, values, np.diff(np.asarray(offsets)), weights)

    @classmethod
    def from_dict(cls, batches: dict) -> "KeyedJaggedArray":
        """From ``{key: JaggedArray}`` (every feature's bag count the same), keys in the
        mapping's order: values, lengths and weights concatenated (a copy). Weights
        missing from some features are 1 there."""
        items = [(k, v if isinstance(v, JaggedArray) else JaggedArray(*v)) for k, v in batches.items()]
        weighted = any(j.weights is not None for _, j in items)
        values = np.concatenate([j.values.reshape(-1) for _, j in items]) if items else np.zeros(0, np.int64)
        lengths = np.concatenate([j.lengths_or_offsets() for _, j in items]) if items else np.zeros(0, np.int64)
        weights = np.concatenate([j.weights if j.weights is not None else np.ones(j.values.size)
                                  for _, j in items]) if weighted else None
        return cls([k for k, _ in items], values, lengths, weights)

    def stride(self) -> int:
        """Bags per key ``B`` (``len(lengths) // len(keys)``)."""
        return self.lengths.size // len(self.keys) if self.keys else 0

    def length_per_key(self) -> list[int]:
        """IDs per key."""
        return [int(x) for x in self.lengths.reshape(len(self.keys), -1).sum(axis=1)] if self.keys else []

    def offset_per_key(self) -> list[int]:
        """Where each key's values start in :attr:`values`, and the end (``len(keys) + 1``)."""
        return [0, *np.cumsum(self.length_per_key()).tolist()]

    def to_dict(self) -> dict[str, JaggedArray]:
        """``{key: JaggedArray}``: views of :attr:`values`, :attr:`lengths`, :attr:`weights`."""
        at, b = self.offset_per_key(), self.stride()
        out = {}
        for i, key in enumerate(self.keys):
            part = slice(at[i], at[i + 1])
            out[key] = JaggedArray(self.values[part], self.lengths[i * b:(i + 1) * b],
                                   weights=None if self.weights is None else self.weights[part])
        return out

    def __getitem__(self, key: str) -> JaggedArray:
        return self.to_dict()[key]


@dataclass
class KeyedArray:
    """Pooled outputs side by side (TorchRec's ``KeyedTensor`` with ``key_dim=1``):
    ``values`` ``(B, sum(length_per_key))``, feature ``keys[i]``'s ``(B, length_per_key[i])``
    in columns ``offset_per_key()[i]...``."""

    keys: list
    length_per_key: list
    values: np.ndarray

    def offset_per_key(self) -> list[int]:
        return [0, *np.cumsum(self.length_per_key).tolist()]

    def to_dict(self) -> dict[str, np.ndarray]:
        """``{key: (B, dim) view of values}``."""
        at = self.offset_per_key()
        return {key: self.values[:, at[i]:at[i + 1]] for i, key in enumerate(self.keys)}

    def __getitem__(self, key: str) -> np.ndarray:
        i = self.keys.index(key)
        at = self.offset_per_key()
        return self.values[:, at[i]:at[i + 1]]
