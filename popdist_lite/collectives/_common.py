"""Shared by every collective: input checks agreed across replicas, MPI datatypes.

Every collective starts with :func:`agree`, one ``Allgather`` of a small fixed-size
signature per replica (operation, call number, dtype, shape, local problem). Each
replica then checks the same table, so a bad argument on one replica becomes the
same exception on every replica instead of a hang or silent corruption, and a replica
that calls a different collective (or skips one) is named instead of deadlocking.
"""

from __future__ import annotations

import numpy as np

from .. import topology

MAX_NDIM = 8
_OPS = ("all_gather", "all_gather_v", "reduce_scatter_sum", "all_to_all", "all_to_all_v", "all_reduce", "broadcast")
_ERRORS = (None, ValueError, TypeError, IndexError)
#: dtypes every collective accepts (reductions also need :data:`REDUCIBLE`).
DTYPES = tuple(np.dtype(t) for t in (
    np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64,
    np.uint8, np.uint16, np.uint32, np.uint64, np.bool_, np.complex64, np.complex128))
_CODE = {d: i + 1 for i, d in enumerate(DTYPES)}
# Field offsets in a signature row.
OP, SEQ, STATUS, DTYPE, NDIM, EXTRA, SHAPE = range(7)
_WIDTH = SHAPE + MAX_NDIM
_calls: dict[int, int] = {}
_traffic: dict[str, list[int]] = {}  # op -> [calls, payload bytes sent by this replica]


def record(op: str, nbytes: int, calls: int = 0) -> None:
    """Count ``nbytes`` of payload this replica sent to other replicas in ``op``."""
    entry = _traffic.setdefault(op, [0, 0])
    entry[0] += calls
    entry[1] += int(nbytes)


def comm_stats(reset: bool = False) -> dict:
    """Payload traffic of this replica since the last reset, for benchmarks and tests.

    Counts the bytes of array data this replica *sends to other replicas* in each
    collective, as if every message went directly to its destination (ring-algorithm
    figures for MPI's own reductions: ``(r-1)/r * nbytes`` for a reduce-scatter,
    twice that for an all-reduce). The small argument-agreement exchange every
    collective starts with is counted separately as ``control_bytes``.

    Args:
        reset: zero the counters after reading them.

    Returns:
        ``{"payload_bytes": int, "control_bytes": int, "calls": int,
        "by_op": {op: {"calls": int, "payload_bytes": int}}}``.
    """
    by_op = {op: {"calls": c, "payload_bytes": b} for op, (c, b) in _traffic.items() if op != "agree"}
    agree_entry = _traffic.get("agree", [0, 0])
    out = {"payload_bytes": sum(v["payload_bytes"] for v in by_op.values()),
           "control_bytes": agree_entry[1], "calls": agree_entry[0], "by_op": by_op}
    if reset:
        _traffic.clear()
    return out


def default_comm(comm):
    """The replica communicator unless ``comm`` is given."""
    return topology.replica_comm() if comm is None else comm


def as_array(x) -> np.ndarray:
    """``x`` as a C-contiguous numpy array (no copy when it already is one; keeps 0-d)."""
    x = np.asarray(x)
    return x if x.flags.c_contiguous else np.array(x, order="C")


def buf(a: np.ndarray, counts=None):
    """An mpi4py buffer spec for ``a``, optionally with ``(counts, displacements)``;
    mpi4py picks the predefined MPI datatype from the array's dtype."""
    return a if counts is None else [a, counts]


def describe(table_row) -> str:
    dtype = DTYPES[int(table_row[DTYPE]) - 1] if table_row[DTYPE] else "?"
    shape = tuple(int(s) for s in table_row[SHAPE:SHAPE + int(table_row[NDIM])])
    return f"{dtype}{list(shape)}"


def shape_of(row) -> tuple[int, ...]:
    return tuple(int(s) for s in row[SHAPE:SHAPE + int(row[NDIM])])


