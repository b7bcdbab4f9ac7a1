"""What every part of the JAX binding shares: moving arrays between JAX and the host,
the binding's dedicated communicator, and raising one replica's argument error on
every replica."""

from __future__ import annotations

import jax
import numpy as np

import popdist_lite as pl

#: Exceptions a replica's argument check may report (their index travels as one byte).
ERRORS = (ValueError, TypeError, IndexError, KeyError)

_DEDICATED: dict[int, tuple] = {}  # id(parent) -> (parent, its duplicate)


def dedicated_comm(comm=None):
    """The binding's communicator: a duplicate (``MPI_Comm_dup``) of ``comm`` (default:
    the replica communicator), made once per process and parent (a dedicated
    communicator is its own). Collective on the first call for a parent.

    Every table of the binding and every collective it issues uses it, so the host
    callbacks of the in-jit path (which run on XLA's threads) never share a
    communicator with collectives the program issues on the replica communicator.
    """
    pl.init()
    parent = pl.replica_comm() if comm is None else comm
    if any(dup is parent for _, dup in _DEDICATED.values()):
        return parent
    entry = _DEDICATED.get(id(parent))
    if entry is None:
        entry = _DEDICATED[id(parent)] = (parent, parent.Dup())  # keeps the parent alive: its id stays unique
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


def agree(comm, op: str, problem: tuple[type, str] | None) -> None:
    """Raise on every replica the error of the lowest replica that found one. Collective.

    Args:
        comm: the communicator.
        op: the operation, prefixed to the message (``f"{op}: replica {k}: {message}"``).
        problem: this replica's ``(exception class from ERRORS, message)``, or ``None``.

    One ``Allgather`` of one byte per replica; only when some replica has a problem,
    the messages follow (UTF-8 bytes through :func:`popdist_lite.all_gather_v`: nothing
    received is unpickled).

    Raises:
        ValueError, TypeError, IndexError, KeyError: some replica's problem.
        RuntimeError: a replica sent an error code outside ``ERRORS``.
    """
    mine = np.zeros(1, np.uint8)
    if problem is not None:
        mine[0] = 1 + ERRORS.index(problem[0])
    codes = np.empty(comm.size, np.uint8)
    comm.Allgather(mine, codes)
    if not codes.any():
        return
    text = np.frombuffer(problem[1].encode(), np.uint8) if problem is not None else np.zeros(0, np.uint8)
    values, counts = pl.all_gather_v(text, comm=comm)
    r = int(np.flatnonzero(codes)[0])
    start = int(counts[:r].sum())
    message = values[start:start + int(counts[r])].tobytes().decode("utf-8", errors="replace")
    if codes[r] > len(ERRORS):
        raise RuntimeError(f"{op}: replica {r} sent the unknown error code {int(codes[r])}: {message}")
    raise ERRORS[codes[r] - 1](f"{op}: replica {r}: {message}")


def is_traced(tree) -> bool:
    """Whether any leaf of ``tree`` is a tracer (the call is being traced by jit)."""
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(tree))

