"""Test infrastructure, for the tests and benchmarks only (nothing else of the launcher
imports it): network-namespace test hosts on one machine and a Slurm cluster on them."""
