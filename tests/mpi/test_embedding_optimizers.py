"""Host-embedding optimizers and precision against a numpy reference at 1-4 replicas,
both partition strategies (TOKEN with the sparse and the dense exchange): SGD, SGD with
gradient accumulation, momentum, Adagrad (element-wise and row-wise), Adam; FP32
master weights; stochastic rounding of rows."""

import numpy as np
import pytest

import popdist_lite as pl

# TOKEN tables use their default, the sparse exchange; "TOKEN/dense" is the TF-IPU guide's exchange.
STRATEGIES = ["TOKEN", "TOKEN/dense", "ENCODING"]
SPECS = {
    "sgd": lambda: pl.HostEmbeddingOptimizerSpec(0.3),
    "sgd_ga": lambda: pl.HostEmbeddingSGDGAOptimizerSpec(0.3, accumulation_factor=2),
    "momentum": lambda: pl.HostEmbeddingMomentumOptimizerSpec(0.2, momentum=0.8),
    "adagrad": lambda: pl.HostEmbeddingAdagradOptimizerSpec(0.5, initial_accumulator_value=0.1, epsilon=1e-7),
    "adagrad_rowwise": lambda: pl.HostEmbeddingAdagradOptimizerSpec(0.5, initial_accumulator_value=0.1,
                                                                    epsilon=1e-7, rowwise=True),
    "adam": lambda: pl.HostEmbeddingAdamOptimizerSpec(0.05, beta1=0.9, beta2=0.99, epsilon=1e-8),
}


def layout(strategy):
    """create_host_embedding keywords for a STRATEGIES entry."""
    name, _, exchange = strategy.partition("/")
    return {"partition_strategy": name, **({"exchange": exchange} if exchange else {})}


class Reference:
    """The whole (t, e) table and its optimizer in float64, written from the formulas
    (TensorFlow/Keras, FBGEMM row-wise Adagrad, Adam with per-row step counts); only
    rows that appear in a step are updated, once, with the sum of their gradients."""

    def __init__(self, kind, table):
        self.kind, self.w = kind, table.astype(np.float64)
        t, e = table.shape
        self.m, self.v = np.zeros((t, e)), np.zeros((t, e))
        self.acc = np.full((t, e), 0.1)
        self.acc_row = np.full(t, 0.1)
        self.steps = np.zeros(t)
        self.ga, self.ga_touched, self.calls = np.zeros((t, e)), np.zeros(t, bool), 0

    def step(self, all_indices, all_grads):
        t, e = self.w.shape
        g = np.zeros((t, e))
        touched = np.zeros(t, bool)
        for idx, gr in zip(all_indices, all_grads):
            np.add.at(g, idx.reshape(-1), gr.reshape(-1, e).astype(np.float64))
            touched[idx.reshape(-1)] = True
        T = touched
        k = self.kind
        if k == "sgd":
            self.w[T] -= 0.3 * g[T]
        elif k == "sgd_ga":
            self.ga[T] += g[T]
            self.ga_touched |= T
            self.calls += 1
            if self.calls % 2 == 0:
                self.w[self.ga_touched] -= 0.3 * self.ga[self.ga_touched]
                self.ga[:] = 0
                self.ga_touched[:] = False
        elif k == "momentum":
            self.v[T] = 0.8 * self.v[T] + g[T]
            self.w[T] -= 0.2 * self.v[T]
        elif k == "adagrad":
            self.acc[T] += g[T] ** 2
            self.w[T] -= 0.5 * g[T] / (np.sqrt(self.acc[T]) + 1e-7)
        elif k == "adagrad_rowwise":
            self.acc_row[T] += (g[T] ** 2).mean(axis=1)
            self.w[T] -= 0.5 * g[T] / (np.sqrt(self.acc_row[T])[:, None] + 1e-7)
        elif k == "adam":
            self.steps[T] += 1
            n = self.steps[T][:, None]
            self.m[T] = 0.9 * self.m[T] + 0.1 * g[T]
            self.v[T] = 0.99 * self.v[T] + 0.01 * g[T] ** 2
            self.w[T] -= 0.05 * (self.m[T] / (1 - 0.9 ** n)) / (np.sqrt(self.v[T] / (1 - 0.99 ** n)) + 1e-8)


