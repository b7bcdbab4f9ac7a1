"""What watches the job from the launcher: the collector of the agents' records, the
failure report, the stall inspector and the request that asks the replicas to stop at
their next step boundary."""
