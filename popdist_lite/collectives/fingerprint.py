"""The collective fingerprint: call signatures agreed across replicas before data moves.

Every collective starts with :func:`agree`, one ``Allgather`` of a small fixed-size
signature per replica (operation, call number, dtype, shape, local problem; 112 bytes). Each
replica then checks the same table, so a bad argument on one replica becomes the
same exception on every replica instead of a hang or silent corruption, and a replica
that calls a different collective (or skips one) is named instead of deadlocking.
PyTorch calls the same idea a collective fingerprint (``c10d``'s ``ProcessGroupWrapper``
checks each collective's op, shapes and dtypes across ranks before running it).

Call numbers: every checked call on a communicator takes the next number from
:func:`next_call_number`, the one place that counts calls per communicator (a
progress monitor can hook it to see how far each replica got).
"""

from __future__ import annotations

import os

from time import perf_counter

import numpy as np

from .. import counters

MAX_NDIM = 8
_OPS = ("all_gather", "all_gather_v", "reduce_scatter_sum", "all_to_all", "all_to_all_v", "all_reduce", "broadcast",
        "embedding_lookup", "embedding_update", "embedding_limits")
_ERRORS = (None, ValueError, TypeError, IndexError, KeyError)
#: dtypes every collective accepts (reductions also need :data:`REDUCIBLE`).
DTYPES = tuple(np.dtype(t) for t in (
    np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64,
    np.uint8, np.uint16, np.uint32, np.uint64, np.bool_, np.complex64, np.complex128))
_CODE = {d: i + 1 for i, d in enumerate(DTYPES)}
# Field offsets in a signature row.
OP, SEQ, STATUS, DTYPE, NDIM, EXTRA, SHAPE = range(7)
WIDTH = SHAPE + MAX_NDIM
PAYLOAD = WIDTH  # first column of an optional payload
_calls: dict[int, int] = {}  # per communicator (by id): the next call number
# Signature rows of recent good calls, by (op, dtype, shape, extra): a repeated call
# only writes its call number (the Allgather copies the row, so reuse is safe).
_signatures: dict[tuple, np.ndarray] = {}
# The fixed-shape collectives' common case, by (op, dtype, shape, extra, replicas):
# ``[signature row, gathered table, bytes counted]``, row and table reused (the callers
# of that form ignore the table).
_fixed: dict[tuple, list] = {}


def next_call_number(comm) -> int:
    """This replica's number for its next checked call on ``comm`` (0, 1, 2, ...).

    The only place where call numbers are counted: every :func:`agree` takes its number
    here, so replicas that issue different sequences of collectives are told apart by
    the number in their signatures.
    """
    key = id(comm)
    seq = _calls.get(key, 0)
    _calls[key] = seq + 1
    return seq


def describe(table_row) -> str:
    dtype = DTYPES[int(table_row[DTYPE]) - 1] if table_row[DTYPE] else "?"
    shape = tuple(int(s) for s in table_row[SHAPE:SHAPE + int(table_row[NDIM])])
    return f"{dtype}{list(shape)}"


def shape_of(row) -> tuple[int, ...]:
    return tuple(int(s) for s in row[SHAPE:SHAPE + int(row[NDIM])])


_checks = [os.environ.get("POPDIST_LITE_COLLECTIVE_CHECKS", "1") != "0"]


def set_collective_checks(enabled: bool) -> bool:
    """Turn the cross-replica argument check of the fixed-shape collectives on or off.

    On (the default), every collective starts with one small ``Allgather`` of call
    signatures (a few microseconds), so a shape, dtype, root or op that differs between
    replicas, or collectives called in a different order, raise the same error on every
    replica instead of hanging or corrupting data. Off, ``all_gather``,
    ``reduce_scatter_sum``, ``all_to_all``, ``all_reduce`` and ``broadcast`` go straight
    to MPI (the raw mpi4py cost; see docs/performance.md): only for code whose
    arguments are known to agree, and the setting must be the same on every replica.
    Ragged collectives and embeddings always check (their metadata rides in the check).
    Also set by ``POPDIST_LITE_COLLECTIVE_CHECKS=0``.

    Returns:
        the previous setting.
    """
    previous = _checks[0]
    _checks[0] = bool(enabled)
    return previous


