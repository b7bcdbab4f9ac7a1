"""popdist_lite.torch's dense data parallelism at 1-4 replicas against single-process
torch: the gradients after DistributedDataParallel's backward (and after
all_reduce_gradients) equal the gradient of the global batch's mean loss; a model of host
embeddings and dense layers trains as one process on the global batch; parameters
broadcast from the root; mismatched models are named on every replica."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="popdist_lite.torch needs PyTorch: pip install '.[torch]'")

import popdist_lite as pl  # noqa: E402
import popdist_lite.torch as pt  # noqa: E402


class Net(torch.nn.Module):
    """Three dtypes' worth of parameters, one of them unused on some replicas."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(6, 8)
        self.b = torch.nn.Linear(8, 3)
        self.c = torch.nn.Linear(6, 3).double()
        self.frozen = torch.nn.Linear(2, 2).requires_grad_(False)
        self.sometimes = torch.nn.Parameter(torch.randn(3))

    def forward(self, x, use_sometimes):
        y = self.b(torch.tanh(self.a(x))) + self.c(x.double()).float()
        return y * self.sometimes if use_sometimes else y


def global_batch(rng, r):
    xs = [torch.from_numpy(rng.standard_normal((int(rng.integers(1, 5)), 6)).astype(np.float32)) for _ in range(r)]
    return xs, [k % 2 == 0 for k in range(r)]


def reference_grads(net, xs, uses):
    net.zero_grad()
    (sum((net(x, u) ** 2).sum() for x, u in zip(xs, uses)) / len(xs)).backward()
    return {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in net.named_parameters()
            if p.requires_grad}


@pytest.mark.mpi
@pytest.mark.parametrize("as_view", [True, False], ids=["bucket_view", "copy"])
@pytest.mark.parametrize("bucket_cap_mb", [25.0, 1e-4])  # one bucket per dtype; one per parameter
def test_ddp_gradients_equal_the_global_batch_gradient(comm, rng, as_view, bucket_cap_mb):
    r = comm.size
    ddp = pt.DistributedDataParallel(Net(seed=comm.rank), bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=as_view)
    assert len(ddp.buckets) == (2 if bucket_cap_mb > 1 else 7)
    assert "frozen.weight" not in sum(ddp.buckets, [])
    reference = Net(seed=0)  # replica 0's initial weights, which every replica now holds
    for p, q in zip(ddp.module.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        xs, uses = global_batch(rng, r)
        opt.zero_grad(set_to_none=step != 1)  # after set_to_none the gradients are copied into the buckets
        (ddp(xs[comm.rank], uses[comm.rank]) ** 2).sum().backward()
        want = reference_grads(reference, xs, uses)
        for name, p in ddp.module.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(p.grad, want[name], rtol=1e-5, atol=1e-6, msg=f"step {step}: {name}")
        opt.step()
        ref_opt.step()
    if as_view:  # .grad are views of the buckets: no copy back
        buckets = ddp._buckets
        assert all(p.grad.data_ptr() == b.views[i].data_ptr() for b in buckets for i, p in enumerate(b.params))
    gathered = pl.all_gather(ddp.module.a.weight.detach().numpy())
    assert all(np.array_equal(g, gathered[0]) for g in gathered)  # replicas stay identical


@pytest.mark.mpi
def test_no_sync_accumulates_then_reduces_the_sum(comm, rng):
    r = comm.size
    ddp = pt.DistributedDataParallel(Net(seed=1))
    reference = Net(seed=1)
    xs1, uses = global_batch(rng, r)
    xs2, _ = global_batch(rng, r)
    with ddp.no_sync():
        (ddp(xs1[comm.rank], uses[comm.rank]) ** 2).sum().backward()
    local = ddp.module.a.weight.grad.clone()
    (ddp(xs2[comm.rank], uses[comm.rank]) ** 2).sum().backward()
    g1, g2 = reference_grads(reference, xs1, uses), reference_grads(reference, xs2, uses)
    for name, p in ddp.module.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, g1[name] + g2[name], rtol=1e-5, atol=1e-6)
    assert local.shape == ddp.module.a.weight.shape


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["mean", "sum"])
def test_allreduce_gradients(comm, rng, op):
    r = comm.size
    net = Net(seed=comm.rank)
    pt.broadcast_parameters(net)
    xs, uses = global_batch(rng, r)
    (net(xs[comm.rank], uses[comm.rank]) ** 2).sum().backward()
    pt.all_reduce_gradients(net, op=op)
    want = reference_grads(Net(seed=0), xs, uses)
    for name, p in net.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, want[name] * (r if op == "sum" else 1), rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
