"""poprun-lite: a PopRun-style launcher over mpirun (Open MPI or MPICH).

Modules: ``cli`` (options, rank plan, main), ``mpirun`` (finding mpirun, MPMD
command), ``job`` (running it), ``agent`` (per-rank supervisor), ``report``
(failure report).
"""

__version__ = "0.1.0"
