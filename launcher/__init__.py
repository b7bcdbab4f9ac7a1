"""poprun-lite: a PopRun-style launcher over mpirun (Open MPI or MPICH).

Modules: ``cli`` (options, rank plan, main), ``mpirun`` (finding mpirun, MPMD
command), ``job`` (running it), ``collector`` (the records of the ranks' agents),
``agent`` (per-rank supervisor), ``report`` (failure report), ``tee`` (stream copy).

``records`` here is :mod:`popdist_lite.records`, the record format shared with the
ranks, loaded from its file: importing the ``popdist_lite`` package would start MPI
(its collectives import ``mpi4py.MPI``), which the launcher and the agents must not do.
"""

import importlib.util
import os
import sys

__version__ = "0.1.0"


def _load_records():
    name = "popdist_lite.records"
    if name in sys.modules:
        return sys.modules[name]
    package = importlib.util.find_spec("popdist_lite")  # finds, does not import
    path = os.path.join(os.path.dirname(package.origin), "records.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # `import popdist_lite.records` later gets this same module
    spec.loader.exec_module(module)
    return module


records = _load_records()
