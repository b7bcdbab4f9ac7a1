"""What every part of the JAX binding shares: moving arrays between JAX and the host,
the binding's dedicated communicator, and raising one replica's argument error on
every replica (through the library's agreement, :mod:`popdist_lite.collectives.agreement`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import numpy as np

import popdist_lite as pl
from popdist_lite.calls import numbered, set_lane

if TYPE_CHECKING:  # popdist_lite.collectives imports MPI: imported where a check runs
    from popdist_lite.collectives import Problem

#: What the binding's input checks compare besides the call itself: no array.
_NO_ARRAY = np.zeros(0, np.int8)
_REGISTERED: set[str] = set()  # operation names registered with the agreement

_DEDICATED: dict[int, tuple] = {}  # id(parent) -> (parent, its duplicate)


def dedicated_comm(comm=None):
    """The binding's communicator: a duplicate (``MPI_Comm_dup``) of ``comm`` (default:
    the replica communicator), made once per process and parent (a dedicated
    communicator is its own). Collective on the first call for a parent.

    Every table of the binding and every collective it issues uses it, so the host
    callbacks of the in-jit path (which run on XLA's threads) never share a
    communicator with collectives the program issues on the replica communicator. Its
    calls are numbered on their own and recorded on the stall inspector's ``jax`` lane
    (:func:`popdist_lite.calls.set_lane`), which the inspector compares replica by
    replica apart from the main lane.
    """
    pl.init()
    parent = pl.replica_comm() if comm is None else comm
    if any(dup is parent for _, dup in _DEDICATED.values()):
        return parent
    entry = _DEDICATED.get(id(parent))
    if entry is None:
        entry = _DEDICATED[id(parent)] = (parent, numbered(parent, "comm_dup", parent.Dup))  # keeps the parent alive: its id stays unique
        set_lane(entry[1], "jax")
    return entry[1]


def host_array(x, what: str) -> np.ndarray:
    """``x`` (a numpy or JAX array, or anything ``np.asarray`` takes) as a numpy array;
    no copy for a JAX array on the CPU (a read-only view of its buffer).

    Raises:
        TypeError: ``x`` is a tracer: a host call was made inside ``jax.jit`` (this
            replica only: every replica traces the same program, so every replica
            raises it).
    """
    if isinstance(x, jax.core.Tracer):
        raise TypeError(f"{what}: got a traced value: the split API runs on the host, outside jax.jit "
                        f"(call it between jitted steps, or use EmbeddingCollection.lookup_in_jit inside jit)")
    return np.asarray(x)


def to_jax(a: np.ndarray) -> jax.Array:
    """A host array as a ``jax.Array``, in the dtype JAX uses for it (float64 becomes
    float32 unless ``jax_enable_x64`` is set). Shares ``a``'s memory through DLPack when
    JAX can (callers pass arrays nothing else writes to afterwards), else copies."""
    dtype = jax.dtypes.canonicalize_dtype(a.dtype)
    a = np.asarray(a).astype(dtype, order="C", copy=False)  # (np.ascontiguousarray makes 0-d arrays 1-d)
    try:
        return jax.numpy.from_dlpack(a)
    except (BufferError, TypeError, RuntimeError):  # e.g. a read-only array: DLPack cannot export it
        return jax.device_put(a)


def problem_of(exc: Exception) -> Problem:
    """This replica's exception as the :class:`~popdist_lite.collectives.Problem` every
    replica raises: ``ValueError``, ``TypeError``, ``IndexError`` and ``KeyError`` (and
    their subclasses) keep their class; anything else becomes a ``TypeError`` naming its
    own (an argument of the wrong kind: an ``AttributeError`` from weights that are not a
    mapping, say)."""
    from popdist_lite.collectives import Problem

    if isinstance(exc, KeyError) and len(exc.args) == 1 and isinstance(exc.args[0], str):
        return Problem(type(exc), exc.args[0])  # str(KeyError) would quote the message
    return Problem.of(exc, otherwise=TypeError)


def agree_inputs(op: str, problem: Problem | None, comm) -> None:
    """Raise on every replica the lowest replica's ``problem`` (``f"{op}: replica {k}:
    {message}"``), else return. Collective: one
    :func:`popdist_lite.collectives.agree` (a 112-byte ``Allgather`` per replica; the
    messages travel only when some replica has a problem); a replica that called another
    collective at this point is named instead of deadlocking."""
    from popdist_lite.collectives import agree, register_op

    if op not in _REGISTERED:
        _REGISTERED.add(register_op(op))
    agree(op, _NO_ARRAY, comm, problem=problem, same_from=0)


def is_traced(tree) -> bool:
    """Whether any leaf of ``tree`` is a tracer (the call is being traced by jit)."""
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(tree))

