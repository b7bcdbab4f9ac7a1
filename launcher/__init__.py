"""poprun-lite: a PopRun-style launcher over mpirun (Open MPI or MPICH).

Modules: ``cli`` (the command line, main), ``options`` (the options, typed), ``plan``
(the rank plan), ``attempts`` (the attempts loop, membership policies, the launch
interface), ``ssh_launch`` (mpirun over the launch agent), ``hosts`` (host names,
hostfiles), ``network`` (the launcher's address, the reachability check), ``probe`` (its
host side), ``elastic`` (an elastic job's memberships, hosts and resize monitor),
``discovery`` (host discovery scripts), ``children`` (discovery and probe processes,
killed at each attempt's end), ``cleanup`` (killing what an attempt left on every host), ``mpirun`` (finding
mpirun, MPMD command), ``job`` (running it), ``channel`` (the job's key, the handshake
and authenticated framing between agents and launcher), ``collector`` (the records of
the ranks' agents), ``agent`` (per-rank supervisor), ``report`` (failure report),
``tee`` (stream copy), ``stall`` (the stall analysis), ``inspector`` (the stall
inspector), ``rank_progress`` (the agent's side of the stall inspector), ``testhosts``
(network-namespace test hosts on one machine, for the tests and benchmarks).

The record format shared with the ranks is :mod:`popdist_lite.records`, and a rank's
progress slot :mod:`popdist_lite.progress`; importing them starts no MPI (importing
``popdist_lite`` starts nothing), which the launcher and the agents must not do.
"""

__version__ = "0.1.0"