def test_broadcast_parameters_module_and_state_dict(comm):
    net = Net(seed=comm.rank)
    net.register_buffer("counter", torch.tensor([comm.rank, 7], dtype=torch.int64))
    weight = net.a.weight
    pt.broadcast_parameters(net, root=comm.size - 1)
    assert net.a.weight is weight  # in place
    ref = Net(seed=comm.size - 1)
    torch.testing.assert_close(net.c.weight, ref.c.weight, rtol=0, atol=0)
    assert net.counter.tolist() == [comm.size - 1, 7]
    sd = {"x": torch.full((3,), float(comm.rank), dtype=torch.bfloat16), "y": torch.arange(4) * comm.rank}
    pt.broadcast_parameters(sd)
    assert sd["x"].tolist() == [0.0] * 3 and sd["y"].tolist() == [0] * 4


@pytest.mark.mpi
def test_mismatched_models_raise_on_every_replica(comm):
    r, last = comm.size, comm.rank == comm.size - 1
    if r == 1:
        pytest.skip("needs two replicas")
    net = Net(seed=0)
    if last:
        net.extra = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=rf"DistributedDataParallel: replica {r - 1} has \('extra.weight'"):
        pt.DistributedDataParallel(net)
    shapes = {"w": torch.zeros(3 if last else 2)}
    with pytest.raises(ValueError, match=rf"broadcast_parameters: replica {r - 1} has \('w', \(3,\)"):
        pt.broadcast_parameters(shapes)
    with pytest.raises(ValueError, match=rf"replica {r - 1}: argument op"):
        pt.DistributedDataParallel(Net(seed=0), op="max" if last else "mean")
    assert pl.all_reduce(np.array([1]))[0] == r  # still in step


