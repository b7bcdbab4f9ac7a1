"""Agreement across replicas: every replica's view of a call, checked before data moves.

Two calls, one :class:`Problem` type:

- :func:`agree`, the buffer-based check every collective starts with: one ``Allgather``
  of a fixed-size *signature* per replica (the named layout :data:`SIGNATURE`:
  operation, call number, status, dtype, shape and one integer the caller defines; 112
  bytes), optionally followed by a payload of int64 values every replica should see
  (for example the send counts of a sparse exchange, so the check and that metadata
  share one ``Allgather``). Each replica checks the same gathered table, so a bad
  argument on one replica becomes the same exception on every replica instead of a
  hang or silent corruption, and a replica that calls a different collective (or skips
  one) is named instead of deadlocking. PyTorch calls the same idea a collective
  fingerprint (``c10d``'s ``ProcessGroupWrapper`` compares each collective's op, shapes
  and dtypes across ranks before running it).
- :func:`agree_objects`, for rare calls with small Python payloads (creating a table,
  the steps of a checkpoint): :func:`agree` (with the length of each replica's pickle),
  then one ``Allgatherv`` of the pickles.

- Operations: each caller registers its operation names with :func:`register_op`; an
  operation's code is a CRC of its name, so it is the same on every process whatever
  the order in which modules were imported.
- Errors: a replica that finds its own arguments bad does not raise alone (the others
  would wait for it in the collective): it passes a :class:`Problem` (an exception
  class and a message) to :func:`agree` or :func:`agree_objects`, and every replica
  raises that exception, naming the replica.
- Call numbers: every collective call takes its number from :func:`next_call_number`
  (:mod:`popdist_lite.calls`, re-exported here), the one place where calls are counted
  per communicator, checked or not (with ``set_collective_checks(False)`` the number is
  still taken, not exchanged), and where each call is recorded for poprun-lite's stall
  inspector (:mod:`popdist_lite.progress`).
- Fast paths: a call whose signature agreed before reuses its signature row (only the
  call number is rewritten) and, for the fixed-shape collectives, its gathered table;
  identical signatures are recognised with one byte comparison of the table.
"""

from __future__ import annotations

import os
import pickle
import zlib
from dataclasses import dataclass
from itertools import accumulate
from time import perf_counter

import numpy as np
from mpi4py import MPI

from .. import counters
from ..calls import comm_cache, next_call_number  # noqa: F401  (re-exported: the collectives' public names)

