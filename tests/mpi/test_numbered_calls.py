"""MPI calls outside the checked collectives are numbered and counted too: the timeline's
exit gather and the ``Dup`` of a background save's, DistributedDataParallel's and the
JAX binding's communicators each take a call number on their communicator (what the
stall inspector sees) and appear in ``pl.stats()`` under their own name."""

import json
import time

import numpy as np
import pytest

import popdist_lite as pl
from popdist_lite import calls, counters, progress, timeline


def count(name: str) -> int:
    """Calls of ``name`` so far in this process's ``pl.stats()``."""
    return pl.stats()["collectives"].get(name, {}).get("calls", 0)


def numbers(comm) -> int:
    """How many call numbers ``comm`` has handed out."""
    return calls.comm_cache(comm).get(calls._CALLS, 0)


@pytest.mark.mpi
def test_timeline_exit_gather_is_numbered_and_counted(comm, shared):
    work = comm.Dup()
    saved_state, saved_events = dict(timeline._state), counters.events
    timeline._state.update(path=str(shared / "trace.json"), anchor=(time.time() * 1e6, time.perf_counter()),
                           replica=comm.rank)
    counters.events = [("probe", "collective", time.perf_counter(), 0.001, 8, 8, None)]
    before = count("timeline_gather"), count("timeline_gatherv")
    try:
        timeline._write_at_exit(work)
    finally:
        timeline._state.update(saved_state)
        counters.events = saved_events
    assert (count("timeline_gather"), count("timeline_gatherv")) == (before[0] + 1, before[1] + 1)
    assert numbers(work) == 2
    if comm.rank == 0:
        trace = json.loads((shared / "trace.json").read_text())
        assert trace["otherData"]["replicas"] == comm.size
        assert sorted(e["pid"] for e in trace["traceEvents"] if e["name"] == "probe") == list(range(comm.size))
    work.Free()


@pytest.mark.mpi
def test_background_save_dup_is_numbered_and_counted(comm, shared):
    """agree_objects #0, replica 0's directory (checkpoint_bcast #1), agree_objects #2,
    the writer's communicator (comm_dup #3); on that one, the background thread's
    checkpoint_gather #0 and checkpoint_bcast #1, numbered and recorded on the stall
    inspector's checkpoint lane (the main lane keeps the main thread's last call)."""
    from popdist_lite.checkpoint import save, wait

    work = comm.Dup()
    before = count("comm_dup")
    progress.enable(None)  # in this process's memory, as the watchdog does
    pl.save_checkpoint(shared, {"x": np.arange(4.0)}, step=0, comm=work, blocking=False)
    last = progress.last_call()[:2]
    wait()
    assert last == (3, "comm_dup")
    assert progress.last_call()[:2] == last  # the background thread's calls are on a lane of their own
    lanes = {lane: (call, op) for lane, call, op, _ in progress.read_lanes(progress._state["map"][:])}
    assert lanes["main"] == last and lanes["checkpoint"] == (1, "checkpoint_bcast")
    assert count("comm_dup") == before + 1
    assert numbers(work) == 4
    assert numbers(calls.comm_cache(work)[save._DUPLICATE]) == 2
    assert pl.latest_checkpoint(shared, comm=work).name == "step-00000000"
    assert numbers(work) == 5  # checkpoint_bcast #4
    work.Free()


@pytest.mark.mpi
def test_data_parallel_dup_is_numbered_and_counted(comm):
    torch = pytest.importorskip("torch", reason="popdist_lite.torch needs PyTorch")
    import popdist_lite.torch as pt

    start, before = numbers(comm), count("comm_dup")
    pt.DistributedDataParallel(torch.nn.Linear(4, 2), broadcast=False)
    assert count("comm_dup") == before + 1
    assert numbers(comm) == start + 2  # the parameters' agreement, then the Dup


@pytest.mark.mpi
def test_jax_dedicated_comm_dup_is_numbered_and_counted(comm):
    pytest.importorskip("jax", reason="popdist_lite.jax needs JAX")
    from popdist_lite.jax._host import dedicated_comm

    work = comm.Dup()
    before = count("comm_dup")
    dedicated = dedicated_comm(work)
    assert count("comm_dup") == before + 1
    assert numbers(work) == 1
    assert dedicated_comm(work) is dedicated and numbers(work) == 1  # made once per parent
