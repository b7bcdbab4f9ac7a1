"""Open MPI's and MPICH's messages about a job's end, recognised in mpirun's stderr and
kept out of what the user sees (into the job's log, :mod:`.joblog`).

When a rank fails, the MPI library and its launcher each say so in a box of their own:
Open MPI's ``MPI_ABORT was invoked on rank 0 ...``, prterun's ``prterun has exited due
to process rank 0 ... calling "abort"`` or ``... noticed that process rank 1 ... exited
on signal 9``, MPICH's ``Abort(1) on node 0 ...`` and hydra's ``BAD TERMINATION OF ONE
OF YOUR APPLICATION PROCESSES``. The failure report already says who failed and how,
from the ranks' own records, so these only repeat it, less precisely. Boxes are told by
their frames (a line of 20 or more ``-``, Open MPI's help messages; of ``=``, hydra's)
and their words (:data:`BOX_WORDS`); single lines by :data:`LINE_PATTERNS`. Anything
else, boxes about anything else included (a missing executable, too few slots), is
written as it came. The words come from Open MPI's help files (``help-mpi-api.txt``
``[mpi-abort]``, PRRTE's ``help-prun.txt`` ``[prun:proc-ordered-abort]``,
``[prun:proc-aborted]``, ``[prun:non-zero-exit]``, ``[prun:proc-exit-no-sync]``) and
MPICH's hydra.
"""

from __future__ import annotations

import re
import time

#: Words that make a framed box one of the MPI library's messages about a job's end.
BOX_WORDS = (
    "MPI_ABORT was invoked on rank",
    "has exited due to process rank",
    "noticed that process rank",
    "detected that one or more processes exited with non-zero status",
    "Primary job  terminated normally, but",
    "BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES",
    "YOUR APPLICATION TERMINATED WITH THE EXIT STRING",
)
#: Single lines of the same kind (MPICH's abort, Open MPI's aggregated help messages).
LINE_PATTERNS = (
    re.compile(r"^Abort\(\d+\) on node \d+ .*application called MPI_Abort"),
    re.compile(r"^\[[^\]]*\] \d+ more process(es)? ha(s|ve) sent help message help-(mpi-api|prun|prterun)"),
    re.compile(r"^\[[^\]]*\] Set MCA parameter \"\w+_base_help_aggregate\" to 0"),
)
_FRAME = re.compile(rb"^(-{20,}|={20,})\r?$")
#: Lines of a box at most: a longer one is written as it came.
MAX_BOX_LINES = 80
#: Seconds a box, or a partial line that may begin one, is held for its end.
HOLD_SECONDS = 1.0


def _may_begin(partial: bytes) -> bool:
    """Whether a partial line may be a frame's or a single-line message's start."""
    bare = partial.rstrip(b"\r")
    return set(bare) <= {ord("-")} or set(bare) <= {ord("=")} or bare.startswith(b"[") \
        or b"Abort(".startswith(bare[:6]) and bare[:1] == b"A"


def is_end_message(box: str) -> bool:
    """Whether ``box`` (the text of a framed box, or one line) is the MPI library's
    message about a job's end."""
    if any(words in box for words in BOX_WORDS):
        return True
    return any(pattern.search(box) for pattern in LINE_PATTERNS)


class EndMessages:
    """A :class:`~popdist_lite_launcher.node.tee.Tee` filter for mpirun's stderr: writes
    every line but the MPI library's messages about a job's end, which go to ``keep``
    (a callable taking their text). A box is held until its closing frame (at most
    :data:`MAX_BOX_LINES` lines and :data:`HOLD_SECONDS`); a partial line is written at
    once unless it may be a frame's start."""

    def __init__(self, keep, clock=time.monotonic):
        self.keep, self.clock = keep, clock
        self.box: list[bytes] = []   # the lines of the open box, its frame first
        self.partial = b""           # a partial line held (a frame's start)
        self.deadline: float | None = None

    def feed(self, chunk: bytes) -> bytes:
        data, self.partial = self.partial + chunk, b""
        out = []
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            out.append(self._line(data[start:end + 1]))
            start = end + 1
        rest = data[start:]
        if rest and (self.box or _may_begin(rest)):
            self.partial = rest  # inside a box, or maybe a frame or a message: wait for the line's end
        else:
            out.append(rest)
        if self.box or self.partial:
            self.deadline = self.deadline or self.clock() + HOLD_SECONDS
        else:
            self.deadline = None
        return b"".join(out)

    def _line(self, line: bytes) -> bytes:
        bare = line.rstrip(b"\n")
        if self.box:
            self.box.append(line)
            if _FRAME.match(bare) and bare[:1] == self.box[0][:1]:
                return self._close()
            return self.release() if len(self.box) > MAX_BOX_LINES else b""
        if _FRAME.match(bare):
            self.box = [line]
            return b""
        text = bare.decode("utf-8", "replace")
        if is_end_message(text):
            self.keep(text + "\n")
            return b""
        return line

    def _close(self) -> bytes:
        box, self.box = b"".join(self.box), []
        text = box.decode("utf-8", "replace")
        inner = text.split("\n", 1)[1] if "\n" in text else text
        if is_end_message(inner):
            self.keep(text)
            return b""
        return box

    def timeout(self) -> float | None:
        return None if self.deadline is None else self.deadline - self.clock()

    def expire(self) -> bytes:
        if self.deadline is None or self.clock() < self.deadline:
            return b""
        return self.release()

    def release(self) -> bytes:
        """What is held, written as it came (a box that did not close in time)."""
        data, self.box, self.partial, self.deadline = b"".join(self.box) + self.partial, [], b"", None
        return data

    def end(self, failed: bool) -> bytes:
        return self.release()
