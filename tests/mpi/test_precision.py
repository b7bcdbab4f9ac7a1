"""Reduced precision at 1-4 ranks: float16 collectives against float64 references,
replica-identical stochastic rounding, loss scaling with an overflow on one replica,
dense optimizers (SGD, momentum, Adam) with and without replicated tensor sharding."""

import numpy as np
import pytest

import popdist_lite as pl

F16 = np.float16


def wide_range_f16(rng, shape):
    """float16 values spread over many binades (subnormals to thousands), both signs."""
    mant = rng.standard_normal(shape)
    return (mant * 2.0 ** rng.integers(-26, 12, size=shape)).astype(F16)


# -- float16 collectives: float16 on the wire, one rounding of the exact sum --------------

@pytest.mark.mpi
@pytest.mark.parametrize("shape", [(7,), (3, 5), (0, 2)])
def test_f16_reduce_scatter_is_the_rounding_of_the_exact_sum(comm, rng, shape):
    r = comm.size
    x = wide_range_f16(rng, (r, r) + shape)  # x[j]: replica j's input
    out = pl.reduce_scatter_sum(x[comm.rank])
    expected = x.astype(np.float64).sum(axis=0)[comm.rank].astype(F16)
    assert out.dtype == F16 and out.shape == shape
    np.testing.assert_array_equal(out, expected)


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
@pytest.mark.parametrize("shape", [(), (1,), (11,), (4, 6)])
def test_f16_all_reduce_against_float64(comm, rng, op, shape):
    x = wide_range_f16(rng, (comm.size,) + shape)
    out = pl.all_reduce(x[comm.rank], op=op)
    wide = x.astype(np.float64)
    expected = {"sum": wide.sum(0), "mean": wide.sum(0) / comm.size, "max": wide.max(0), "min": wide.min(0)}[op]
    assert out.dtype == F16 and out.shape == shape
    np.testing.assert_array_equal(out, expected.astype(F16))


@pytest.mark.mpi(min_size=2)
def test_f16_sum_is_not_an_accumulation_of_f16_roundings(comm):
    """2048 + 1 + 1 + ...: float16 running sums lose every +1 (2049 ties to 2048), the
    exact sum keeps them. With a third replica adding 2**-24, a float32 accumulator
    would land exactly on the tie 2049 and round to 2048; the exact sum rounds up."""
    r, k = comm.size, comm.rank
    values = np.zeros(r, np.float64)
    values[0], values[1:] = 2048.0, 1.0
    if r >= 3:
        values[2] = 2.0 ** -24
    mine = np.array([values[k]], F16)
    total = pl.all_reduce(mine)[0]
    exact = np.float16(values.sum())
    assert total == exact
    running = np.float16(0)
    for v in values.astype(F16):
        running = np.float16(running + v)
    if r >= 3:
        assert running == 2048 and exact == 2050  # the oracle distinguishes the two
    if r == 3:
        assert np.float16(np.float32(2048) + np.float32(1) + np.float32(2.0 ** -24)) == 2048


def payload(what="sent"):
    """Bytes this replica sent (or received) since the last ``reset_stats()``, without
    the small argument check (``agree``) that precedes every checked collective."""
    s = pl.stats()
    return s[f"bytes_{what}"] - s["collectives"].get("agree", {}).get(f"bytes_{what}", 0)


def moved(fn, *args, **kwargs):
    """(sent, received) payload bytes of one call (see :func:`payload`)."""
    pl.reset_stats()
    fn(*args, **kwargs)
    return payload("sent"), payload("received")


