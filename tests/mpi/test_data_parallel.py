"""Data-parallel helpers against numpy: broadcast of weights, cross-replica momentum SGD."""

import numpy as np
import pytest

import popdist_lite as pl


@pytest.mark.mpi
def test_broadcast_parameters(comm, rng):
    every = [{"w": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.integers(0, 9, 5)}
             for _ in range(comm.size)]
    params = every[comm.rank]
    w_before = params["w"]
    pl.broadcast_parameters(params)
    assert params["w"] is w_before  # in place
    np.testing.assert_array_equal(params["w"], every[0]["w"])
    np.testing.assert_array_equal(params["b"], every[0]["b"])


@pytest.mark.mpi
def test_cross_replica_momentum_sgd_matches_numpy(comm, rng):
    r, lr, mu = comm.size, 0.1, 0.9
    w0 = {"w": rng.standard_normal((4, 3)), "b": rng.standard_normal(3)}
    params = {k: v.astype(np.float32) for k, v in w0.items()}
    opt = pl.CrossReplicaOptimizer(pl.MomentumSGD(lr, momentum=mu))
    ref = {k: v.copy() for k, v in w0.items()}
    vel = {k: np.zeros_like(v) for k, v in w0.items()}
    for step in range(3):
        grads = [{k: rng.standard_normal(v.shape) for k, v in w0.items()} for _ in range(r)]
        opt.step(params, {k: g.astype(np.float32) for k, g in grads[comm.rank].items()})
        for k in ref:
            vel[k] = mu * vel[k] + np.mean([g[k] for g in grads], axis=0)
            ref[k] = ref[k] - lr * vel[k]
    for k in ref:
        np.testing.assert_allclose(params[k], ref[k], rtol=1e-5, atol=1e-6)
    # replicas stay bit-identical
    gathered = pl.all_gather(params["w"])
    assert all(np.array_equal(gathered[0], g) for g in gathered)


@pytest.mark.mpi
def test_missing_gradient_is_a_clear_error(comm):
    opt = pl.CrossReplicaOptimizer(pl.MomentumSGD(0.1))
    with pytest.raises(KeyError, match=r"missing gradients for \['b'\]"):
        opt.step({"w": np.zeros(2), "b": np.zeros(2)}, {"w": np.zeros(2)})


@pytest.mark.mpi
@pytest.mark.parametrize("sharded", [False, True])
def test_gradient_missing_on_one_replica_raises_on_every_replica(comm, sharded):
    """Only the last replica forgets a gradient: every replica raises, none hangs."""
    opt = pl.CrossReplicaOptimizer(pl.MomentumSGD(0.1), shard_optimizer_state=sharded)
    params = {"w": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)}
    grads = {"w": np.ones(4, np.float32)}
    if comm.rank != comm.size - 1:
        grads["b"] = np.ones(4, np.float32)
    with pytest.raises(KeyError, match=rf"replica {comm.size - 1}: .*missing gradients for \['b'\]"):
        opt.step(params, grads)
    np.testing.assert_array_equal(params["w"], 0)  # nothing applied
    assert pl.all_reduce(np.array([1.0]))[0] == comm.size  # still in step
