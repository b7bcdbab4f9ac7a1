"""The Slurm backend: the allocation poprun-lite runs in, mpirun's own Slurm launch and
``srun`` steps for poprun-lite's commands, a lost node, the scheduler's signals
(preemption, requeue) and Slurm's commands read as hostile input."""