class Recommender(torch.nn.Module):
    """Host embeddings (a table and a bag) feeding dense layers."""

    def __init__(self, strategy, seed):
        super().__init__()
        name, _, exchange = strategy.partition("/")
        kw = {"partition_strategy": name, **({"exchange": exchange} if exchange else {})}
        self.emb = pt.HostEmbedding(17, 4, optimizer_spec=pl.HostEmbeddingAdagradOptimizerSpec(0.3), seed=seed, **kw)
        self.bag = pt.HostEmbeddingBag(9, 4, mode="sum", optimizer_spec=pl.HostEmbeddingOptimizerSpec(0.2),
                                       seed=seed + 1, **kw)
        torch.manual_seed(seed)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.ReLU(), torch.nn.Linear(5, 1))

    def forward(self, ids, bag_ids):
        return self.mlp(torch.cat([self.emb(ids), self.bag(bag_ids)], dim=1))


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["TOKEN", "TOKEN/dense", "ENCODING"])
def test_host_embeddings_and_ddp_train_as_one_process(comm, rng, strategy):
    r = comm.size
    model = Recommender(strategy, seed=3)
    ddp = pt.DistributedDataParallel(model)
    assert all("emb" not in n and "bag" not in n for n in sum(ddp.buckets, []))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    # the reference: dense copies of both tables and the MLP, one process, global batch
    torch.manual_seed(3)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.ReLU(), torch.nn.Linear(5, 1)).double()
    table = torch.nn.Parameter(model.emb.get_embedding_tensor().double())
    bag_table = torch.nn.Parameter(model.bag.get_embedding_tensor().double())
    ref_opt = torch.optim.SGD(mlp.parameters(), lr=0.1, momentum=0.9)
    table_opt = torch.optim.Adagrad([table], lr=0.3, initial_accumulator_value=0.1, eps=1e-7)
    bag_opt = torch.optim.SGD([bag_table], lr=0.2)
    for step in range(4):
        n = [int(rng.integers(1, 4)) for _ in range(r)]
        ids = [torch.from_numpy(rng.integers(0, 17, size=k)) for k in n]
        bag_ids = [torch.from_numpy(rng.integers(0, 9, size=(k, 3))) for k in n]
        ys = [torch.from_numpy(rng.standard_normal((k, 1))) for k in n]
        opt.zero_grad()
        out = ddp(ids[comm.rank], bag_ids[comm.rank])
        ((out.double() - ys[comm.rank]) ** 2).mean().backward()
        opt.step()
        for o in (ref_opt, table_opt, bag_opt):
            o.zero_grad()
        loss = sum(((mlp(torch.cat([table[i], bag_table[b].sum(1)], 1)) - y) ** 2).mean()
                   for i, b, y in zip(ids, bag_ids, ys)) / r
        loss.backward()
        for o in (ref_opt, table_opt, bag_opt):
            o.step()
        torch.testing.assert_close(model.emb.get_embedding_tensor().double(), table.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.bag.get_embedding_tensor().double(), bag_table.detach(), rtol=1e-5,
                                   atol=1e-5)
        for p, q in zip(model.mlp.parameters(), mlp.parameters()):
            torch.testing.assert_close(p.detach().double(), q.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.mpi
def test_buckets_start_while_backward_runs(comm, rng):
    """With one bucket per parameter, the last layer's buckets are started before the
    first layer's gradient exists (reverse order), and all are done when backward returns."""
    ddp = pt.DistributedDataParallel(Net(seed=0), bucket_cap_mb=1e-4)
    started = []
    ddp.module.a.weight.register_post_accumulate_grad_hook(lambda p: started.append(ddp._next))
    xs, uses = global_batch(rng, comm.size)
    (ddp(xs[comm.rank], True) ** 2).sum().backward()
    assert started and started[0] >= 1, started
    assert ddp._next == 0 and all(b.pending is None for b in ddp._buckets)


@pytest.mark.mpi
def test_buckets_are_numbered_and_counted(comm, rng):
    """Each bucket is one numbered collective call in the replica communicator's sequence
    (what the stall inspector follows) and one counted all_reduce."""
    from popdist_lite import calls

    ddp = pt.DistributedDataParallel(Net(seed=0), bucket_cap_mb=1e-4)
    xs, uses = global_batch(rng, comm.size)
    numbers = calls.comm_cache(comm).get(calls._CALLS, 0)
    before = pl.stats()["collectives"].get("all_reduce", {}).get("calls", 0)
    (ddp(xs[comm.rank], True) ** 2).sum().backward()
    assert calls.comm_cache(comm)[calls._CALLS] == numbers + len(ddp.buckets)
    assert pl.stats()["collectives"]["all_reduce"]["calls"] == before + len(ddp.buckets)
    assert pl.all_reduce(np.ones(2))[0] == comm.size  # the checked collectives are still in step


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gradients(comm, rng, dtype):
    """float16 buckets travel as float16 (the bytes all_reduce's float16 path moves) and
    come back as the float16 rounding of the exact mean; bfloat16 buckets travel as
    float32 and come back rounded once; all_reduce_gradients agrees."""
    r = comm.size
    c = -(-5 // r)  # float16: the chunk of a reduce-scatter of 5 elements, padded
    wire = {torch.float16: 2 * 2 * c * (r - 1), torch.bfloat16: 5 * 4 * (r - 1)}[dtype] + 3 * 4 * (r - 1)

    class Half(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(5, dtype=dtype))
            self.v = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            return (self.w.float() * x[:5]).sum() + (self.v * x[5:]).sum()

    xs = [torch.from_numpy(rng.uniform(-1, 1, size=8).astype(np.float32)) for _ in range(r)]
    want = torch.stack([x for x in xs]).double().mean(0)
    for reduce in ("ddp", "allreduce"):
        model = Half()
        ddp = pt.DistributedDataParallel(model) if reduce == "ddp" else model
        sent = pl.stats()["collectives"].get("all_reduce", {}).get("bytes_sent", 0)
        ddp(xs[comm.rank]).backward()
        if reduce == "allreduce":
            pt.all_reduce_gradients(model)
        else:
            assert pl.stats()["collectives"]["all_reduce"]["bytes_sent"] - sent == wire
        assert model.w.grad.dtype == dtype
        if dtype == torch.float16:  # the rounding of the exact mean of the float16 gradients
            exact = np.mean([x[:5].numpy().astype(np.float16).astype(np.float64) for x in xs], axis=0)
            np.testing.assert_array_equal(model.w.grad.numpy(), exact.astype(np.float16))
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-3
        torch.testing.assert_close(model.w.grad.double(), want[:5], rtol=tol, atol=tol)
        torch.testing.assert_close(model.v.grad.double(), want[5:], rtol=1e-6, atol=1e-6)


def test_earlier_spelling_is_an_alias():
    assert pt.allreduce_gradients is pt.all_reduce_gradients
