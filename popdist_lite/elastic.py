"""Elastic jobs and preemption, the program's side: :func:`should_checkpoint` and the
``checkpoint_saved`` report (:func:`report_saved`).

``poprun-lite --min-replicas N`` (docs/elastic.md) restarts a job at another replica
count when hosts are lost or come back. A loss ends the attempt at once (the program
resumes from its newest checkpoint); a grow is asked for: the launcher sends every
replica's agent a ``resize_request`` record, the agent passes it to its program as one
byte on their socket pair (:func:`popdist_lite.records.resize_requested`), and the
training loop, at a step boundary, asks::

    if pl.should_checkpoint():          # the same answer on every replica, at the same step
        pl.save_checkpoint(ckpt_dir, state, step=step + 1)
        break                           # exit 0: the launcher starts the larger attempt

so no step is lost or cut in half by a grow. The same request comes when the scheduler
signals poprun-lite (SIGUSR1 before a Slurm time limit, SIGTERM; docs/slurm.md): the
program saves its checkpoint the same way, and the launcher requeues or ends the job.
The first True also sends the launcher a
``resize_stop`` record: the replicas stopped for the resize (the attempt's clean end is
then not the end of the job). Horovod Elastic's ``State.commit()`` checks for host
changes at the same place (and raises ``HostsUpdatedInterrupt``); torchrun's agent
restarts the workers of a changed membership without asking them.

A save that begins after the first True (:func:`stopping`) sends the launcher a
``checkpoint_saved`` record once committed (:func:`report_saved`): a preempted job's
report says "(checkpoint saved)" only when every replica sent one.

The signals the scheduler sends every process of a job are held by
:mod:`popdist_lite.held_signals`.
"""

from __future__ import annotations

import os

import numpy as np

from . import records, topology
from .calls import numbered_all_reduce

_state = {"announced": False}


def should_checkpoint() -> bool:
    """Collective over the replicas: True when the launcher asked this attempt to end for
    a resize (``poprun-lite --min-replicas``) or on a scheduler's signal (the requeue
    signal or SIGTERM with ``--preemption``, docs/slurm.md), on every replica at the same
    call.

    Call it once per step at the step boundary; on True, save a checkpoint and end the
    program normally (exit code 0): the launcher starts the next attempt at the new size,
    which resumes from that checkpoint (after a signal: it requeues or ends the job).
    Once True it stays True. Costs one all-reduce of
    one ``int32`` (MAX) on the replica communicator (numbered for the stall inspector,
    counted as ``should_checkpoint``); outside poprun-lite (plain mpirun,
    one process) it is always False.

    Returns:
        bool, the same on every replica.
    """
    topology.init()
    asked = np.array([records.resize_requested()], dtype=np.int32)
    comm = topology.replica_comm()
    if comm.Get_size() > 1:
        from mpi4py import MPI

        numbered_all_reduce(asked, MPI.MAX, comm, "should_checkpoint")
    agreed = bool(asked[0])
    if agreed and not _state["announced"]:
        _state["announced"] = True
        topo = topology.current()
        records.send(records.make("resize_stop", records.identity(
            rank=records.env_rank(), replica=topo.replica_id, pid=os.getpid())),
            timeout=RECORD_TIMEOUT_SECONDS)
    return agreed


#: Seconds :func:`should_checkpoint` waits for its agent to pass ``resize_stop`` on.
RECORD_TIMEOUT_SECONDS = 5.0


def stopping() -> bool:
    """Whether :func:`should_checkpoint` answered True in this process: the replicas are
    stopping at this step boundary (a save begun now is the one the launcher waits for)."""
    return _state["announced"]


def report_saved(step: int) -> None:
    """Tell the launcher this replica's part of checkpoint ``step`` is committed
    (``checkpoint_saved``; :func:`popdist_lite.save_checkpoint` calls it for a save begun
    once :func:`stopping`). Nothing outside poprun-lite."""
    topo = topology.current()
    records.send(records.make("checkpoint_saved", records.identity(
        rank=records.env_rank(), replica=topo.replica_id, role=topo.role, feeder=topo.feeder_index,
        pid=os.getpid()), step=int(step)), timeout=RECORD_TIMEOUT_SECONDS)
