"""The per-rank runtime services :func:`popdist_lite.init` starts once the topology is
known (:mod:`popdist_lite.topology` only discovers it):

- the scheduler's signals held for this process only, not its children, while
  poprun-lite's preemption is on (:mod:`popdist_lite.held_signals`);
- the failure hook (:mod:`popdist_lite._excepthook`): an uncaught exception on any rank
  prints the rank's traceback, records it for poprun-lite's report and aborts the whole
  job, as ``python -m mpi4py`` does;
- progress recording and stack dumps for poprun-lite's stall inspector
  (:mod:`popdist_lite.progress`, when its agent passed the descriptors);
- on a replica under plain mpirun with ``POPDIST_LITE_STALL_TIMEOUT`` set, the stall
  watchdog (:mod:`popdist_lite.watchdog`);
- on a replica with ``POPDIST_LITE_TIMELINE`` set, the timeline
  (:mod:`popdist_lite.timeline`);
- on a replica with host feed processes, the exit handler that ends its feed session
  and tells them to exit (:func:`popdist_lite.infeed.receiver.shutdown_feeders`, the
  replica's side of the feed protocol), registered after MPI was imported, so it runs
  before mpi4py finalizes MPI.
"""

from __future__ import annotations

import atexit
import os

from . import _excepthook, held_signals, progress


def start(topo) -> None:
    """Start the services for this rank's :class:`~popdist_lite.topology.Topology`
    (once per process: :func:`popdist_lite.init` calls it on its first call).

    Raises:
        ValueError: ``POPDIST_LITE_STALL_TIMEOUT`` is set but not a number.
    """
    held_signals.hold_signals()
    _excepthook.install(replica_index=topo.replica_id, role=topo.role, feeder_index=topo.feeder_index)
    progress.enable_from_env()
    if topo.role != "replica":
        return
    from . import watchdog

    watchdog.start_from_env(topo.replica_id, lambda: topo.world.Abort(1))
    timeline_path = os.environ.get("POPDIST_LITE_TIMELINE")
    if timeline_path:
        from . import timeline

        timeline.enable(timeline_path, topo.replica_id, topo.replicas)
    if topo.feed is not None:
        from .infeed.receiver import shutdown_feeders

        atexit.register(shutdown_feeders, topo.feed)
