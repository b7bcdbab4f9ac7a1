"""popdist_lite.torch's host embeddings at 1-4 replicas against single-process torch:
forward equal to nn.Embedding / nn.EmbeddingBag on the same weights; after 5 steps the
full table equals torch.optim (SGD, Adagrad, SparseAdam) on a dense copy trained with the
gradient of the global batch's loss; no update under no_grad or in eval mode, none twice
with retain_graph; an overflow on one replica skips the update on every replica."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="popdist_lite.torch needs PyTorch: pip install '.[torch]'")

import popdist_lite as pl  # noqa: E402
import popdist_lite.torch as pt  # noqa: E402

from disk_cache import cache_bytes  # noqa: E402

F = torch.nn.functional
STRATEGIES = ["TOKEN", "TOKEN/dense", "ENCODING"]


def layout(strategy):
    name, _, exchange = strategy.partition("/")
    return {"partition_strategy": name, **({"exchange": exchange} if exchange else {})}


def ragged_ids(rng, r, t, n_max=9):
    """Every replica's 1-D indices (some empty, with duplicates); the same on every rank."""
    ids = [rng.integers(0, t, size=int(rng.integers(0, n_max))) for _ in range(r)]
    ids[0] = np.concatenate([ids[0], [3, 3, 3]])
    return ids


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_forward_equals_nn_embedding(comm, rng, strategy):
    t, e = 13, 5
    emb = pt.HostEmbedding(t, e, **layout(strategy), seed=7)
    weight = emb.get_embedding_tensor()
    ref = torch.nn.Embedding.from_pretrained(weight)
    for ids in (ragged_ids(rng, comm.size, t)[comm.rank], rng.integers(0, t, size=(3, 4))):
        ids = torch.from_numpy(ids)
        out = emb(ids)
        assert out.shape == ids.shape + (e,) and out.dtype == torch.float32
        torch.testing.assert_close(out, ref(ids), rtol=0, atol=0)
    # padding_idx: those positions read as zeros (nn.Embedding's zero-initialised padding row)
    pad = pt.HostEmbedding(t, e, **layout(strategy), padding_idx=-2)
    assert pad.padding_idx == t - 2
    w = pad.get_embedding_tensor().clone()
    w[t - 2] = 0
    ids = torch.tensor([[t - 2, 1, 1], [0, t - 2, 12]])
    torch.testing.assert_close(pad(ids), torch.nn.Embedding.from_pretrained(w, padding_idx=t - 2)(ids))


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mode", ["sum", "mean", "sqrtn"])
def test_forward_equals_nn_embedding_bag(comm, rng, strategy, mode):
    t, e, r = 11, 6, comm.size
    bag = pt.HostEmbeddingBag(t, e, mode=mode, **layout(strategy), seed=3)
    weight = bag.get_embedding_tensor().double()
    # ragged bags (empty ones too) with per-sample weights, different on every replica
    lengths = [rng.integers(0, 4, size=5) for _ in range(r)]
    values = [rng.integers(0, t, size=int(n.sum())) for n in lengths]
    weights = [rng.uniform(0.5, 2.0, size=v.size) for v in values]
    n, v, w = lengths[comm.rank], values[comm.rank], weights[comm.rank]
    offsets = torch.from_numpy(np.cumsum(n) - n)
    got = bag(torch.from_numpy(v), offsets, torch.from_numpy(w).float())
    # the reference: nn.EmbeddingBag's sum with each weight divided by its bag's divisor
    bag_of = np.repeat(np.arange(n.size), n)
    divisor = {"sum": np.ones(n.size), "mean": np.bincount(bag_of, w, n.size),
               "sqrtn": np.sqrt(np.bincount(bag_of, w * w, n.size))}[mode]
    scaled = w / np.where(divisor == 0, 1, divisor)[bag_of]
    want = F.embedding_bag(torch.from_numpy(v), weight, offsets, mode="sum",
                           per_sample_weights=torch.from_numpy(scaled))
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    if mode != "sqrtn":
        # without weights, 2-D padded input, include_last_offset and padding_idx: torch itself
        ref = torch.nn.EmbeddingBag.from_pretrained(weight, mode=mode)
        torch.testing.assert_close(bag(torch.from_numpy(v), offsets).double(), ref(torch.from_numpy(v), offsets),
                                   rtol=1e-6, atol=1e-6)
        square = torch.from_numpy(rng.integers(0, t, size=(4, 3)))
        torch.testing.assert_close(bag(square).double(), ref(square), rtol=1e-6, atol=1e-6)
        last = pt.HostEmbeddingBag(t, e, mode=mode, **layout(strategy), seed=3, include_last_offset=True)
        ends = torch.from_numpy(np.append(np.cumsum(n) - n, v.size))
        ref_last = torch.nn.EmbeddingBag.from_pretrained(weight, mode=mode, include_last_offset=True)
        torch.testing.assert_close(last(torch.from_numpy(v), ends).double(), ref_last(torch.from_numpy(v), ends),
                                   rtol=1e-6, atol=1e-6)
        padded = pt.HostEmbeddingBag(t, e, mode=mode, **layout(strategy), seed=3, padding_idx=2)
        ref_pad = torch.nn.EmbeddingBag.from_pretrained(weight, mode=mode, padding_idx=2)
        with_pad = torch.tensor([2, 1, 2, 2, 5, 2, 7, 7])
        pad_offsets = torch.tensor([0, 2, 4, 4, 6])
        torch.testing.assert_close(padded(with_pad, pad_offsets).double(), ref_pad(with_pad, pad_offsets),
                                   rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(padded(with_pad.reshape(4, 2)).double(), ref_pad(with_pad.reshape(4, 2)),
                                   rtol=1e-6, atol=1e-6)


# Each optimizer: the host table's spec and torch.optim on a dense copy. SGD and Adagrad
# leave rows with a zero gradient unchanged, as the host tables' lazy updates do;
# SparseAdam (sparse gradients) updates only the rows present, with the global step count,
# which equals each row's own step count when every row is touched at every step (the
# batches below make sure of it for Adam).
OPTIMIZERS = {
    "sgd": (lambda: pl.HostEmbeddingOptimizerSpec(0.3), lambda w: torch.optim.SGD([w], lr=0.3)),
    "adagrad": (lambda: pl.HostEmbeddingAdagradOptimizerSpec(0.5, initial_accumulator_value=0.1, epsilon=1e-7),
                lambda w: torch.optim.Adagrad([w], lr=0.5, initial_accumulator_value=0.1, eps=1e-7)),
    "adam": (lambda: pl.HostEmbeddingAdamOptimizerSpec(0.05, beta1=0.9, beta2=0.99, epsilon=1e-8),
             lambda w: torch.optim.SparseAdam([w], lr=0.05, betas=(0.9, 0.99), eps=1e-8)),
}


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("bags", [False, True], ids=["embedding", "bag"])
def test_five_steps_equal_single_process_torch(comm, rng, strategy, kind, bags):
    r, t, e = comm.size, 11, 5
    spec, torch_optimizer = OPTIMIZERS[kind]
    if bags:
        host = pt.HostEmbeddingBag(t, e, mode="mean", **layout(strategy), optimizer_spec=spec(), seed=5)
    else:
        host = pt.HostEmbedding(t, e, **layout(strategy), optimizer_spec=spec(), seed=5)
    weight = torch.nn.Parameter(host.get_embedding_tensor().double())
    reference = torch_optimizer(weight)
    sparse = kind == "adam"
    for step in range(5):
        ids = ragged_ids(rng, r, t)
        if kind == "adam":
            ids[-1] = np.concatenate([ids[-1], np.arange(t)])  # every row at every step
        splits = [i.size // 2 for i in ids]  # two bags per replica, the first may be empty
        targets = [rng.standard_normal((2 if bags else i.size, e)) for i in ids]
        # this replica: loss_k = sum(out_k * target_k); the global loss is their mean
        mine = torch.from_numpy(ids[comm.rank])
        out = host(mine, torch.tensor([0, splits[comm.rank]])) if bags else host(mine)
        (out * torch.from_numpy(targets[comm.rank]).float()).sum().backward()
        # the reference: one process, the global batch, the mean of the replicas' losses
        reference.zero_grad()
        losses = []
        for k in range(r):
            idx = torch.from_numpy(ids[k])
            if bags:
                o = F.embedding_bag(idx, weight, torch.tensor([0, splits[k]]), mode="mean", sparse=sparse)
            else:
                o = F.embedding(idx, weight, sparse=sparse)
            losses.append((o * torch.from_numpy(targets[k])).sum())
        (sum(losses) / r).backward()
        reference.step()
        torch.testing.assert_close(host.get_embedding_tensor().double(), weight.detach(), rtol=2e-5, atol=2e-5)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_op_sum_adds_the_replicas_gradients(comm, strategy):
    emb = pt.HostEmbedding(6, 3, **layout(strategy), op="sum", optimizer_spec=pl.HostEmbeddingOptimizerSpec(0.5))
    before = emb.get_embedding_tensor().clone()
    emb(torch.tensor([1, 1, 4])).sum().backward()
    want = before.clone()
    want[1] -= 0.5 * 2 * comm.size
    want[4] -= 0.5 * comm.size
    torch.testing.assert_close(emb.get_embedding_tensor(), want)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_update_under_no_grad_or_in_eval_mode(comm, strategy):
    emb = pt.HostEmbedding(8, 4, **layout(strategy), optimizer_spec=pl.HostEmbeddingOptimizerSpec(1.0))
    before = emb.get_embedding_tensor().clone()
    ids = torch.tensor([0, 1, 2, 2])
    with torch.no_grad():
        out = emb(ids)
    assert not out.requires_grad
    emb.eval()
    out = emb(ids)
    assert not out.requires_grad
    emb.train()
    torch.testing.assert_close(emb.get_embedding_tensor(), before, rtol=0, atol=0)
    # a table that is not trainable never records a backward
    frozen = pt.HostEmbedding(8, 4, **layout(strategy))
    assert not frozen(ids).requires_grad


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_retain_graph_never_updates_twice(comm, strategy):
    emb = pt.HostEmbedding(8, 4, **layout(strategy), optimizer_spec=pl.HostEmbeddingOptimizerSpec(1.0))
    before = emb.get_embedding_tensor().clone()
    loss = emb(torch.tensor([2, 5, 5])).sum() * 2
    loss.backward(retain_graph=True)
    once = emb.get_embedding_tensor().clone()
    loss.backward()
    torch.testing.assert_close(emb.get_embedding_tensor(), once, rtol=0, atol=0)
    want = before.clone()
    want[2] -= 2.0
    want[5] -= 4.0  # mean over replicas of each replica's identical gradient
    torch.testing.assert_close(once, want)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_overflow_on_one_replica_skips_the_update_everywhere(comm, strategy):
    r = comm.size
    scaler = pt.GradScaler(init_scale=2.0 ** 10, growth_interval=100)
    emb = pt.HostEmbedding(8, 4, **layout(strategy), dtype=torch.float16, master_weights=torch.float32,
                           optimizer_spec=pl.HostEmbeddingOptimizerSpec(1.0), grad_scaler=scaler)
    dense = torch.nn.Linear(4, 1).double()
    opt = torch.optim.SGD(dense.parameters(), lr=0.1)
    dense_before = [p.detach().clone() for p in dense.parameters()]
    before = emb.get_embedding_tensor(master=True).clone()
    out = emb(torch.tensor([[1, 2], [3, 3]]))
    factor = float("nan") if comm.rank == r - 1 else 1.0
    scaler.scale(dense(out.double()).sum() * factor).backward()
    assert scaler.step(opt) is False
    scaler.update()
    torch.testing.assert_close(emb.get_embedding_tensor(master=True), before, rtol=0, atol=0)
    for p, b in zip(dense.parameters(), dense_before):
        torch.testing.assert_close(p.detach(), b, rtol=0, atol=0)
    assert scaler.get_scale() == 2.0 ** 9 and scaler.loss_scaler.last_overflow_replica == r - 1
    assert scaler.loss_scaler.skipped_steps == 1
    # the next, clean step applies, divided by the new scale (float16 grads, float32 master)
    opt.zero_grad()
    scaler.scale(emb(torch.tensor([1])).float().sum()).backward()
    assert scaler.step(opt) is True
    scaler.update()
    want = before.clone()
    want[1] -= 1.0
    torch.testing.assert_close(emb.get_embedding_tensor(master=True), want)


@pytest.mark.mpi
@pytest.mark.parametrize("options", ["fp16_master_sr", "minibatching", "dropping", "sgd_ga"])
def test_table_options_train_as_the_reference(comm, rng, options):
    """fp16 lookups with FP32 master weights and stochastic rounding; ID limits with
    minibatching (results equal one pass); SGD with gradient accumulation."""
    r, t, e = comm.size, 12, 4
    kw = {"fp16_master_sr": {"dtype": torch.float16, "master_weights": torch.float32, "stochastic_rounding": "ON"},
          "minibatching": {"max_unique_ids_per_partition": 2, "enable_minibatching": True},
          "dropping": {"max_ids_per_partition": 1000},  # limits that never bind: nothing dropped
          "sgd_ga": {}}[options]
    spec = (pl.HostEmbeddingSGDGAOptimizerSpec(0.2, accumulation_factor=2) if options == "sgd_ga"
            else pl.HostEmbeddingOptimizerSpec(0.2))
    emb = pt.HostEmbedding(t, e, optimizer_spec=spec, seed=11, **kw)
    weight = emb.get_embedding_tensor(master=options == "fp16_master_sr").double().clone()
    pending = torch.zeros_like(weight)
    for step in range(4):
        ids = [rng.integers(0, t, size=7) for _ in range(r)]
        emb(torch.from_numpy(ids[comm.rank])).float().sum().backward()
        g = torch.zeros_like(weight)
        for i in ids:
            g.index_add_(0, torch.from_numpy(i), torch.ones(i.size, e, dtype=torch.float64))
        pending += g / r
        if options != "sgd_ga" or step % 2 == 1:
            weight -= 0.2 * pending
            pending.zero_()
    got = emb.get_embedding_tensor(master=options == "fp16_master_sr").double()
    torch.testing.assert_close(got, weight, rtol=1e-5, atol=1e-5)


@pytest.mark.mpi
def test_bad_input_on_one_replica_raises_on_every_replica(comm):
    r, last = comm.size, comm.rank == comm.size - 1
    emb = pt.HostEmbedding(5, 2, optimizer_spec=pl.HostEmbeddingOptimizerSpec(0.1))
    with pytest.raises(IndexError, match=f"replica {r - 1}"):
        emb(torch.tensor([1, 7 if last else 2]))
    bag = pt.HostEmbeddingBag(5, 2, mode="sum")
    with pytest.raises(ValueError, match=rf"HostEmbeddingBag: replica {r - 1}: module .*argument offsets: expected "
                                         r"non-decreasing offsets starting at 0"):
        bag(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1] if last else [0, 1, 2]))
    with pytest.raises(ValueError, match=rf"replica {r - 1}: .*argument per_sample_weights"):
        bag(torch.tensor([1, 2]), torch.tensor([0]), torch.ones(2, requires_grad=last))
    with pytest.raises(ValueError, match=rf"replica {r - 1}: .*argument mode"):
        pt.HostEmbeddingBag(5, 2, mode="max" if last else "sum")
    if r > 1:
        with pytest.raises(ValueError, match=rf"replica {r - 1} has .*expected .* as on replica 0"):
            pt.HostEmbedding(5, 2, padding_idx=1 if last else 0)
    # still in step: the next collective works everywhere
    assert float(bag(torch.tensor([[1, 2]])).sum()) == pytest.approx(float(bag.get_embedding_tensor()[[1, 2]].sum()))


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mode", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("case", ["unit", "weighted", "padding", "last_offset", "2d", "fp16"])
def test_bag_step_equals_the_numpy_bag_api(comm, rng, strategy, mode, case):
    """HostEmbeddingBag's lookup and update are the table's lookup_bags and
    apply_bag_gradients (loss_scale = the replica count, op="mean"): the same values
    and the same table, bit for bit, after three steps."""
    t, e, r = 17, 4, comm.size
    dtype = torch.float16 if case == "fp16" else torch.float32
    np_dtype = np.float16 if case == "fp16" else np.float32
    pad = 3 if case == "padding" else None
    spec = pl.HostEmbeddingOptimizerSpec(0.5)
    module = pt.HostEmbeddingBag(t, e, mode=mode, **layout(strategy), optimizer_spec=spec, seed=9, dtype=dtype,
                                 padding_idx=pad, include_last_offset=case == "last_offset")
    table = pl.create_host_embedding(f"bag_numpy_{case}", shape=[t, e], dtype=np_dtype, optimizer_spec=spec,
                                     seed=9, **layout(strategy))
    for _ in range(3):
        lengths = [np.ones(6, np.int64) if case == "unit" else rng.integers(0, 4, size=5) for _ in range(r)]
        values = [rng.integers(0, t, size=(5, 3) if case == "2d" else int(n.sum())) for n in lengths]
        weights = [rng.uniform(0.5, 2.0, size=v.shape).astype(np.float32) if case == "weighted" else None
                   for v in values]
        n, v, w = lengths[comm.rank], values[comm.rank], weights[comm.rank]
        grad = rng.standard_normal((r, v.shape[0] if case == "2d" else n.size, e))[comm.rank].astype(np_dtype)
        offsets = None if case == "2d" else torch.from_numpy(np.cumsum(n) - n)
        if case == "last_offset":
            offsets = torch.from_numpy(np.append(offsets.numpy(), v.size))
        psw = None if w is None else torch.from_numpy(w)
        out = module(torch.from_numpy(v), offsets, psw)
        out.backward(torch.from_numpy(grad))
        # the numpy API on the same bags
        if case == "2d":
            want = table.lookup_bags(v, combiner=mode)
            table.apply_bag_gradients(v, grad, combiner=mode, loss_scale=r)
        else:
            keep = v != pad if pad is not None else np.ones(v.size, bool)
            kept = np.bincount(np.repeat(np.arange(n.size), n)[keep], minlength=n.size)
            ww = None if w is None else w[keep]
            want = table.lookup_bags(v[keep], kept, ww, combiner=mode)
            table.apply_bag_gradients(v[keep], grad, kept, ww, combiner=mode, loss_scale=r)
        assert out.dtype == dtype
        np.testing.assert_array_equal(out.detach().numpy(), want)
    np.testing.assert_array_equal(module.table.get_embedding_tensor(), table.get_embedding_tensor())


