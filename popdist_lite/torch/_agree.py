"""Raising a replica's problem on every replica, for the binding's own argument checks.

The library's collectives check their arguments across replicas; the binding also has
checks of its own (torch-only arguments such as ``offsets``, or the dense parameters a
wrapper is given). A problem found on one replica must become the same exception on every
replica, never a replica that raises alone while the others wait for it in a collective.
"""

from __future__ import annotations

import numpy as np

import popdist_lite as pl


def raise_on_every_replica(problem: tuple[type, str] | None, comm) -> None:
    """Raise ``problem`` (``(exception class, message)``) of the lowest replica that has
    one, on every replica, naming that replica. Collective: one :func:`popdist_lite.all_reduce`
    of one int32, plus a pickled all-gather of the problems when there is one.
    """
    flag = np.array([1 if problem else 0], np.int32)
    if pl.all_reduce(flag, op="max", comm=comm)[0]:
        gathered = comm.allgather(problem)  # rare: pickling is fine
        replica, (error, message) = next((r, p) for r, p in enumerate(gathered) if p)
        raise error(f"replica {replica}: {message}")


def agree_on_arguments(owner: str, problem: tuple[type, str] | None, signature, comm) -> None:
    """At construction (rare): raise a local ``problem`` on every replica, or a
    ``ValueError`` naming the first replica whose ``signature`` (any picklable value
    with ``==``) differs from replica 0's, and the first item where they differ when
    both are sequences. Collective: one pickled all-gather.
    """
    gathered = comm.allgather((problem, signature))
    for replica, (p, _) in enumerate(gathered):
        if p:
            raise p[0](f"{owner}: replica {replica}: {p[1]}")
    first = gathered[0][1]
    for replica, (_, sig) in enumerate(gathered):
        if sig == first:
            continue
        if isinstance(sig, (list, tuple)) and isinstance(first, (list, tuple)):
            for i in range(max(len(sig), len(first))):
                got = sig[i] if i < len(sig) else "nothing"
                want = first[i] if i < len(first) else "nothing"
                if got != want:
                    raise ValueError(f"{owner}: replica {replica} has {got}, expected {want} as on replica 0 "
                                     f"(item {i}); every replica must pass the same")
        raise ValueError(f"{owner}: replica {replica} has {sig}, expected {first} as on replica 0")
