"""poprun-lite: a PopRun-style launcher over mpirun (Open MPI or MPICH).

Its parts (docs/launcher.md, "The parts", draws them), each a subpackage but for the
two modules at the top:

- ``cli`` (the command line and ``main``: the one place that wires the parts together)
  and ``attempts`` (the attempts loop, one for every job);
- ``core``: the vocabulary every part shares (the launch interface, the typed options,
  the rank plan, host names, the agents' wire protocol, the words of messages); it
  imports no other part;
- ``node``: what runs on a rank's host (the agent and its link to the launcher, the
  key files, the held signals, the stall inspector's host side, the probe, the cleanup);
- ``supervise``: what watches the job from the launcher (the collector, the failure
  report, the stall inspector, the request to stop at a step boundary);
- ``launch``: the mpirun launch every backend shares (one attempt's plan, keys,
  collector, mpirun command and its supervision, the cleanup; commands on hosts);
- ``ssh`` and ``slurm``: the backends, siblings that never import each other: mpirun over
  ``--launch-agent``, and mpirun through Slurm with the allocation, a lost node, the
  scheduler's signals and Slurm's commands;
- ``membership``: which hosts each attempt runs on (the fixed and elastic policies,
  discovery, the resize monitor);
- ``testing``: network-namespace test hosts and a Slurm cluster on one machine, for the
  tests and benchmarks; nothing else imports it.

tests/test_imports.py holds these rules (``ALLOWED``). The record format shared with
the ranks is :mod:`popdist_lite.records`, and a rank's progress slot
:mod:`popdist_lite.progress`; importing them starts no MPI (importing ``popdist_lite``
starts nothing), which the launcher and the agents must not do.
"""

__version__ = "0.1.0"
