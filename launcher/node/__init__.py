"""What runs on a rank's host: the per-rank agent and its link to the launcher, the
job's key files, the held signals, the stall inspector's host side, and the commands the
launcher runs on a host through the launch agent (the probe, the key files, the
cleanup)."""