@pytest.mark.mpi
@pytest.mark.parametrize("bags", [False, True], ids=["embedding", "bag"])
def test_rows_and_gradient_cross_without_a_copy(comm, bags):
    """The table's rows become the output, and the output's gradient reaches the
    table's update, without a copy (one ID per bag: pooling is the identity); the
    graph holds no reference to the output or its gradient after backward."""
    import gc
    import weakref

    spec = pl.HostEmbeddingOptimizerSpec(0.1)
    module = (pt.HostEmbeddingBag(9, 4, mode="sum", optimizer_spec=spec) if bags
              else pt.HostEmbedding(9, 4, optimizer_spec=spec))
    seen = {}
    table = module.table
    lookup, update = (table._lookup_bags, table.apply_bag_gradients) if bags else (table.lookup, table.apply_gradients)

    def spy_lookup(*args, **kwargs):
        seen["rows"] = lookup(*args, **kwargs)
        return seen["rows"]

    def spy_update(values, grads, *args, **kwargs):
        seen["grads"] = grads
        return update(values, grads, *args, **kwargs)

    setattr(table, "_lookup_bags" if bags else "lookup", spy_lookup)
    setattr(table, "apply_bag_gradients" if bags else "apply_gradients", spy_update)
    ids = torch.tensor([1, 5, 5, 8])
    out = module(ids, torch.arange(4)) if bags else module(ids)
    assert np.shares_memory(out.detach().numpy(), seen["rows"])
    grad = torch.ones(4, 4)
    out.backward(grad)
    assert np.shares_memory(seen["grads"], grad.numpy())
    seen.clear()
    alive = weakref.ref(out)
    del out
    gc.collect()
    assert alive() is None