def agree(op: str, x: np.ndarray | None, comm, *, problem: tuple[type, str] | None = None,
          extra: int = 0, name: str = "x", payload: np.ndarray | None = None,
          same_from: int | None = None, extra_name: str = "extra", extra_format=str) -> np.ndarray:
    """Exchange call signatures and raise the same error on every replica if any is bad.

    Args:
        op: the collective's name (one of ``_OPS``).
        x: this replica's array (its dtype and shape go into the signature).
        comm: the communicator.
        problem: ``(exception type, message)`` when this replica already found its
            arguments bad; every replica raises that type, naming this replica.
        extra: one more integer to compare or use (e.g. the root of a broadcast).
        payload: optional ``int64[k]`` appended to the signature (the same ``k`` on
            every replica), e.g. the send counts of a sparse exchange, so the check and
            a small exchange of metadata share one ``Allgather``.
        same_from: when given, also require the same dtype, ``extra`` and shape from
            axis ``same_from`` on, on every replica (0: identical signatures; 1: the
            first dimension may differ). The common case, identical signatures, is one
            byte comparison of the gathered table.
        extra_name, extra_format: how to name ``extra`` in the error message when it
            differs between replicas (e.g. ``"root"``).

    Returns:
        ``int64[comm.size, width]``: every replica's signature, indexed by rank
        (columns ``PAYLOAD:`` hold the payloads). With ``same_from=0`` and no payload
        the array is reused by the next such call (callers of that form ignore it);
        ``None`` when checks are off.

    Raises:
        ValueError, TypeError, IndexError: a replica's ``problem``, raised on all.
        RuntimeError: replicas called different collectives at the same point.
    """
    if same_from == 0 and payload is None:
        if not _checks[0]:
            if problem is not None:  # unchecked: this replica's own error, raised here only
                raise problem[0](f"{op}: replica {comm.rank}: {problem[1]}")
            return None
        if problem is None:  # fast path: a repeat of a call that agreed before
            entry = _fixed.get((op, x.dtype, x.shape, extra, comm.size))
            if entry is not None:
                start = perf_counter()
                sig, table, n = entry
                sig[SEQ] = next_call_number(comm)
                comm.Allgather(sig, table)
                counters.record("agree", start, n, n)
                if table.tobytes() == sig.tobytes() * table.shape[0]:
                    return table
                return _disagree(op, table, problem, comm, same_from, name, extra_name, extra_format)
    start = perf_counter()
    seq = next_call_number(comm)
    key = None
    if problem is None:
        # a payload call with no array (the embedding headers): the row differs only in
        # its payload, written into the cached row below
        key = (op, x.dtype, x.shape, extra) if payload is None else (op, extra, len(payload)) if x is None else None
    sig = _signatures.get(key) if key is not None else None
    if sig is None:
        sig, problem = _signature(op, x, problem, extra, name, payload)
        if key is not None and problem is None:
            if len(_signatures) >= 1024:
                _signatures.clear()
            _signatures[key] = sig
    elif payload is not None:
        sig[PAYLOAD:] = payload
    sig[SEQ] = seq
    size = comm.size
    table = np.empty((size, sig.size), dtype=np.int64)
    comm.Allgather(sig, table)
    n = sig.nbytes * (size - 1)
    counters.record("agree", start, n, n)
    if problem is None:  # fast paths: nothing wrong anywhere
        if same_from == 0:
            if table.tobytes() == sig.tobytes() * size:
                if payload is None:  # remembered for the fast path above
                    if len(_fixed) >= 1024:
                        _fixed.clear()
                    _fixed[(op, x.dtype, x.shape, extra, size)] = [sig.copy(), table, n]
                return table  # identical signatures
        elif same_from is None and table[:, :WIDTH].tobytes() == sig[:WIDTH].tobytes() * size:
            return table  # identical rows but for the payloads
        elif (table[:, OP:DTYPE] == sig[OP:DTYPE]).all() and (
                same_from is None or ((table[:, DTYPE:SHAPE] == sig[DTYPE:SHAPE]).all()
                                      and (table[:, SHAPE + 1:WIDTH] == sig[SHAPE + 1:WIDTH]).all())):
            return table  # same collective and call number (and trailing shape for same_from=1)
    return _disagree(op, table, problem, comm, same_from, name, extra_name, extra_format)


