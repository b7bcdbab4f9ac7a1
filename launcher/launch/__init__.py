"""The mpirun launch every backend shares: one attempt as a plan, its keys, a collector,
one MPMD mpirun command run under supervision, and the cleanup on every host
(:class:`~popdist_lite_launcher.launch.base.MpirunLauncher`); ``ssh/`` and ``slurm/``
only change how mpirun reaches the other hosts."""
