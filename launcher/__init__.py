"""poprun-lite: a PopRun-style launcher over mpirun (Open MPI or MPICH).

Modules: ``cli`` (options, rank plan, main), ``mpirun`` (finding mpirun, MPMD
command), ``job`` (running it), ``collector`` (the records of the ranks' agents),
``agent`` (per-rank supervisor), ``report`` (failure report), ``tee`` (stream copy),
``stall`` (the stall analysis), ``inspector`` (the stall inspector), ``rank_progress``
(the agent's side of the stall inspector).

``records`` here is :mod:`popdist_lite.records`, the record format shared with the
ranks, and ``progress`` is :mod:`popdist_lite.progress` (a rank's progress slot), both
loaded from their files: importing the ``popdist_lite`` package would start MPI (its
collectives import ``mpi4py.MPI``), which the launcher and the agents must not do.
"""

import importlib.util
import os
import sys

__version__ = "0.1.0"


def _load(module: str):
    """``popdist_lite.<module>`` loaded from its file, without importing the package."""
    name = f"popdist_lite.{module}"
    if name in sys.modules:
        return sys.modules[name]
    package = importlib.util.find_spec("popdist_lite")  # finds, does not import
    path = os.path.join(os.path.dirname(package.origin), f"{module}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[name] = loaded  # `import popdist_lite.<module>` later gets this same module
    spec.loader.exec_module(loaded)
    return loaded


records = _load("records")
progress = _load("progress")
