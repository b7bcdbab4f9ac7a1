"""How the replicas agree on the outcome of a checkpoint step: every replica reports
``None`` or its problem, and every replica raises the first problem, naming its replica.

Checkpoints are rare, so the small pickled all-gather of mpi4py keeps this simple.
"""

from __future__ import annotations

from .format import CheckpointError

#: Exception types a problem may carry across replicas (anything else: CheckpointError).
_TYPES = {cls.__name__: cls for cls in (TypeError, ValueError, CheckpointError)}


def problem_of(exc: BaseException) -> tuple[str, str]:
    """``(type name, message)`` of an exception, for :func:`agree`."""
    message = str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        message = f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    elif not isinstance(exc, tuple(_TYPES.values())):
        message = f"{type(exc).__name__}: {message}"
    return type(exc).__name__, message


def agree(comm, problem: tuple[str, str] | None, what: str) -> None:
    """Collective: raise on every replica when any replica has a ``problem``
    (``(type name, message)``), the lowest replica's first, as ``"{what}: replica k:
    {message}"``, with its type if it is TypeError or ValueError, else CheckpointError."""
    gathered = comm.allgather(problem)
    for replica, found in enumerate(gathered):
        if found is not None:
            kind, message = found
            raise _TYPES.get(kind, CheckpointError)(f"{what}: replica {replica}: {message}")
