"""The ssh backend: mpirun's daemons started on other hosts by ``--launch-agent`` (ssh by
default) through the attempt agent, which marks them with the attempt."""