@pytest.mark.mpi
@pytest.mark.parametrize("options", [{}, {"exchange": "dense"}, {"partition_strategy": "ENCODING"},
                                     {"max_ids_per_partition": 4, "enable_minibatching": True}],
                         ids=["sparse", "dense", "encoding", "id-limits"])
def test_bad_bag_argument_raises_everywhere_through_the_tables_agreement(comm, options):
    """A malformed offsets on the last replica is raised on every replica, named as the
    module's, by the table's own lookup (whatever exchange or ID limits it has); the
    replicas stay in step and nothing was updated."""
    r, last = comm.size, comm.rank == comm.size - 1
    bag = pt.HostEmbeddingBag(7, 3, mode="mean", optimizer_spec=pl.HostEmbeddingOptimizerSpec(0.5), **options)
    before = bag.get_embedding_tensor().clone()
    with pytest.raises(ValueError, match=rf"HostEmbeddingBag: replica {r - 1}: module .*argument offsets"):
        bag(torch.tensor([1, 2, 3]), torch.tensor([1, 2] if last else [0, 2]))
    out = bag(torch.tensor([1, 2, 3]), torch.tensor([0, 2]))
    out.sum().backward()
    weight = before.double()
    want = torch.nn.EmbeddingBag.from_pretrained(weight, mode="mean")(torch.tensor([1, 2, 3]), torch.tensor([0, 2]))
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)
    assert not torch.equal(bag.get_embedding_tensor(), before)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["TOKEN", "ENCODING"])