@pytest.mark.mpi
def test_f16_collectives_send_half_the_bytes(comm, rng):
    r, n = comm.size, 12 * comm.size
    x32 = rng.standard_normal(n).astype(np.float32)
    # reduce-scatter: all but my own slice leaves this replica, in float16 half as many bytes
    rs32 = moved(pl.reduce_scatter_sum, x32.reshape(r, -1))
    rs16 = moved(pl.reduce_scatter_sum, x32.reshape(r, -1).astype(F16))
    assert rs32 == ((r - 1) * n * 4 // r,) * 2
    assert rs16[0] * 2 == rs32[0] and rs16[1] * 2 == rs32[1]
    # float16 all-reduce = that reduce-scatter + an all-gather of the float16 results:
    # half of what the same two collectives move in float32 (the ring figure)
    ag32 = moved(pl.all_gather, x32[:n // r])
    b16 = moved(pl.all_reduce, x32.astype(F16))
    assert b16 == (2 * (r - 1) * n * 2 // r,) * 2
    assert b16[0] * 2 == rs32[0] + ag32[0] and b16[1] * 2 == rs32[1] + ag32[1]
    assert pl.stats()["collectives"]["all_reduce"]["calls"] == 1  # one record for the whole float16 reduction
    # MPI's float32 Allreduce is counted as every replica's array to every other
    # (popdist_lite.counters); float16 never moves more than half of that
    b32 = moved(pl.all_reduce, x32)
    assert b32 == ((r - 1) * n * 4,) * 2
    assert b16[0] * 2 <= b32[0]  # equal at 2 replicas


@pytest.mark.mpi
@pytest.mark.parametrize("strategy,exchange", [("TOKEN", "sparse"), ("TOKEN", "dense"), ("ENCODING", "dense")])
def test_f16_table_lookup_moves_f16(comm, rng, strategy, exchange):
    t, e, r, k = 13, 6, comm.size, comm.rank
    full = rng.standard_normal((t, e)).astype(F16)
    emb = pl.create_host_embedding("f16wire", shape=[t, e], dtype=F16, partition_strategy=strategy, initializer=full,
                                   exchange=exchange)
    idx = rng.integers(0, t, size=(r, 9))
    pl.reset_stats()
    out = emb.lookup(idx[k])
    stats = pl.stats()
    assert out.dtype == F16
    np.testing.assert_array_equal(out, full[idx[k]])
    if exchange == "sparse":  # distinct rows only, each to/from its owner, e float16 each
        rows = stats["phases"]["lookup.rows"]
        owned_by = lambda j, owner: int(np.count_nonzero(np.unique(idx[j]) % r == owner))
        assert rows["bytes_sent"] == sum(owned_by(j, k) for j in range(r) if j != k) * e * 2
        assert rows["bytes_received"] == sum(owned_by(k, o) for o in range(r) if o != k) * e * 2
        return
    index_bytes = 9 * 8 * (r - 1)  # the int64 index all-gather
    assert stats["collectives"]["all_gather_v"]["bytes_sent"] == index_bytes
    row_bytes = payload() - index_bytes
    if strategy == "TOKEN":  # each replica sends the other replicas' positions: (r-1) * 9 rows of e float16
        assert row_bytes == (r - 1) * 9 * e * 2
    else:  # ENCODING: r-1 column slices of c = ceil(e/r) float16 per index
        assert row_bytes == (r - 1) * 9 * (-(-e // r)) * 2


# -- dense optimizers: SGD, momentum, Adam; replicated tensor sharding ---------------------

SHAPES = {"w": (5, 3), "b": (3,), "z": (7,)}  # 25 elements: padded at 2, 3 and 4 replicas


def dense_params(rng, dtype=np.float32):
    params = {k: rng.standard_normal(s).astype(dtype) for k, s in SHAPES.items()}
    params["d"] = rng.standard_normal(4)  # a float64 parameter: its own fused group
    return params


def every_replicas_grads(rng, r, params):
    return [{k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in params.items()} for _ in range(r)]


class DenseReference:
    """float64 SGD / momentum / Adam on the mean of every replica's gradients."""

    def __init__(self, kind, params):
        self.kind, self.w = kind, {k: v.astype(np.float64) for k, v in params.items()}
        self.m = {k: np.zeros_like(v) for k, v in self.w.items()}
        self.v = {k: np.zeros_like(v) for k, v in self.w.items()}
        self.t = 0

    def step(self, all_grads):
        self.t += 1
        for k in self.w:
            g = np.mean([gr[k].astype(np.float64) for gr in all_grads], axis=0)
            if self.kind == "sgd":
                self.w[k] -= 0.1 * g
            elif self.kind == "momentum":
                self.m[k] = 0.9 * self.m[k] + g
                self.w[k] -= 0.1 * self.m[k]
            else:
                self.m[k] = 0.9 * self.m[k] + 0.1 * g
                self.v[k] = 0.999 * self.v[k] + 0.001 * g * g
                m_hat, v_hat = self.m[k] / (1 - 0.9 ** self.t), self.v[k] / (1 - 0.999 ** self.t)
                self.w[k] -= 0.01 * m_hat / (np.sqrt(v_hat) + 1e-8)


def make_optimizer(kind):
    return {"sgd": lambda: pl.SGD(0.1), "momentum": lambda: pl.MomentumSGD(0.1, momentum=0.9),
            "adam": lambda: pl.Adam(0.01, beta1=0.9, beta2=0.999, epsilon=1e-8)}[kind]()


@pytest.mark.mpi
@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("kind", ["sgd", "momentum", "adam"])
def test_dense_optimizer_matches_numpy(comm, rng, kind, sharded):
    params = dense_params(rng)
    ref = DenseReference(kind, params)
    opt = pl.CrossReplicaOptimizer(make_optimizer(kind), shard_optimizer_state=sharded)
    for _ in range(4):
        grads = every_replicas_grads(rng, comm.size, params)
        opt.step(params, grads[comm.rank])
        ref.step(grads)
    for k in params:
        assert params[k].dtype == (np.float64 if k == "d" else np.float32)
        np.testing.assert_allclose(params[k], ref.w[k], rtol=2e-5, atol=2e-6)
    gathered = pl.all_gather(params["w"])
    assert all(np.array_equal(gathered[0], g) for g in gathered)  # replicas stay identical


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["momentum", "adam"])
def test_sharded_equals_unsharded_with_a_fraction_of_the_state(comm, rng, kind):
    r = comm.size
    params = dense_params(rng)
    plain_params = {k: v.copy() for k, v in params.items()}
    sharded = pl.CrossReplicaOptimizer(make_optimizer(kind), shard_optimizer_state=True)
    plain = pl.CrossReplicaOptimizer(make_optimizer(kind))
    for _ in range(3):
        grads = every_replicas_grads(rng, r, params)[comm.rank]
        sharded.step(params, grads)
        plain.step(plain_params, grads)
    for k in params:
        np.testing.assert_allclose(params[k], plain_params[k], rtol=1e-6, atol=1e-7)
    slots = 2 if kind == "adam" else 1
    counter = 8 if kind == "adam" else 0
    n32, n64 = sum(int(np.prod(s)) for s in SHAPES.values()), 4
    assert plain.state_bytes() == slots * (4 * n32 + 8 * n64) + counter
    assert sharded.state_bytes() == slots * (4 * -(-n32 // r) + 8 * -(-n64 // r)) + counter
    total = int(pl.all_reduce(np.array([sharded.state_bytes()], np.int64))[0])
    assert total <= plain.state_bytes() + r * (slots * (4 + 8) + counter)  # 1/r each, up to padding


@pytest.mark.mpi
def test_sharded_step_moves_no_more_than_the_all_reduce(comm, rng):
    r = comm.size
    params = {"w": rng.standard_normal(8 * r).astype(np.float32)}
    grads = {"w": np.ones_like(params["w"])}
    plain, sharded = pl.CrossReplicaOptimizer(pl.SGD(0.1)), pl.CrossReplicaOptimizer(pl.SGD(0.1), shard_optimizer_state=True)
    b_plain = moved(plain.step, params, grads)[0]
    b_sharded = moved(sharded.step, params, grads)[0]
    nbytes = params["w"].nbytes
    assert b_plain == (r - 1) * nbytes  # one MPI Allreduce, as popdist_lite.counters counts it
    assert b_sharded == 2 * (r - 1) * nbytes // r  # reduce-scatter + all-gather of 1/r each: a ring all-reduce
    assert b_sharded <= b_plain  # equal at 2 replicas


# -- float16 dense weights: replica-identical stochastic rounding ---------------------------

def swamped_step(opt, params, steps=40):
    """Every step lowers every weight by 1e-4: less than half a float16 ulp at 1.0."""
    for _ in range(steps):
        opt.step(params, {"w": np.ones_like(params["w"])})
    return 1.0 - steps * 1e-4


@pytest.mark.mpi
@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("mode", ["ON", "REPLICA_IDENTICAL_ONLY"])
def test_f16_weights_round_identically_on_every_replica(comm, mode, sharded):
    params = {"w": np.ones(4096, F16)}
    opt = pl.CrossReplicaOptimizer(pl.SGD(1e-4), shard_optimizer_state=sharded, stochastic_rounding=mode, seed=3)
    target = swamped_step(opt, params)
    gathered = pl.all_gather(params["w"])
    assert all(np.array_equal(gathered[0], g) for g in gathered)  # bit-identical replicas
    mean = params["w"].astype(np.float64).mean()
    if sharded and mode == "REPLICA_IDENTICAL_ONLY":
        assert mean == 1.0  # shards are owned, not replica-identical: round to nearest, swamped
    else:
        assert abs(mean - target) < 5e-4  # unbiased: 40 roundings of std <= 2**-12 each, 4096 weights
    nearest = {"w": np.ones(4096, F16)}
    swamped_step(pl.CrossReplicaOptimizer(pl.SGD(1e-4)), nearest)
    assert np.all(nearest["w"] == 1.0)  # round to nearest: swamped, as in the FP16 tutorial


@pytest.mark.mpi(min_size=2)
def test_per_replica_random_streams_would_diverge(comm):
    """The negative control: the same update rounded with a different seed per replica
    leaves the replicas' weights different, which the identity check above would catch."""
    params = {"w": np.ones(4096, F16)}
    opt = pl.CrossReplicaOptimizer(pl.SGD(1e-4), stochastic_rounding="ON", seed=comm.rank)
    swamped_step(opt, params, steps=5)
    gathered = pl.all_gather(params["w"])
    assert not all(np.array_equal(gathered[0], g) for g in gathered)


# -- loss scaling: overflow on one replica only ---------------------------------------------

def scaled_setup(rng, comm, strategy="TOKEN"):
    params = {k: v for k, v in dense_params(rng).items() if k != "d"}
    opt = pl.CrossReplicaOptimizer(pl.Adam(0.01))
    emb = pl.create_host_embedding("ls", shape=[9, 4], dtype=F16, master_weights=np.float32,
                                   partition_strategy=strategy, seed=1,
                                   optimizer_spec=pl.HostEmbeddingAdamOptimizerSpec(0.01))
    return params, opt, emb


def snapshot(params, opt, emb):
    return ({k: v.copy() for k, v in params.items()},
            {k: {s: a.copy() for s, a in slots.items()} for k, slots in opt.optimizer.state.items()},
            opt.optimizer.steps, emb.get_embedding_tensor(master=True),
            {k: a.copy() for k, a in emb.optimizer_state.items()})


def assert_same(a, b):
    assert a[2] == b[2]
    np.testing.assert_array_equal(a[3], b[3])
    for k in a[0]:
        np.testing.assert_array_equal(a[0][k], b[0][k])
    for k in a[1]:
        for s in a[1][k]:
            np.testing.assert_array_equal(a[1][k][s], b[1][k][s])
    for k in a[4]:
        np.testing.assert_array_equal(a[4][k], b[4][k])


@pytest.mark.mpi
@pytest.mark.parametrize("where", ["dense", "embedding"])
@pytest.mark.parametrize("strategy", ["TOKEN", "ENCODING"])
def test_overflow_on_one_replica_skips_the_step_everywhere(comm, rng, where, strategy):
    r, bad = comm.size, comm.size - 1
    params, opt, emb = scaled_setup(rng, comm, strategy)
    scaler = pl.DynamicLossScaler(2.0 ** 10, growth_interval=2)
    idx = np.array([1, 2, 2])
    clean = lambda: ({k: (rng.standard_normal(v.shape) * scaler.scale).astype(F16) for k, v in params.items()},
                     (rng.standard_normal((3, 4)) * scaler.scale).astype(F16))
    # one clean step first, so the optimizer state is not trivially zero
    grads, egrads = clean()
    assert scaler.step(dense=(opt, params, grads), embeddings=[(emb, idx, egrads)])
    before = snapshot(params, opt, emb)
    grads, egrads = clean()
    if comm.rank == bad:
        if where == "dense":
            grads["b"][1] = np.inf
        else:
            egrads[2, 3] = np.nan
    pl.reset_stats()
    applied = scaler.step(dense=(opt, params, grads), embeddings=[(emb, idx, egrads)])
    stats = pl.stats()
    assert applied is False
    # one all-reduce of one int32 (and its argument check), nothing else: no exchange, no update
    assert set(stats["collectives"]) == {"agree", "all_reduce"} and stats["phases"] == {}
    assert stats["collectives"]["all_reduce"]["calls"] == stats["collectives"]["agree"]["calls"] == 1
    assert stats["collectives"]["all_reduce"]["bytes_sent"] == 4 * (r - 1)
    assert scaler.last_overflow_replica == bad and scaler.skipped_steps == 1
    assert scaler.scale == 2.0 ** 9  # halved
    assert_same(before, snapshot(params, opt, emb))  # weights and optimizer state unchanged everywhere
    # the next clean steps apply again; after growth_interval=2 clean steps the scale doubles
    for expected_scale in (2.0 ** 9, 2.0 ** 10):
        grads, egrads = clean()
        assert scaler.step(dense=(opt, params, grads), embeddings=[(emb, idx, egrads)])
        assert scaler.scale == expected_scale
    assert not np.array_equal(before[0]["w"], params["w"])


@pytest.mark.mpi
def test_static_scaler_skips_but_keeps_its_scale(comm):
    scaler = pl.StaticLossScaler(256)
    g = np.ones(3, F16)
    if comm.rank == 0:
        g[0] = np.inf
    assert scaler.found_overflow({"g": g}) is True
    scaler.update(True)
    assert scaler.scale == 256 and scaler.last_overflow_replica == 0
    assert scaler.found_overflow([np.ones(2, F16)], None) is False


@pytest.mark.mpi
@pytest.mark.parametrize("sharded", [False, True])
def test_loss_scaling_rescues_f16_gradients_that_would_underflow(comm, rng, sharded):
    r, scale = comm.size, 2.0 ** 14
    true = np.full(10, 2.0 ** -27) * (1 + np.arange(10) / 16)  # below float16's smallest subnormal
    assert np.all(true.astype(F16) == 0)
    params = {"w": np.zeros(10, np.float32)}
    opt = pl.CrossReplicaOptimizer(pl.SGD(1.0), shard_optimizer_state=sharded)
    scaler = pl.StaticLossScaler(scale)
    assert scaler.step(dense=(opt, params, {"w": (true * scale).astype(F16)}))
    np.testing.assert_array_equal(params["w"], (-true).astype(np.float32))  # exact: mean of equal values, /2**14
    unscaled = scaler.unscale({"w": (true * scale).astype(F16)})["w"]
    assert unscaled.dtype == np.float32 and np.array_equal(unscaled, true.astype(np.float32))
