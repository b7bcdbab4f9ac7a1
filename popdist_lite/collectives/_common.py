"""Argument helpers shared by the collectives' modules: the default communicator,
C-contiguous inputs, buffer specs and the check of a caller's ``out=`` array."""

from __future__ import annotations

import numpy as np

from .. import topology
from .agreement import Problem


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


def check_out(out, shape: tuple, dtype) -> Problem | None:
    """The problem with a caller's ``out=`` array (None when it fits): it must be a
    C-contiguous numpy array of exactly ``shape`` and ``dtype``."""
    if out is None:
        return None
    if not isinstance(out, np.ndarray) or out.shape != tuple(shape) or out.dtype != dtype \
            or not out.flags.c_contiguous or not out.flags.writeable:
        got = (f"{out.dtype}{list(out.shape)}" + ("" if out.flags.c_contiguous else " non-contiguous")
               if isinstance(out, np.ndarray) else type(out).__name__)
        return Problem(ValueError, f"argument out: expected a writeable C-contiguous {np.dtype(dtype)}"
                                   f"{list(shape)} array, got {got}")
    return None