@pytest.mark.parametrize("bags", [False, True], ids=["embedding", "bag"])
def test_disk_table_trains_as_the_in_memory_one(comm, rng, tmp_path, strategy, bags):
    """A module whose table is on local disk (``storage=DiskStorage``, a cache of one
    call's IDs and two rows more, so rows are evicted and read back wherever the steps
    touch more rows of a partition) gives the in-memory module's outputs and, after the
    steps, its table and Adam state, bit for bit."""
    r, t, e, n = comm.size, 40, 4, 7
    spec = pl.HostEmbeddingAdamOptimizerSpec(0.05)
    disk = pl.DiskStorage(cache_bytes({"partition_strategy": strategy}, spec, e, r, n * r + 2),
                          directory=str(tmp_path))
    kind, extra = (pt.HostEmbeddingBag, {"mode": "mean"}) if bags else (pt.HostEmbedding, {})
    memory_module = kind(t, e, optimizer_spec=spec, partition_strategy=strategy, seed=5, name="m", **extra)
    disk_module = kind(t, e, optimizer_spec=pl.HostEmbeddingAdamOptimizerSpec(0.05), partition_strategy=strategy,
                       seed=5, name="d", storage=disk, **extra)
    trace = [rng.integers(0, t, size=(r, n)) for _ in range(12)]
    for step, all_ids in enumerate(trace):
        ids = torch.from_numpy(all_ids[comm.rank])
        scale = torch.from_numpy(rng.standard_normal((r, n, e))[comm.rank].astype(np.float32))
        if bags:
            ids, scale = ids.reshape(1, n), scale[0, :1]
        outs = []
        for module in (memory_module, disk_module):
            out = module(ids)
            (out * scale).sum().backward()
            outs.append(out.detach())
        assert outs[0].numpy().tobytes() == outs[1].numpy().tobytes(), f"step {step}"
    stats = disk_module.table.storage_stats
    assert stats["rows_read"] > 0 and stats["hits"] > 0
    touched = np.unique(np.concatenate(trace, axis=None))
    if strategy == "TOKEN":
        touched = touched[touched % r == comm.rank]
    if touched.size > stats["cache_rows"]:  # this replica touched more rows than its cache holds
        assert stats["evictions"] > 0 and stats["rows_written"] > 0
    a, b = memory_module.table.state().arrays, disk_module.table.state().arrays
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].tobytes() == np.asarray(b[key]).tobytes(), key
