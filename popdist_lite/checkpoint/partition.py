"""How an array is split over replicas, and which part of which file a replica reads
to fill its own part at another replica count or partition (resharding).

Four partitions cover every kind of state (see docs/checkpoint.md):

- ``replicated``: every replica holds the whole array; replica 0 writes it once.
- ``single``: replica ``replica`` holds the whole array, the others nothing (a
  table-wise embedding table's rows); it writes it.
- ``cyclic`` on ``axis``: replica ``k`` of ``r`` holds indices ``k, k + r, k + 2r, ...``
  (a TOKEN table's rows: row ``i`` on replica ``i % r`` at local row ``i // r``).
- ``block`` on ``axis``: replica ``k`` holds ``[k*c, (k+1)*c)``, ``c = ceil(n/r)`` (an
  ENCODING table's columns; the flat optimizer state of replicated tensor sharding).

A replica's local array may be padded beyond its real indices (TOKEN partitions have
``ceil(t/r)`` rows); files hold the real indices only. Every held set is an arithmetic
progression (a ``slice``), so intersecting what a reader needs with what a file holds
is arithmetic on indices, never a search; a regular result stays a slice, so an
unchanged partition copies whole blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

KINDS = ("replicated", "cyclic", "block", "single")


@dataclass(frozen=True)
class Partition:
    """``kind`` in :data:`KINDS`; ``axis``: the split axis (ignored for replicated);
    ``replica``: the replica holding a ``single`` array (axis 0 is the one held whole
    or not at all)."""

    kind: str
    axis: int = 0
    replica: int = 0

    def record(self) -> dict:
        if self.kind == "replicated":
            return {"kind": self.kind}
        if self.kind == "single":
            return {"kind": self.kind, "axis": self.axis, "replica": self.replica}
        return {"kind": self.kind, "axis": self.axis}

    @classmethod
    def from_record(cls, record: dict) -> "Partition":
        kind = record.get("kind")
        if kind not in KINDS:
            raise ValueError(f"unknown partition {record!r}")
        return cls(kind, int(record.get("axis", 0)), int(record.get("replica", 0)))

    def held(self, n: int, replicas: int, replica: int) -> slice:
        """The global indices along :attr:`axis` (of length ``n``) that ``replica`` holds,
        in local order, as a slice with non-negative start, stop and step."""
        if self.kind == "replicated":
            return slice(0, n, 1)
        if self.kind == "single":
            return slice(0, n, 1) if replica == self.replica else slice(0, 0, 1)
        if self.kind == "cyclic":
            return slice(min(replica, n), n, replicas)
        c = -(-n // replicas)
        return slice(min(replica * c, n), min((replica + 1) * c, n), 1)

    def count(self, n: int, replicas: int, replica: int) -> int:
        """How many real indices ``replica`` holds along the axis."""
        return len(range(n)[self.held(n, replicas, replica)])

    def writers(self, replicas: int) -> list[int]:
        """The replicas that write a file of this array."""
        if self.kind == "single":
            return [self.replica]
        return [0] if self.kind == "replicated" else list(range(replicas))

    def file_shape(self, shape: tuple, replicas: int, replica: int) -> tuple:
        """The shape of ``replica``'s file (its real indices only)."""
        if self.kind == "replicated":
            return tuple(shape)
        out = list(shape)
        out[self.axis] = self.count(shape[self.axis], replicas, replica)
        return tuple(out)

    def local_view(self, local: np.ndarray, shape: tuple, replicas: int, replica: int) -> np.ndarray:
        """The real (unpadded) part of ``replica``'s local array."""
        if self.kind == "replicated":
            return local
        index = [slice(None)] * local.ndim
        index[self.axis] = slice(0, self.count(shape[self.axis], replicas, replica))
        return local[tuple(index)]


def intersect(want: slice, have: slice) -> tuple[slice, slice]:
    """Positions of the global indices two progressions share: ``(in want's local order,
    in have's local order)``. The common indices of two arithmetic progressions form one,
    with step ``lcm(want.step, have.step)``; its first index solves two congruences (the
    Chinese remainder theorem), so the cost does not depend on the lengths."""
    empty = slice(0, 0, 1), slice(0, 0, 1)
    a, s, b, t = want.start, want.step, have.start, have.step
    g = math.gcd(s, t)
    if (b - a) % g:
        return empty
    lcm = s // g * t
    # first = a + s*x with s*x = b - a (mod t): x = (b - a)/g * (s/g)^-1 (mod t/g)
    first = a + s * ((b - a) // g * pow(s // g, -1, t // g) % (t // g))
    lo, hi = max(a, b), min(want.stop, have.stop)
    if first < lo:
        first += -(-(lo - first) // lcm) * lcm
    if first >= hi:
        return empty
    last = first + (hi - 1 - first) // lcm * lcm
    return (slice((first - a) // s, (last - a) // s + 1, lcm // s),
            slice((first - b) // t, (last - b) // t + 1, lcm // t))


def _length(index: slice, n: int) -> int:
    return len(range(n)[index])


@dataclass
class Piece:
    """Copy ``source[source_index]`` (a file's array) into ``local[local_index]``."""

    local_index: tuple
    source_index: tuple
    size: int  # elements copied


def plan(shape: tuple, target: Partition, readers: int, reader: int, source: Partition, writers: int,
         writer: int) -> Piece | None:
    """What ``reader`` (of ``readers``, partition ``target``) takes from the file of
    ``writer`` (of ``writers``, partition ``source``), or ``None`` when nothing."""
    local_index, source_index, size = [], [], 1
    for axis, n in enumerate(shape):
        want = target.held(n, readers, reader) if target.kind != "replicated" and target.axis == axis \
            else slice(0, n, 1)
        have = source.held(n, writers, writer) if source.kind != "replicated" and source.axis == axis \
            else slice(0, n, 1)
        mine, theirs = intersect(want, have)
        count = _length(mine, n)
        if count == 0:
            return None
        size *= count
        local_index.append(mine)
        source_index.append(theirs)
    return Piece(tuple(local_index), tuple(source_index), size)


def copy_piece(local: np.ndarray, source: np.ndarray, piece: Piece, chunk_bytes: int, done=None) -> None:
    """``local[piece.local_index] = source[piece.source_index]`` in parts of about
    ``chunk_bytes`` of the source along its axis 0 (one part of temporary memory at a
    time), calling ``done(last source row)`` after each part, to release the pages read."""
    if source.ndim == 0:
        local[...] = source
        return
    n = source.shape[0]
    s0, l0 = piece.source_index[0], piece.local_index[0]
    rows = range(n)[s0]
    per_part = max(1, chunk_bytes // (max(1, source[0:1].nbytes) * s0.step))
    for first in range(0, len(rows), per_part):
        part = rows[first:first + per_part]
        start = l0.start + first * l0.step
        li = (slice(start, start + len(part) * l0.step, l0.step),) + piece.local_index[1:]
        si = (slice(part.start, part.stop, part.step),) + piece.source_index[1:]
        local[li] = source[si]
        if done is not None:
            done(part[-1])