def batches(rng, r, t, e, steps):
    """Per step, every replica's indices (ragged, with duplicates; some replicas empty)
    and gradients; the same on every rank."""
    out = []
    for s in range(steps):
        idx = [rng.integers(0, t // 2 if s % 2 else t, size=((k + s) % 3 * 3,)) for k in range(r)]
        idx[0] = np.concatenate([idx[0], idx[0][:2]])  # explicit duplicates
        out.append((idx, [rng.standard_normal(i.shape + (e,)).astype(np.float32) for i in idx]))
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", list(SPECS))
def test_optimizer_matches_numpy(comm, rng, strategy, kind):
    r, t, e = comm.size, 11, 5  # neither divisible by 2, 3 or 4: padded rows and columns
    full = rng.standard_normal((t, e)).astype(np.float32)
    spec = SPECS[kind]()
    emb = pl.create_host_embedding(f"opt_{kind}", shape=[t, e], **layout(strategy),
                                   optimizer_spec=spec, initializer=full)
    ref = Reference(kind, full)
    for idx, grads in batches(rng, r, t, e, steps=5):
        emb.apply_gradients(idx[comm.rank], grads[comm.rank])
        ref.step(idx, grads)
        np.testing.assert_allclose(emb.lookup(np.arange(t)), ref.w, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(emb.get_embedding_tensor(), ref.w, rtol=2e-5, atol=2e-5)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", ["momentum", "adagrad", "adagrad_rowwise", "adam", "sgd_ga"])
def test_state_lives_in_the_owning_partition(comm, strategy, kind):
    r, t, e = comm.size, 12, 8
    emb = pl.create_host_embedding(f"state_{kind}", shape=[t, e], **layout(strategy),
                                   optimizer_spec=SPECS[kind]())
    shard = emb.local_shard.shape
    assert shard == ((-(-t // r), e) if strategy.startswith("TOKEN") else (t, -(-e // r)))
    for name, a in emb.optimizer_state.items():
        assert a.shape in (shard, shard[:1], (1,)), (name, a.shape)
    per_element = {"momentum": 4, "adagrad": 4, "adagrad_rowwise": 0, "adam": 8, "sgd_ga": 4}[kind]
    per_row = {"momentum": 0, "adagrad": 0, "adagrad_rowwise": 4, "adam": 8, "sgd_ga": 1}[kind]
    expected = shard[0] * shard[1] * per_element + shard[0] * per_row + (8 if kind == "sgd_ga" else 0)
    assert emb.optimizer_state_bytes == expected
    total = int(pl.all_reduce(np.array([emb.optimizer_state_bytes], np.int64))[0])
    single = t * e * per_element + t * per_row + (8 if kind == "sgd_ga" else 0)
    extra = 8 if kind == "sgd_ga" else 0  # the call counter, one per replica
    if strategy.startswith("TOKEN"):  # rows split (12 divides by 1-4): all state divides by r
        assert total == single + (r - 1) * extra
    else:  # columns split (padded to r * ceil(e/r)): element state divides; each column
        c = -(-e // r)  # owner keeps the per-row scalars of every row
        assert total == t * r * c * per_element + r * (t * per_row + extra)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradient_accumulation_applies_every_factor_calls(comm, rng, strategy):
    t, e = 6, 3
    full = rng.standard_normal((t, e)).astype(np.float32)
    emb = pl.create_host_embedding("ga", shape=[t, e], **layout(strategy), initializer=full,
                                   optimizer_spec=pl.HostEmbeddingSGDGAOptimizerSpec(0.5, accumulation_factor=3))
    ones = np.ones((1, e), np.float32)
    for call in range(1, 7):
        emb.apply_gradients(np.array([call % 2]), ones)  # rows 1, 0, 1 | 0, 1, 0
        got = emb.get_embedding_tensor()
        expected = full.copy()
        if call >= 3:
            expected[1] -= 0.5 * 2 * comm.size
            expected[0] -= 0.5 * 1 * comm.size
        if call >= 6:
            expected[1] -= 0.5 * 1 * comm.size
            expected[0] -= 0.5 * 2 * comm.size
        np.testing.assert_allclose(got, expected, rtol=1e-6)


def swamping_table(strategy, **kw):
    return pl.create_host_embedding("swamp", shape=[8, 16], **layout(strategy),
                                    optimizer_spec=pl.HostEmbeddingOptimizerSpec(1e-4),
                                    initializer=np.ones((8, 16), np.float32), **kw)


def run_swamping(comm, emb, steps=200):
    """Each step subtracts 1e-4 from every element (replica 0 sends the gradients):
    below half a float16 ulp at 1.0 (2**-11), so round-to-nearest storage never moves."""
    idx = np.arange(8) if comm.rank == 0 else np.zeros(0, np.int64)
    grads = np.ones(idx.shape + (16,), np.float32)
    for _ in range(steps):
        emb.apply_gradients(idx, grads)
    return steps * 1e-4


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fp16_storage_swamps_master_weights_do_not(comm, strategy):
    plain = swamping_table(strategy, dtype=np.float16)
    drop = run_swamping(comm, plain)
    assert np.all(plain.get_embedding_tensor() == 1.0)  # swamped: the FP16 tutorial's failure mode
    master = swamping_table(strategy, dtype=np.float16, master_weights=np.float32)
    run_swamping(comm, master)
    assert master.local_shard.dtype == np.float32 and master.lookup(np.array([0])).dtype == np.float16
    expected = np.float32(1.0) - np.float32(drop)
    np.testing.assert_allclose(master.get_embedding_tensor(master=True), expected, rtol=1e-5)
    np.testing.assert_array_equal(master.get_embedding_tensor(), np.full((8, 16), expected, np.float16))
    np.testing.assert_array_equal(master.lookup(np.arange(8)), np.full((8, 16), expected, np.float16))


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fp16_storage_with_stochastic_rounding(comm, strategy):
    sr = swamping_table(strategy, dtype=np.float16, stochastic_rounding="ON")
    drop = run_swamping(comm, sr)
    table = sr.get_embedding_tensor().astype(np.float64)
    # 128 elements, each a sum of 200 unbiased roundings (std <= sqrt(200) * 2**-11 / 2 each)
    assert abs(table.mean() - (1 - drop)) < 0.004
    assert len(np.unique(table)) > 1
    only = swamping_table(strategy, dtype=np.float16, stochastic_rounding="REPLICA_IDENTICAL_ONLY")
    run_swamping(comm, only, steps=20)
    assert np.all(only.get_embedding_tensor() == 1.0)  # rows are owned, not replica-identical: nearest


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_loss_scale_is_divided_out_in_float32(comm, rng, strategy):
    t, e, scale, lr = 7, 4, 2.0 ** 12, 1024.0
    full = rng.standard_normal((t, e)).astype(np.float32)
    emb = pl.create_host_embedding("scaled", shape=[t, e], dtype=np.float16, master_weights=np.float32,
                                   **layout(strategy), initializer=full,
                                   optimizer_spec=pl.HostEmbeddingOptimizerSpec(lr))
    tiny = np.full((2, e), 2.0 ** -26, np.float32)  # underflows to 0 in float16 unless scaled
    assert np.all(tiny.astype(np.float16) == 0)
    emb.apply_gradients(np.array([1, 1]), (tiny * scale).astype(np.float16), loss_scale=scale)
    expected = full.copy()
    expected[1] -= np.float32(lr * 2 * comm.size * 2.0 ** -26)
    np.testing.assert_array_equal(emb.get_embedding_tensor(master=True), expected)
    assert not np.array_equal(expected, full)


@pytest.mark.mpi
def test_spec_errors(comm):
    with pytest.raises(ValueError, match="accumulation_factor: expected an integer >= 1, got 0"):
        pl.HostEmbeddingSGDGAOptimizerSpec(0.1, 0)
    with pytest.raises(ValueError, match="momentum"):
        pl.HostEmbeddingMomentumOptimizerSpec(0.1, momentum=1.0)
    with pytest.raises(ValueError, match="beta2"):
        pl.HostEmbeddingAdamOptimizerSpec(0.1, beta2=-0.1)
    with pytest.raises(TypeError, match="argument master_weights"):
        pl.create_host_embedding("x", shape=[4, 4], dtype=np.float32, master_weights=np.float16)
    with pytest.raises(ValueError, match="stochastic rounding: expected one of"):
        pl.create_host_embedding("x", shape=[4, 4], dtype=np.float16, stochastic_rounding="maybe")
    if comm.size > 1:
        last = comm.rank == comm.size - 1
        spec = pl.HostEmbeddingAdamOptimizerSpec(0.1 if last else 0.2)
        with pytest.raises(ValueError, match=rf"replica {comm.size - 1} passed \(name, shape, dtype, strategy, optimizer"):
            pl.create_host_embedding("x", shape=[4, 4], optimizer_spec=spec)
