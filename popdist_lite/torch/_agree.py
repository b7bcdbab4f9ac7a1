"""Construction-time agreement for the binding's modules: every replica must build the
same module (the same table arguments, the same dense parameters)."""

from __future__ import annotations

from popdist_lite.collectives import Problem, agree_objects


def agree_signatures(what: str, signature: list | tuple, comm, problem: Problem | None = None) -> None:
    """Raise on every replica the lowest replica's ``problem``, else a ``ValueError``
    naming the first replica whose ``signature`` differs from replica 0's and the first
    item where they differ. Collective: one pickled all-gather (rare calls only).
    """
    gathered = agree_objects(what, list(signature), comm, problem=problem)
    first = gathered[0]
    for replica, sig in enumerate(gathered):
        for i in range(max(len(sig), len(first))):
            got = sig[i] if i < len(sig) else "nothing"
            want = first[i] if i < len(first) else "nothing"
            if got != want:
                raise ValueError(f"{what}: replica {replica} has {got}, expected {want} as on replica 0 "
                                 f"(item {i}); every replica must pass the same")
