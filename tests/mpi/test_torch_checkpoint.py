"""popdist_lite.torch's objects in checkpoints, at 1-4 replicas: a model (DDP-wrapped,
with a bfloat16 buffer), host embeddings, torch.optim optimizers (with state, and fresh)
and a GradScaler reload bit for bit and continue exactly as the saved objects do;
tables load across replica counts in one job (saved from a sub-communicator) and between
the numpy and torch APIs; a mismatch on one replica raises on every replica and changes
nothing on any; what cannot be saved is refused on every replica before writing.

The references are the saved objects themselves (compared tensor by tensor) and
single-process torch for the tables' full contents."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="popdist_lite.torch needs PyTorch: pip install '.[torch]'")

import popdist_lite as pl  # noqa: E402
import popdist_lite.torch as pt  # noqa: E402

T, E = 13, 4


class Net(torch.nn.Module):
    """A host embedding inside a model, dense layers and a bfloat16 buffer."""

    def __init__(self, hidden=3, strategy="TOKEN"):
        super().__init__()
        self.emb = pt.HostEmbedding(T, E, partition_strategy=strategy, name="net.emb", seed=4,
                                    optimizer_spec=pl.HostEmbeddingAdagradOptimizerSpec(0.2))
        self.dense = torch.nn.Sequential(torch.nn.Linear(E, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
        self.register_buffer("calls", torch.zeros((), dtype=torch.bfloat16))

    def forward(self, ids):
        self.calls += 1
        return self.dense(self.emb(ids).sum(1))


def build(seed: int, strategy="TOKEN", optimizer=torch.optim.Adam):
    torch.manual_seed(seed)
    model = pt.DistributedDataParallel(Net(strategy=strategy))
    bag = pt.HostEmbeddingBag(T, E, mode="mean", partition_strategy=strategy, name="bag", seed=seed,
                              optimizer_spec=pl.HostEmbeddingAdamOptimizerSpec(0.05))
    scaler = pt.GradScaler(init_scale=2.0 ** (3 + seed), growth_interval=2)
    model.module.emb.grad_scaler = bag.grad_scaler = scaler
    dense = [p for p in model.parameters()]
    return {"step": 0, "model": model, "bag": bag, "scaler": scaler,
            "optimizer": optimizer([{"params": dense[:2]}, {"params": dense[2:], "lr": 0.02}], lr=0.01),
            "ema": torch.zeros(3)}


def train(state, steps, rng, comm):
    for _ in range(steps):
        ids = rng.integers(0, T, size=(comm.size, 4, 2))[comm.rank]
        out = state["model"](torch.from_numpy(ids)) + state["bag"](torch.from_numpy(ids)).sum(1, keepdim=True)
        state["optimizer"].zero_grad()
        state["scaler"].scale((out ** 2).mean()).backward()
        state["scaler"].step(state["optimizer"])
        state["scaler"].update()
        # a plain tensor is saved as replicated (replica 0's), so it holds the global mean
        state["ema"].mul_(0.5).add_(comm.allreduce(float(out.detach().mean())) / comm.size)
        state["step"] += 1


def snapshot(state) -> dict:
    """Every tensor of the state, the full tables and their optimizer slots (collective)."""
    snap = {f"model/{n}": t.clone() for n, t in state["model"].module.state_dict().items()}
    for index, slots in state["optimizer"].state_dict()["state"].items():
        snap.update({f"opt/{index}/{s}": v.clone() if isinstance(v, torch.Tensor) else v for s, v in slots.items()})
    snap["opt/groups"] = [{k: v for k, v in g.items()} for g in state["optimizer"].state_dict()["param_groups"]]
    for name, module in (("emb", state["model"].module.emb), ("bag", state["bag"])):
        snap[f"{name}/full"] = module.get_embedding_tensor(master=True)
        for key, a in module.table.state().arrays.items():
            snap[f"{name}/local/{key}"] = torch.from_numpy(a.copy())
    snap["scaler"] = state["scaler"].loss_scaler.state_dict()
    snap["ema"], snap["step"] = state["ema"].clone(), state["step"]
    return snap


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[name], value), name
        else:
            assert got[name] == value, name


@pytest.mark.mpi
@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "in_place"])
def test_reload_is_bit_identical_and_continues_exactly(shared, comm, rng, fresh):
    """``fresh``: new objects, the optimizer without state (its slots come from the
    checkpoint); else the saved objects themselves, trained further, then loaded back
    (every array written in place)."""
    state = build(seed=0)
    train(state, 3, rng, comm)
    pl.save_checkpoint(shared, state, step=3)
    saved = snapshot(state)
    if fresh:
        other = build(seed=1)
        assert not other["optimizer"].state
    else:
        other = state
        train(other, 2, np.random.default_rng(99), comm)
    exp_avg = other["optimizer"].state[other["model"].module.dense[0].weight].get("exp_avg")
    pl.load_checkpoint(shared / "step-00000003", other)
    assert_same(snapshot(other), saved)
    assert other["scaler"].get_scale() == 2.0 ** 4  # 8, grown once after 2 clean steps
    if not fresh:  # loaded in place: the optimizer keeps its own tensors' memory
        assert other["optimizer"].state[other["model"].module.dense[0].weight]["exp_avg"].data_ptr() == \
            exp_avg.data_ptr()
    # both continue alike, bit for bit
    reference = build(seed=2)
    pl.load_checkpoint(shared / "step-00000003", reference)
    train(other, 2, np.random.default_rng(5), comm)
    train(reference, 2, np.random.default_rng(5), comm)
    assert_same(snapshot(other), snapshot(reference))
    assert not torch.equal(snapshot(other)["emb/full"], saved["emb/full"])


@pytest.mark.mpi
@pytest.mark.parametrize("fewer", [0, 1])
@pytest.mark.parametrize("strategies", [("TOKEN", "ENCODING"), ("ENCODING", "TOKEN")])
def test_tables_reshard_across_replica_counts_and_apis(shared, comm, fewer, strategies):
    """Saved by ``s`` replicas (a sub-communicator) from one API, loaded at ``r`` into
    the other API and partition strategy: the full tables and Adam slots equal; a
    GradScaler and a DynamicLossScaler load each other."""
    r, k = comm.size, comm.rank
    s = max(1, r - fewer)
    sub = comm.Split(0 if k < s else 1, k)
    spec = pl.HostEmbeddingAdamOptimizerSpec(0.1)
    ids = np.arange(T)
    grads = np.linspace(-1, 1, T * E, dtype=np.float32).reshape(T, E)
    if k < s:
        table = pl.create_host_embedding("t", [T, E], partition_strategy=strategies[0], optimizer_spec=spec,
                                         seed=3, comm=sub)
        module = pt.HostEmbedding(T, E, partition_strategy=strategies[0], optimizer_spec=spec, seed=5, comm=sub,
                                  name="saved_module")
        for _ in range(2):  # every replica of the job the same rows and gradients: sums of s of them
            table.apply_gradients(ids, grads)
            module(torch.from_numpy(ids)).backward(torch.from_numpy(grads))
        scaler = pl.DynamicLossScaler(2.0 ** 6, growth_interval=7)
        scaler.update(True)
        pl.save_checkpoint(shared, {"numpy": table, "torch": module, "scaler": scaler}, step=1, comm=sub)
        saved = {"numpy": table.get_embedding_tensor(master=True), "torch": module.get_embedding_tensor().numpy()}
        saved_m = {"numpy": table.state().arrays["optimizer/m"], "torch": module.table.state().arrays["optimizer/m"]}
        for name in ("numpy", "torch"):
            # the full Adam slot, gathered here with numpy by the partition rule
            parts = sub.allgather(saved_m[name])
            if strategies[0] == "TOKEN":
                saved_m[name] = np.stack([parts[i % s][i // s] for i in range(T)])
            else:
                c = -(-E // s)
                saved_m[name] = np.stack([parts[j // c][:, j % c] for j in range(E)], axis=1)
    else:
        saved = saved_m = None
    sub.Free()
    saved, saved_m = comm.bcast((saved, saved_m), root=0)
    # loaded crosswise: the numpy table into a torch module, the torch module into a numpy table
    module = pt.HostEmbedding(T, E, partition_strategy=strategies[1], optimizer_spec=spec, seed=9, name="module")
    table = pl.create_host_embedding("u", [T, E], partition_strategy=strategies[1], optimizer_spec=spec, seed=9)
    scaler = pt.GradScaler()
    pl.load_checkpoint(shared / "step-00000001", {"numpy": module, "torch": table, "scaler": scaler})
    np.testing.assert_array_equal(module.get_embedding_tensor().numpy(), saved["numpy"])
    np.testing.assert_array_equal(table.get_embedding_tensor(master=True), saved["torch"])
    for name, live in (("numpy", module.table), ("torch", table)):
        m = live.state().arrays["optimizer/m"]
        want = saved_m[name][k::r] if strategies[1] == "TOKEN" else \
            saved_m[name][:, k * -(-E // r):(k + 1) * -(-E // r)]
        np.testing.assert_array_equal(m[:len(want)] if strategies[1] == "TOKEN" else m[:, :want.shape[1]], want,
                                      err_msg=name)
    assert scaler.get_scale() == 2.0 ** 5 and scaler.loss_scaler.skipped_steps == 1


def _live(state) -> dict:
    """Every array of the state as numpy copies (no collective: local arrays only)."""
    out = {f"model/{n}": t.detach().clone() for n, t in state["model"].state_dict().items()}
    for p, slots in state["optimizer"].state.items():
        out.update({f"opt/{id(p)}/{s}": v.clone() for s, v in slots.items() if isinstance(v, torch.Tensor)})
    out["opt/groups"] = repr(state["optimizer"].param_groups[0]["lr"])
    out["opt/len"] = len(state["optimizer"].state)
    out.update({f"emb/{key}": torch.from_numpy(a.copy()) for key, a in state["emb"].table.state().arrays.items()})
    out["scaler"] = state["scaler"].loss_scaler.state_dict()
    return out


def _mismatch_state(case: str, odd: bool) -> dict:
    """A state to load; with ``odd`` one that does not match the checkpoint in the way
    ``case`` names (the saved state has ``odd=False``)."""
    torch.manual_seed(3)
    width = 3 if case in ("shape", "fresh_slot") and odd else 2
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 1))
    if case == "missing_tensor" and odd:
        model.register_buffer("extra", torch.zeros(2))
    if case == "extra_tensor" and odd:
        pass  # the checkpoint has 'counter', this model has not
    elif case == "kind" and odd:
        model.register_buffer("counter", torch.zeros(2, dtype=torch.int16))
    else:
        model.register_buffer("counter", torch.zeros(2, dtype=torch.bfloat16))
    params = list(model.parameters())
    if case == "class" and odd:
        optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    elif case == "groups" and odd:
        optimizer = torch.optim.Adam([{"params": params[:2]}, {"params": params[2:]}], lr=0.1)
    else:  # "slots": the checkpoint's Adam kept amsgrad's slot, the odd replica's does not
        optimizer = torch.optim.Adam(params, lr=0.1, amsgrad=case == "slots" and not odd)
    if case == "settings" and odd:
        optimizer.param_groups[0]["initial_lr"] = 0.1  # as an LR scheduler adds
    emb = pt.HostEmbedding(T + (case == "table" and odd), E, optimizer_spec=pl.HostEmbeddingOptimizerSpec(0.1),
                           name="emb")
    scaler = pt.GradScaler(loss_scaler=pl.StaticLossScaler(4.0)) if case == "scaler" and odd else pt.GradScaler()
    return {"model": model, "optimizer": optimizer, "emb": emb, "scaler": scaler}


def _step(state) -> None:
    out = state["model"](state["emb"](torch.tensor([[1, 2, 3, 4]])).sum(1))
    state["optimizer"].zero_grad()
    out.sum().backward()
    state["optimizer"].step()


MISMATCHES = {
    "shape": r"array 'model/0.bias': the checkpoint holds float32\[2\], the state being loaded has float32\[3\]",
    "missing_tensor": r"has no array 'model/extra' \(it has model/0.bias, model/0.weight, model/1.bias, "
                      r"model/1.weight, model/counter\)",
    "extra_tensor": r"module 'model': the checkpoint has 'counter', which the live module has not \(a module loads "
                    r"whole, as torch's load_state_dict\(strict=True\)\)",
    "kind": r"tensor 'counter' was saved as 'bits:bfloat16', the live one is 'array'",
    "class": r"state 'optimizer' was saved from a torch.optim.Adam, cannot load it into a torch.optim.SGD",
    "groups": r"optimizer 'optimizer': the checkpoint has 1 parameter groups, the live optimizer 2",
    "settings": r"param group 0: the checkpoint has the settings \[.*\], the live optimizer \[.*'initial_lr'.*\]",
    "slots": r"optimizer 'optimizer': parameter 0 has the state \['exp_avg', 'exp_avg_sq', 'step'\], the "
             r"checkpoint has \['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', 'step'\] for it",
    "fresh_slot": r"array 'optimizer/tensors/0/exp_avg': parameter 0 has shape \[3, 4\]: a slot of its optimizer "
                  r"state has that shape or is a scalar, the checkpoint's 'exp_avg' has \[2, 4\]",
    "table": r"table 'emb' has shape \(13, 4\), the table being loaded has \(14, 4\)",
    "scaler": r"state 'scaler' was saved from a DynamicLossScaler, cannot load it into a StaticLossScaler",
}


@pytest.mark.mpi
@pytest.mark.parametrize("case", list(MISMATCHES))
def test_mismatch_on_one_replica_raises_everywhere_and_changes_nothing(shared, comm, case):
    every = case in ("table", "scaler")  # collectively built objects: the same on every replica
    saved = _mismatch_state(case, odd=False)
    _step(saved)
    pl.save_checkpoint(shared, saved, step=1)
    odd = every or comm.rank == comm.size - 1
    state = _mismatch_state(case, odd)
    if case != "fresh_slot":  # fresh_slot: an optimizer without state, whose slots would come from the checkpoint
        _step(state)  # state to lose: the model, the optimizer's slots, the table
    before = _live(state)
    with pytest.raises(pl.CheckpointError, match=MISMATCHES[case]) as caught:
        pl.load_checkpoint(shared / "step-00000001", state)
    if not every:
        assert f"replica {comm.size - 1}" in str(caught.value)
    after = _live(state)
    assert sorted(after) == sorted(before)
    for name, value in before.items():
        assert torch.equal(after[name], value) if isinstance(value, torch.Tensor) else after[name] == value, name


@pytest.mark.mpi
def test_unsavable_state_raises_everywhere_before_writing(shared, comm):
    model = torch.nn.Linear(3, 1)
    lbfgs = torch.optim.LBFGS(model.parameters())

    def closure():
        lbfgs.zero_grad()
        loss = model(torch.ones(2, 3)).sum() ** 2
        loss.backward()
        return loss
    lbfgs.step(closure)
    with pytest.raises(TypeError, match=rf"replica 0: optimizer LBFGS: parameter 0's state '\w+' is a list: only "
                                        r"tensors and JSON values can be saved"):
        pl.save_checkpoint(shared, {"optimizer": lbfgs}, step=1)

    class Extra(torch.nn.Linear):
        def get_extra_state(self):
            return object()
    with pytest.raises(TypeError, match=r"module Extra: state_dict\(\) entry '_extra_state' is a object"):
        pl.save_checkpoint(shared, {"model": Extra(2, 2)}, step=1)
    assert list(shared.iterdir()) == []