MAX_NDIM = 8
#: The layout of a signature row, one per replica (int64 fields; 112 bytes).
SIGNATURE = np.dtype([
    ("op", np.int64),                    # the operation's code (register_op)
    ("call", np.int64),                  # this replica's call number on the communicator
    ("status", np.int64),                # 0, or the exception of this replica's Problem (1 + _ERRORS index)
    ("dtype", np.int64),                 # 1 + index in DTYPES of the array's dtype; 0 without an array
    ("ndim", np.int64),                  # the array's number of dimensions
    ("extra", np.int64),                 # one integer the caller compares or uses (a root, a table's code)
    ("shape", np.int64, (MAX_NDIM,)),    # the array's shape, zero-padded
])
#: int64 values in a signature row; a payload follows from this column on.
WIDTH = SIGNATURE.itemsize // 8
# Each field's int64 column (the hot paths index int64 rows; the layout above names them).
_OP, _CALL, _STATUS, _DTYPE, _NDIM, _EXTRA, _SHAPE = (SIGNATURE.fields[f][1] // 8 for f in SIGNATURE.names)
_ERRORS = (ValueError, TypeError, IndexError, KeyError)
#: dtypes every collective accepts (reductions also need ``_reduce.REDUCIBLE``).
DTYPES = tuple(np.dtype(t) for t in (
    np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64,
    np.uint8, np.uint16, np.uint32, np.uint64, np.bool_, np.complex64, np.complex128))
_DTYPE_CODE = {d: i + 1 for i, d in enumerate(DTYPES)}

_op_codes: dict[str, int] = {}
_op_names: dict[int, str] = {}
# Signature rows of recent good calls, by (op, dtype, shape, extra): a repeated call
# only writes its call number (the Allgather copies the row, so reuse is safe).
_signatures: dict[tuple, np.ndarray] = {}
# The fixed-shape collectives' common case, by (op, dtype, shape, extra, replicas):
# ``[signature row, gathered table, bytes counted, named view of the table]``, row and
# table reused (the callers of that form ignore the table).
_fixed: dict[tuple, list] = {}
_layouts: dict[int, np.dtype] = {0: SIGNATURE}  # by payload length
_checks = [os.environ.get("POPDIST_LITE_COLLECTIVE_CHECKS", "1") != "0"]


@dataclass(frozen=True, slots=True)
class Problem:
    """What is wrong on this replica, found before a collective.

    Passed to :func:`agree` or :func:`agree_objects` (and to the collectives built on
    them) instead of raising, so that every replica raises
    ``error(f"{op}: replica {k}: {message}")`` together.

    Attributes:
        error: the exception class to raise, a subclass of ``Exception`` whose
            constructor takes one message (``ValueError``, ``TypeError``, ``IndexError``,
            ``KeyError`` travel in the signature itself; other classes on the error path).
        message: what was expected and what came (the operation and the replica are
            prefixed when it is raised).

    Raises:
        TypeError: ``error`` is not an exception class.
    """

    error: type
    message: str

    def __post_init__(self):
        if not (isinstance(self.error, type) and issubclass(self.error, Exception)):
            raise TypeError(f"Problem: argument error: expected an Exception subclass, got {self.error!r}")

    @classmethod
    def of(cls, exc: BaseException, *, keep: tuple = (ValueError, TypeError, IndexError, KeyError),
           otherwise: type = RuntimeError) -> "Problem":
        """The problem an exception caught on this replica describes: its own class when
        it is one of ``keep``, else ``otherwise`` with ``"Type: message"``; an
        ``OSError`` reads ``"strerror: filename"``."""
        message = str(exc)
        if isinstance(exc, OSError) and exc.strerror:
            message = f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
        if isinstance(exc, keep):
            return cls(type(exc), message)
        return cls(otherwise, message if isinstance(exc, OSError) else f"{type(exc).__name__}: {message}")

    def raise_as(self, op: str, replica: int):
        """Raise the error, naming the operation and the replica that found it."""
        raise self.error(f"{op}: replica {replica}: {self.message}")


def _status(problem: Problem) -> int:
    """The signature's status of ``problem``: 1 + its index among the common errors, or
    one past them for another class (carried, with its message, on the error path)."""
    return 1 + (_ERRORS.index(problem.error) if problem.error in _ERRORS else len(_ERRORS))


def agree_objects(what: str, value, comm, *, problem: Problem | None = None) -> list:
    """Collective: every replica's ``value`` (any picklable object), in replica order,
    after checking that every replica made this same call without a problem.

    For rare calls with small payloads (creating a table, the steps of a checkpoint).
    The check is :func:`agree`'s (operation ``agree_objects``, a call number, the
    length of this replica's pickle), so a replica that called another collective at
    this point (a buffer-based one included) is named, with the same
    ``collective mismatch`` error on every replica, before any pickle moves; then one
    ``Allgatherv`` of the pickles. Hot paths use the buffer-based :func:`agree`.

    Args:
        what: names the call in errors (e.g. ``"load_checkpoint('ckpt/step-00000020')"``).
        value: this replica's contribution (ignored when ``problem`` is given).
        comm: the communicator.
        problem: this replica's :class:`Problem`, if it has one.

    Returns:
        the list of every replica's ``value``.

    Raises:
        the lowest replica's problem, on every replica, as ``error(f"{what}: replica k:
        {message}")`` (a ``value`` that cannot be pickled is a ``TypeError`` problem).
        RuntimeError: replicas called different collectives at this point.
    """
    data = b""
    if problem is None:
        try:
            data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - raised on every replica below
            problem = Problem(TypeError, f"argument value: cannot be pickled: {type(exc).__name__}: {exc}")
    table = agree("agree_objects", None, comm, problem=problem, extra=len(data), what=what)
    counts = [int(n) for n in table["extra"]]
    at = list(accumulate(counts, initial=0))
    gathered = bytearray(at[-1])
    start = perf_counter()
    comm.Allgatherv([data, MPI.BYTE], [gathered, (counts, at[:-1]), MPI.BYTE])
    counters.record("agree_objects", start, len(data) * (comm.Get_size() - 1), at[-1] - len(data))
    view = memoryview(gathered)
    return [pickle.loads(view[a:b]) for a, b in zip(at, at[1:])]


def register_op(name: str) -> str:
    """Register an operation name for :func:`agree` (idempotent); returns ``name``.

    Raises:
        ValueError: another registered name has the same code (a CRC collision).
    """
    code = zlib.crc32(name.encode()) & 0x7FFFFFFF
    other = _op_names.setdefault(code, name)
    if other != name:
        raise ValueError(f"register_op: {name!r} has the same code as {other!r}; choose another name")
    _op_codes[name] = code
    return name


register_op("agree_objects")

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


def agree(op: str, x: np.ndarray | None, comm, *, problem: Problem | None = None,
          extra: int = 0, name: str = "x", payload: np.ndarray | None = None,
          same_from: int | None = None, extra_name: str = "extra", extra_format=str,
          what: str | None = None) -> np.ndarray | None:
    """Exchange call signatures and raise the same error on every replica if any is bad.

    Args:
        op: the operation's name, registered with :func:`register_op`.
        x: this replica's array (its dtype and shape go into the signature), or None.
        comm: the communicator.
        problem: a :class:`Problem` when this replica already found its arguments bad;
            every replica raises it, naming this replica.
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
        what: names the call in a replica's ``problem`` when raised (default ``op``).

    Returns:
        every replica's signature, indexed by rank: a structured array ``(comm.size,)``
        of :data:`SIGNATURE`, plus a field ``"payload"`` (``int64[k]``) with a payload.
        With ``same_from=0`` and no payload it is reused by the next such call (callers
        of that form ignore it); ``None`` when checks are off.

    Raises:
        ValueError, TypeError, IndexError, KeyError: a replica's ``problem``, raised on all.
        RuntimeError: replicas called different collectives at the same point.
    """
    if same_from == 0 and payload is None:
        if not _checks[0]:
            if problem is not None:  # unchecked: this replica's own error, raised here only
                problem.raise_as(op, comm.rank)
            next_call_number(comm, op)
            return None
        if problem is None:  # fast path: a repeat of a call that agreed before
            entry = _fixed.get((op, x.dtype, x.shape, extra, comm.size))
            if entry is not None:
                start = perf_counter()
                sig, table, n, named = entry
                sig[_CALL] = next_call_number(comm, op)
                comm.Allgather(sig, table)
                counters.record("agree", start, n, n)
                if table.tobytes() == sig.tobytes() * table.shape[0]:
                    return named
                return _disagree(op, table, problem, comm, same_from, name, extra_name, extra_format, what)
    start = perf_counter()
    seq = next_call_number(comm, op)
    key = None
    if problem is None:
        # a payload call with no array (the embedding headers): the row differs only in
        # its payload, written into the cached row below
        key = (op, x.dtype, x.shape, extra) if payload is None and x is not None else \
            (op, extra, len(payload)) if x is None and payload is not None else None
    sig = _signatures.get(key) if key is not None else None
    if sig is None:
        sig, problem = _signature(op, x, problem, extra, name, payload)
        if key is not None and problem is None:
            if len(_signatures) >= 1024:
                _signatures.clear()
            _signatures[key] = sig
    elif payload is not None:
        sig[WIDTH:] = payload
    sig[_CALL] = seq
    size = comm.size
    table = np.empty((size, sig.size), dtype=np.int64)
    comm.Allgather(sig, table)
    n = sig.nbytes * (size - 1)
    counters.record("agree", start, n, n)
    if problem is None:  # fast paths: nothing wrong anywhere
        if same_from == 0:
            if table.tobytes() == sig.tobytes() * size:
                named = _named(table)
                if payload is None:  # remembered for the fast path above
                    if len(_fixed) >= 1024:
                        _fixed.clear()
                    _fixed[(op, x.dtype, x.shape, extra, size)] = [sig.copy(), table, n, named]
                return named  # identical signatures
        elif same_from is None and table[:, :WIDTH].tobytes() == sig[:WIDTH].tobytes() * size:
            return _named(table)  # identical rows but for the payloads
        elif (table[:, _OP:_DTYPE] == sig[_OP:_DTYPE]).all() and (
                same_from is None or ((table[:, _DTYPE:_SHAPE] == sig[_DTYPE:_SHAPE]).all()
                                      and (table[:, _SHAPE + 1:WIDTH] == sig[_SHAPE + 1:WIDTH]).all())):
            return _named(table)  # same collective and call number (and trailing shape for same_from=1)
    return _disagree(op, table, problem, comm, same_from, name, extra_name, extra_format, what)


def _named(table: np.ndarray) -> np.ndarray:
    """The gathered ``int64[r, WIDTH + k]`` table as ``r`` :data:`SIGNATURE` records
    (plus ``"payload"``), a view: no copy."""
    k = table.shape[1] - WIDTH
    layout = _layouts.get(k)
    if layout is None:
        layout = _layouts[k] = np.dtype(SIGNATURE.descr + [("payload", np.int64, (k,))])
    return np.ndarray((table.shape[0],), layout, table)


def _op_name(code) -> str:
    return _op_names.get(int(code), f"operation #{int(code)}")


def _disagree(op: str, table: np.ndarray, problem: Problem | None, comm, same_from, name: str, extra_name: str,
              extra_format, what: str | None = None) -> np.ndarray:
    """Raise the error the gathered ``table`` shows, the same on every replica (or return
    it, named, when the differences are allowed: a first dimension for ``same_from=1``)."""
    bad = np.flatnonzero((table[:, _OP] != table[0, _OP]) | (table[:, _CALL] != table[0, _CALL]))
    if bad.size:
        r = int(bad[0])
        raise RuntimeError(
            f"collective mismatch: replica 0 called {_op_name(table[0, _OP])} (collective call "
            f"#{table[0, _CALL]}) but replica {r} called {_op_name(table[r, _OP])} (call #{table[r, _CALL]}); "
            f"every replica must issue the same collectives in the same order")
    failed = np.flatnonzero(table[:, _STATUS])
    if failed.size:
        problems = comm.allgather(problem)  # error path only: pickling is fine
        problems[int(failed[0])].raise_as(what or op, int(failed[0]))
    if same_from is not None:
        bad = np.flatnonzero(table[:, _EXTRA] != table[0, _EXTRA])
        if bad.size:
            r = int(bad[0])
            raise ValueError(f"{op}: argument {extra_name}: replica {r} passed {extra_format(table[r, _EXTRA])}, "
                             f"expected {extra_format(table[0, _EXTRA])} as on replica 0")
        _require_same_shape(op, table, name, from_axis=same_from)
    return _named(table)


def _signature(op: str, x, problem: Problem | None, extra: int, name: str, payload):
    """This replica's signature row (without the call number) and its problem, if any."""
    code = _op_codes.get(op)
    if code is None:
        raise ValueError(f"agree: operation {op!r} is not registered (agreement.register_op)")
    width = WIDTH if payload is None else WIDTH + len(payload)
    sig = np.zeros(width, dtype=np.int64)
    sig[_OP], sig[_EXTRA] = code, extra
    if payload is not None:
        sig[WIDTH:] = payload
    if problem is None and x is not None:
        dtype_code = _DTYPE_CODE.get(x.dtype)
        if dtype_code is None:
            problem = Problem(TypeError, f"argument {name}: expected one of the dtypes "
                                         f"{', '.join(map(str, DTYPES))}, got {x.dtype}")
        elif x.ndim > MAX_NDIM:
            problem = Problem(ValueError, f"argument {name}: expected at most {MAX_NDIM} dimensions, got {x.ndim}")
        else:
            sig[_DTYPE], sig[_NDIM] = dtype_code, x.ndim
            sig[_SHAPE:_SHAPE + x.ndim] = x.shape
    if problem is not None:
        sig[_STATUS] = _status(problem)
    return sig, problem


def _shape_of(row) -> tuple[int, ...]:
    return tuple(int(s) for s in row[_SHAPE:_SHAPE + int(row[_NDIM])])


def _require_same_shape(op: str, table: np.ndarray, name: str = "x", from_axis: int = 0) -> None:
    """Raise on every replica unless all dtypes (``TypeError``) and shapes from
    ``from_axis`` on (``ValueError``) agree."""
    if (table[:, _DTYPE:_SHAPE + from_axis] == table[0, _DTYPE:_SHAPE + from_axis]).all() \
            and (table[:, _SHAPE + from_axis:WIDTH] == table[0, _SHAPE + from_axis:WIDTH]).all():
        return  # fast path: the same dtype, ndim, extra and shape (from from_axis) everywhere
    bad = np.flatnonzero(table[:, _DTYPE] != table[0, _DTYPE])
    if bad.size:
        r = int(bad[0])
        raise TypeError(f"{op}: argument {name}: replica {r} passed dtype {DTYPES[table[r, _DTYPE] - 1]}, "
                        f"expected {DTYPES[table[0, _DTYPE] - 1]} as on replica 0")
    ref = _shape_of(table[0])
    for r in range(1, table.shape[0]):
        got = _shape_of(table[r])
        if len(got) != len(ref) or got[from_axis:] != ref[from_axis:]:
            what = "shape" if from_axis == 0 else f"shape after axis {from_axis - 1}"
            raise ValueError(f"{op}: argument {name}: replica {r} passed shape {got}, expected the same "
                             f"{what} as replica 0, which passed {ref}")