def agree(op: str, x: np.ndarray | None, comm, *, problem: tuple[type, str] | None = None,
          extra: int = 0, name: str = "x") -> np.ndarray:
    """Exchange call signatures and raise the same error on every replica if any is bad.

    Args:
        op: the collective's name (one of ``_OPS``).
        x: this replica's array (its dtype and shape go into the signature).
        comm: the communicator.
        problem: ``(exception type, message)`` when this replica already found its
            arguments bad; every replica raises that type, naming this replica.
        extra: one more integer to compare or use (e.g. the root of a broadcast).

    Returns:
        ``int64[comm.size, width]``: every replica's signature, indexed by rank.

    Raises:
        ValueError, TypeError, IndexError: a replica's ``problem``, raised on all.
        RuntimeError: replicas called different collectives at the same point.
    """
    sig = np.zeros(_WIDTH, dtype=np.int64)
    seq = _calls.get(id(comm), 0)
    _calls[id(comm)] = seq + 1
    sig[OP], sig[SEQ], sig[EXTRA] = _OPS.index(op), seq, extra
    if problem is None and x is not None:
        if x.dtype not in _CODE:
            problem = (TypeError, f"argument {name}: expected one of the dtypes "
                                  f"{', '.join(map(str, DTYPES))}, got {x.dtype}")
        elif x.ndim > MAX_NDIM:
            problem = (ValueError, f"argument {name}: expected at most {MAX_NDIM} dimensions, got {x.ndim}")
        else:
            sig[DTYPE], sig[NDIM] = _CODE[x.dtype], x.ndim
            sig[SHAPE:SHAPE + x.ndim] = x.shape
    if problem is not None:
        sig[STATUS] = _ERRORS.index(problem[0])
    table = np.empty((comm.size, _WIDTH), dtype=np.int64)
    comm.Allgather(sig, table)
    record("agree", sig.nbytes * (comm.size - 1), calls=1)
    record(op, 0, calls=1)
    bad = np.flatnonzero((table[:, OP] != table[0, OP]) | (table[:, SEQ] != table[0, SEQ]))
    if bad.size:
        r = int(bad[0])
        raise RuntimeError(
            f"collective mismatch: replica 0 called {_OPS[table[0, OP]]} (collective call #{table[0, SEQ]}) "
            f"but replica {r} called {_OPS[table[r, OP]]} (call #{table[r, SEQ]}); every replica must "
            f"issue the same collectives in the same order")
    failed = np.flatnonzero(table[:, STATUS])
    if failed.size:
        messages = comm.allgather(problem[1] if problem else None)  # error path only: pickling is fine
        r = int(failed[0])
        raise _ERRORS[table[r, STATUS]](f"{op}: replica {r}: {messages[r]}")
    return table


def require_same_dtype(op: str, table: np.ndarray, name: str = "x") -> None:
    """Raise ``TypeError`` on every replica unless all replicas passed the same dtype."""
    bad = np.flatnonzero(table[:, DTYPE] != table[0, DTYPE])
    if bad.size:
        r = int(bad[0])
        raise TypeError(f"{op}: argument {name}: replica {r} passed dtype {DTYPES[table[r, DTYPE] - 1]}, "
                        f"expected {DTYPES[table[0, DTYPE] - 1]} as on replica 0")


def require_same_shape(op: str, table: np.ndarray, name: str = "x", from_axis: int = 0) -> None:
    """Raise ``ValueError`` on every replica unless all shapes agree (from ``from_axis`` on)."""
    require_same_dtype(op, table, name)
    ref = shape_of(table[0])
    for r in range(1, table.shape[0]):
        got = shape_of(table[r])
        if len(got) != len(ref) or got[from_axis:] != ref[from_axis:]:
            what = "shape" if from_axis == 0 else f"shape after axis {from_axis - 1}"
            raise ValueError(f"{op}: argument {name}: replica {r} passed shape {got}, expected the same "
                             f"{what} as replica 0, which passed {ref}")