def _disagree(op: str, table: np.ndarray, problem, comm, same_from, name: str, extra_name: str,
              extra_format) -> np.ndarray:
    """Raise the error the gathered ``table`` shows, the same on every replica (or return
    ``table`` when the differences are allowed: a first dimension for ``same_from=1``)."""
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
    if same_from is not None:
        bad = np.flatnonzero(table[:, EXTRA] != table[0, EXTRA])
        if bad.size:
            r = int(bad[0])
            raise ValueError(f"{op}: argument {extra_name}: replica {r} passed {extra_format(table[r, EXTRA])}, "
                             f"expected {extra_format(table[0, EXTRA])} as on replica 0")
        require_same_shape(op, table, name, from_axis=same_from)
    return table


def _signature(op: str, x, problem, extra: int, name: str, payload):
    """This replica's signature row (without the call number) and its problem, if any."""
    width = WIDTH if payload is None else WIDTH + len(payload)
    sig = np.zeros(width, dtype=np.int64)
    sig[OP], sig[EXTRA] = _OPS.index(op), extra
    if payload is not None:
        sig[PAYLOAD:] = payload
    if problem is None and x is not None:
        code = _CODE.get(x.dtype)
        if code is None:
            problem = (TypeError, f"argument {name}: expected one of the dtypes "
                                  f"{', '.join(map(str, DTYPES))}, got {x.dtype}")
        elif x.ndim > MAX_NDIM:
            problem = (ValueError, f"argument {name}: expected at most {MAX_NDIM} dimensions, got {x.ndim}")
        else:
            sig[DTYPE], sig[NDIM] = code, x.ndim
            sig[SHAPE:SHAPE + x.ndim] = x.shape
    if problem is not None:
        sig[STATUS] = _ERRORS.index(problem[0])
    return sig, problem


def require_same_dtype(op: str, table: np.ndarray, name: str = "x") -> None:
    """Raise ``TypeError`` on every replica unless all replicas passed the same dtype."""
    bad = np.flatnonzero(table[:, DTYPE] != table[0, DTYPE])
    if bad.size:
        r = int(bad[0])
        raise TypeError(f"{op}: argument {name}: replica {r} passed dtype {DTYPES[table[r, DTYPE] - 1]}, "
                        f"expected {DTYPES[table[0, DTYPE] - 1]} as on replica 0")


def require_same_shape(op: str, table: np.ndarray, name: str = "x", from_axis: int = 0) -> None:
    """Raise ``ValueError`` on every replica unless all shapes agree (from ``from_axis`` on)."""
    if (table[:, DTYPE:SHAPE + from_axis] == table[0, DTYPE:SHAPE + from_axis]).all() \
            and (table[:, SHAPE + from_axis:WIDTH] == table[0, SHAPE + from_axis:WIDTH]).all():
        return  # fast path: the same dtype, ndim, extra and shape (from from_axis) everywhere
    require_same_dtype(op, table, name)
    ref = shape_of(table[0])
    for r in range(1, table.shape[0]):
        got = shape_of(table[r])
        if len(got) != len(ref) or got[from_axis:] != ref[from_axis:]:
            what = "shape" if from_axis == 0 else f"shape after axis {from_axis - 1}"
            raise ValueError(f"{op}: argument {name}: replica {r} passed shape {got}, expected the same "
                             f"{what} as replica 0, which passed {ref}")
