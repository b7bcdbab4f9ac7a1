"""A numpy optimizer that has no state yet (no init, no step) takes its slots from a
checkpoint: their shapes are compared with the live parameters at the load, before
anything is allocated (issue 28). A checkpoint whose Adam slots for a 4-element
parameter hold 100,000 elements used to load, allocating them, and fail only at the
first update. Now the load raises on every replica and every live array and value is
bit-identical to before."""

import numpy as np
import pytest

import popdist_lite as pl

N = 100_000


def _frozen(state) -> tuple:
    opt = state["opt"].optimizer
    return (state["params"]["w"].tobytes(), state["params"]["w"].shape, state["step"], opt.steps,
            {name: {slot: (a.shape, a.tobytes()) for slot, a in slots.items()} for name, slots in opt.state.items()})


def _live() -> dict:
    return {"params": {"w": np.arange(4, dtype=np.float32)}, "opt": pl.CrossReplicaOptimizer(pl.Adam(0.1)),
            "step": 7}


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_slots_of_another_shape_are_refused_at_the_load(shared, comm):
    # a checkpoint whose optimizer was trained on a 100,000-element "w", saved beside a 4-element one
    big = {"w": np.ones(N, np.float32)}
    opt = pl.CrossReplicaOptimizer(pl.Adam(0.1))
    opt.step(big, {"w": np.ones(N, np.float32)})
    path = pl.save_checkpoint(shared, {"params": {"w": np.ones(4, np.float32)}, "opt": opt, "step": 1}, step=1)
    live = _live()
    before = _frozen(live)
    with pytest.raises(pl.CheckpointError, match=r"slot 'w/m' is float32\[100000\], its parameter 'w' needs "
                                                 r"float32\[4\]"):
        pl.load_checkpoint(path, live)
    assert _frozen(live) == before and not live["opt"].optimizer.state


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_slots_of_the_right_shape_load_into_a_fresh_optimizer(shared, comm):
    params = {"w": np.arange(4, dtype=np.float32)}
    opt = pl.CrossReplicaOptimizer(pl.Adam(0.1))
    opt.step(params, {"w": np.ones(4, np.float32)})
    path = pl.save_checkpoint(shared, {"params": params, "opt": opt, "step": 1}, step=1)
    live = _live()
    pl.load_checkpoint(path, live)
    np.testing.assert_array_equal(live["opt"].optimizer.state["w"]["m"], opt.optimizer.state["w"]["m"])
    np.testing.assert_array_equal(live["params"]["w"], params["w"])
    live["opt"].step(live["params"], {"w": np.ones(4, np.float32)})  # the loaded state is usable
