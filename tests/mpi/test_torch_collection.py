"""popdist_lite.torch's EmbeddingBagCollection and EmbeddingCollection at 1-3 replicas:

- against TorchRec's own unsharded ``torchrec.EmbeddingBagCollection`` /
  ``EmbeddingCollection`` (skipped with the reason where TorchRec is not installed: the
  ``torchrec`` fixture of tests/conftest.py): the same initial weights copied
  in, every replica's batch as a ``KeyedJaggedTensor``, TorchRec's optimizer applied in
  backward (``torch.optim.SGD``, ``torchrec.optim.RowWiseAdagrad``) to the mean of the
  replicas' losses in one process; the outputs (a ``KeyedTensor``, ``JaggedTensor`` s)
  and the tables after three steps, under a mixed plan and column-wise;
- a model written against TorchRec's API that runs with one import changed (the same
  losses, tables and dense weights as with TorchRec's collection);
- without torchrec's types: a plain mapping of feature -> (values, lengths[, weights])
  against a single-process numpy reference (bags with SUM/MEAN/SQRTN pooling and
  weights, sequence features);
- checkpoints: a model holding a collection, saved by fewer replicas under one plan,
  loaded at every replica count under another: the same tables, and training continued
  from it equals training continued from the saved model; the collection alone loads
  into the core's numpy collection;
- loss scaling: the update unscaled, and skipped on every replica after one replica's
  overflow;
- one replica's bad batch, weights that require a gradient, or other arguments, raised
  on every replica.

Every replica builds every replica's batch from the same generator."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="popdist_lite.torch needs PyTorch: pip install '.[torch]'")

import popdist_lite as pl  # noqa: E402
import popdist_lite.torch as pt  # noqa: E402

LR, EPS, B = 0.3, 1e-8, 4
def bags(rng, rows: dict, batch=B, weighted=False, sequence=False) -> dict:
    """One replica's batch: feature -> (values, lengths, weights or None), numpy;
    ragged bags with empty ones (sequence features: one bag per sample of 0-3 IDs)."""
    out = {}
    for f, t in rows.items():
        lengths = rng.integers(0, 4, size=batch)
        values = rng.integers(0, t, size=int(lengths.sum()))
        weights = rng.uniform(0.5, 2.0, size=values.size).astype(np.float32) if weighted and not sequence else None
        out[f] = (values, lengths, weights)
    return out


def kjt_of(batch: dict, keys=None):
    from torchrec import KeyedJaggedTensor

    keys = list(batch) if keys is None else keys
    weighted = batch[keys[0]][2] is not None
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.from_numpy(np.concatenate([batch[k][0] for k in keys])),
        lengths=torch.from_numpy(np.concatenate([batch[k][1] for k in keys])),
        weights=torch.from_numpy(np.concatenate([batch[k][2] for k in keys])) if weighted else None)


def apply_in_backward(module, optimizer: str):
    """TorchRec's optimizer in backward on an unsharded module's tables."""
    from torch.distributed.optim import _apply_optimizer_in_backward
    from torchrec.optim import RowWiseAdagrad

    if optimizer == "sgd":
        _apply_optimizer_in_backward(torch.optim.SGD, module.parameters(), {"lr": LR})
    else:
        _apply_optimizer_in_backward(RowWiseAdagrad, module.parameters(), {"lr": LR, "eps": EPS})


def spec_of(optimizer: str):
    if optimizer == "sgd":
        return pl.HostEmbeddingOptimizerSpec(LR)
    return pl.HostEmbeddingAdagradOptimizerSpec(LR, initial_accumulator_value=0.0, epsilon=EPS, rowwise=True)


def copy_weights(ours, reference, attribute: str) -> None:
    """Our tables' initial values into TorchRec's module (collective: the all-gathers)."""
    with torch.no_grad():
        for name, table in ours.tables.items():
            getattr(reference, attribute)[name].weight.copy_(torch.from_numpy(table.get_embedding_tensor()))


def assert_tables(ours, reference, attribute: str) -> None:
    for name, table in ours.tables.items():
        np.testing.assert_allclose(table.get_embedding_tensor(), getattr(reference, attribute)[name].weight.detach(),
                                   rtol=1e-5, atol=1e-6, err_msg=name)


# -- against TorchRec's unsharded collections -----------------------------------------------------------
BAG_TABLES = {  # name: (rows, dim, features)
    "t0": (5, 4, ["a"]),
    "t1": (11, 4, ["b", "c"]),
    "t2": (23, 3, ["d"]),
}


@pytest.mark.mpi
@pytest.mark.parametrize("optimizer, plan, weighted",
                         [("sgd", "mixed", False), ("rowwise_adagrad", "column_wise", True)])
def test_bags_match_torchrecs_embedding_bag_collection(comm, rng, torchrec, optimizer, plan, weighted):
    """Three steps: every replica's KeyedTensor equals TorchRec's for its batch, and the
    tables equal TorchRec's after its optimizer stepped on the mean of every replica's
    loss. SUM and MEAN pooling unweighted (MEAN with weights is not an nn.EmbeddingBag
    mode), SUM weighted."""
    from torchrec import KeyedTensor

    r, k = comm.size, comm.rank
    pooling = {"t0": "SUM", "t1": "SUM" if weighted else "MEAN", "t2": "SUM"}
    configs = [torchrec.EmbeddingBagConfig(num_embeddings=t, embedding_dim=e, name=name, feature_names=features,
                                           pooling=getattr(torchrec.PoolingType, pooling[name]))
               for name, (t, e, features) in BAG_TABLES.items()]
    plans = {"mixed": {"t0": "data_parallel", "t1": pl.ParameterSharding("table_wise", [r - 1]), "t2": "row_wise"},
             "column_wise": {name: "column_wise" for name in BAG_TABLES}}
    ours = pt.EmbeddingBagCollection(tables=configs, is_weighted=weighted, optimizer=spec_of(optimizer),
                                     plan=plans[plan])
    for name, given in plans[plan].items():
        want = given if isinstance(given, pl.ParameterSharding) else pl.ParameterSharding(given)
        assert ours.plan.shardings[name].sharding_type == want.sharding_type, name
    reference = torchrec.EmbeddingBagCollection(tables=configs, is_weighted=weighted)
    copy_weights(ours, reference, "embedding_bags")
    apply_in_backward(reference, optimizer)
    rows = {f: t for t, _, features in BAG_TABLES.values() for f in features}
    for _ in range(3):
        batches = [bags(rng, rows, weighted=weighted) for _ in range(r)]
        keys = list(rng.permutation(list(rows)))  # any key order
        grads = [torch.from_numpy(rng.standard_normal((B, 15)).astype(np.float32)) for _ in range(r)]
        got = ours(kjt_of(batches[k], keys))
        want = [reference(kjt_of(b)) for b in batches]
        assert isinstance(got, KeyedTensor)
        assert got.keys() == want[k].keys() == ["a", "b", "c", "d"] and got.length_per_key() == [4, 4, 4, 3]
        np.testing.assert_allclose(got.values().detach(), want[k].values().detach(), rtol=1e-5, atol=1e-6)
        (got.values() * grads[k]).sum().backward()
        (sum((w.values() * g).sum() for w, g in zip(want, grads)) / r).backward()
    assert_tables(ours, reference, "embedding_bags")


@pytest.mark.mpi
def test_sequences_match_torchrecs_embedding_collection(comm, rng, torchrec):
    """An EmbeddingCollection (a table read by two features, need_indices) against
    TorchRec's: each feature's JaggedTensor, and the tables after three SGD steps."""
    from torchrec import JaggedTensor

    r, k = comm.size, comm.rank
    tables = {"s0": (7, 4, ["x", "y"]), "s1": (13, 4, ["z"])}
    configs = [torchrec.EmbeddingConfig(num_embeddings=t, embedding_dim=e, name=name, feature_names=features)
               for name, (t, e, features) in tables.items()]
    ours = pt.EmbeddingCollection(tables=configs, need_indices=True, optimizer=spec_of("sgd"),
                                  plan={"s0": "row_wise", "s1": "column_wise"})
    reference = torchrec.EmbeddingCollection(tables=configs, need_indices=True)
    copy_weights(ours, reference, "embeddings")
    apply_in_backward(reference, "sgd")
    rows = {"x": 7, "y": 7, "z": 13}
    for _ in range(3):
        batches = [bags(rng, rows, sequence=True) for _ in range(r)]
        got = ours(kjt_of(batches[k]))
        want = [reference(kjt_of(b)) for b in batches]
        assert list(got) == ["x", "y", "z"]
        grads = [{f: torch.from_numpy(rng.standard_normal((len(b[f][0]), 4)).astype(np.float32)) for f in rows}
                 for b in batches]
        for f in rows:
            assert isinstance(got[f], JaggedTensor)
            np.testing.assert_allclose(got[f].values().detach(), want[k][f].values().detach(), rtol=1e-6, atol=1e-7)
            assert got[f].lengths().tolist() == want[k][f].lengths().tolist() == batches[k][f][1].tolist()
            assert got[f].weights().tolist() == batches[k][f][0].tolist()  # need_indices: the IDs
        sum((got[f].values() * grads[k][f]).sum() for f in rows).backward()
        (sum((w[f].values() * g[f]).sum() for w, g in zip(want, grads) for f in rows) / r).backward()
    assert_tables(ours, reference, "embeddings")


# -- a TorchRec model with one import changed ---------------------------------------------------------------
MODEL = '''
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
{import_line}


class TwoTower(torch.nn.Module):
    """A user tower and an item tower over pooled features, scored by a dot product."""

    def __init__(self, embedding_bag_collection, dense_in: int):
        super().__init__()
        self.ebc = embedding_bag_collection
        dims = {{c.name: c.embedding_dim for c in self.ebc.embedding_bag_configs()}}
        self.user = torch.nn.Linear(dims["t_user"] + dense_in, 4)
        self.item = torch.nn.Linear(2 * dims["t_item"], 4)

    def forward(self, dense, features):
        pooled = self.ebc(features).to_dict()
        user = self.user(torch.cat([pooled["user"], dense], dim=1))
        item = self.item(torch.cat([pooled["item"], pooled["context"]], dim=1))
        return (user * item).sum(1)


def tables():
    return [EmbeddingBagConfig(name="t_user", embedding_dim=3, num_embeddings=17, feature_names=["user"],
                               pooling=PoolingType.SUM),
            EmbeddingBagConfig(name="t_item", embedding_dim=5, num_embeddings=29, feature_names=["item", "context"],
                               pooling=PoolingType.MEAN)]


def batch(ids, lengths):
    return KeyedJaggedTensor.from_lengths_sync(keys=["user", "item", "context"], values=ids, lengths=lengths)
'''


def model_namespace(import_line: str) -> dict:
    namespace: dict = {}
    exec(compile(MODEL.format(import_line=import_line), f"<model: {import_line}>", "exec"), namespace)
    return namespace


@pytest.mark.mpi
def test_a_torchrec_model_runs_with_one_import_changed(comm, rng, torchrec):
    """The same model source with ``from torchrec import EmbeddingBagCollection`` (one
    process, every replica's batch, the mean loss) and with ``from popdist_lite.torch
    import EmbeddingBagCollection`` (at r replicas, dense layers under
    DistributedDataParallel): the same losses, tables and dense weights after three
    steps. The tables' optimizer is the one difference outside the model: TorchRec's
    in backward on its parameters, ours a spec given to the collection."""
    r, k = comm.size, comm.rank
    theirs = model_namespace("from torchrec import EmbeddingBagCollection")
    mine = model_namespace("from popdist_lite.torch import EmbeddingBagCollection")
    ebc = mine["EmbeddingBagCollection"](tables=mine["tables"](), optimizer=pl.HostEmbeddingOptimizerSpec(LR))
    torch.manual_seed(0)
    model = pt.DistributedDataParallel(mine["TwoTower"](ebc, dense_in=2))
    reference_ebc = theirs["EmbeddingBagCollection"](tables=theirs["tables"]())
    reference = theirs["TwoTower"](reference_ebc, dense_in=2)
    reference.load_state_dict({**model.module.state_dict(), **reference_ebc.state_dict(prefix="ebc.")})
    copy_weights(ebc, reference_ebc, "embedding_bags")
    apply_in_backward(reference_ebc, "sgd")
    dense_optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    reference_dense = torch.optim.SGD([p for n, p in reference.named_parameters() if not n.startswith("ebc.")], lr=LR)
    rows = {"user": 17, "item": 29, "context": 29}
    for _ in range(3):
        batches = [bags(rng, rows) for _ in range(r)]
        dense = [torch.from_numpy(rng.standard_normal((B, 2)).astype(np.float32)) for _ in range(r)]
        labels = [torch.from_numpy(rng.standard_normal(B).astype(np.float32)) for _ in range(r)]

        def loss_of(namespace, net, j):
            b = batches[j]
            features = namespace["batch"](torch.from_numpy(np.concatenate([b[f][0] for f in rows])),
                                          torch.from_numpy(np.concatenate([b[f][1] for f in rows])))
            return ((net(dense[j], features) - labels[j]) ** 2).mean()

        loss = loss_of(mine, model, k)
        dense_optimizer.zero_grad()
        loss.backward()
        dense_optimizer.step()
        losses = [loss_of(theirs, reference, j) for j in range(r)]
        reference_dense.zero_grad()
        (sum(losses) / r).backward()
        reference_dense.step()
        assert float(loss) == pytest.approx(float(losses[k]), rel=1e-5, abs=1e-6)
    assert_tables(ebc, reference_ebc, "embedding_bags")
    for name, p in model.module.named_parameters():
        np.testing.assert_allclose(p.detach(), reference.get_parameter(name).detach(), rtol=1e-5, atol=1e-6,
                                   err_msg=name)


# -- plain mappings against numpy -----------------------------------------------------------------------------
NUMPY_TABLES = [(6, 3, "SUM", ["a"]), (9, 2, "MEAN", ["b", "c"]), (14, 4, "SQRTN", ["d"])]


def numpy_bag_step(tables, batches, grads, poolings, features_of):
    """Every replica's pooled outputs (float64) and the SGD update of the mean of their
    losses (in place). ``grads[j][f]``: replica j's output gradient of feature f."""
    outputs = []
    for batch in batches:
        out = {}
        for f, (values, lengths, weights) in batch.items():
            i = features_of[f]
            w = np.ones(values.size) if weights is None else weights.astype(np.float64)
            rows = []
            for ids, wb in zip(np.split(values, np.cumsum(lengths)[:-1]), np.split(w, np.cumsum(lengths)[:-1])):
                d = {"SUM": 1.0, "MEAN": wb.sum(), "SQRTN": np.sqrt((wb * wb).sum())}[poolings[i]] if ids.size else 1
                rows.append((tables[i][ids] * (wb / d)[:, None]).sum(0) if ids.size else np.zeros(tables[i].shape[1]))
            out[f] = np.array(rows)
        outputs.append(out)
    updates = [np.zeros_like(t) for t in tables]
    for batch, g in zip(batches, grads):
        for f, (values, lengths, weights) in batch.items():
            i = features_of[f]
            w = np.ones(values.size) if weights is None else weights.astype(np.float64)
            for b, (ids, wb) in enumerate(zip(np.split(values, np.cumsum(lengths)[:-1]),
                                              np.split(w, np.cumsum(lengths)[:-1]))):
                if ids.size:
                    d = {"SUM": 1.0, "MEAN": wb.sum(), "SQRTN": np.sqrt((wb * wb).sum())}[poolings[i]]
                    np.add.at(updates[i], ids, g[f][b] * (wb / d)[:, None])
    for t, u in zip(tables, updates):
        t -= LR * u / len(batches)
    return outputs


@pytest.mark.mpi
def test_plain_mappings_match_numpy(comm, rng):
    """The library's configs (each with its optimizer spec), weighted bags of every
    pooling and a sequence collection, fed plain mappings of tensors: outputs
    ``{feature: (B, e)}`` and ``{feature: (values, lengths)}``, tables after two steps,
    against numpy; the planner places the tables."""
    r, k = comm.size, comm.rank
    fulls = [rng.standard_normal((t, e)).astype(np.float32) for t, e, _, _ in NUMPY_TABLES]
    configs = [pt.EmbeddingBagConfig(num_embeddings=t, embedding_dim=e, name=f"n{i}", feature_names=features,
                                     pooling=pooling, initializer=full, optimizer=pl.HostEmbeddingOptimizerSpec(LR))
               for i, ((t, e, pooling, features), full) in enumerate(zip(NUMPY_TABLES, fulls))]
    ebc = pt.EmbeddingBagCollection(configs, is_weighted=True)
    seq_full = rng.standard_normal((8, 3)).astype(np.float32)
    sequence = pt.EmbeddingCollection([pt.EmbeddingConfig(num_embeddings=8, embedding_dim=3, name="s",
                                                          feature_names=["q"], initializer=seq_full,
                                                          optimizer=pl.HostEmbeddingOptimizerSpec(LR))])
    tables = [f.astype(np.float64) for f in fulls]
    seq_table = seq_full.astype(np.float64)
    features_of = {f: i for i, (_, _, _, features) in enumerate(NUMPY_TABLES) for f in features}
    rows = {f: NUMPY_TABLES[i][0] for f, i in features_of.items()}
    for _ in range(2):
        batches = [bags(rng, rows, weighted=True) for _ in range(r)]
        grads = [{f: rng.standard_normal((B, NUMPY_TABLES[features_of[f]][1])) for f in rows} for _ in range(r)]
        mine = {f: tuple(torch.from_numpy(x) for x in v) for f, v in batches[k].items()}
        got = ebc(mine)
        want = numpy_bag_step(tables, batches, grads, [p for _, _, p, _ in NUMPY_TABLES], features_of)
        assert list(got) == ["a", "b", "c", "d"]
        for f, v in got.items():
            np.testing.assert_allclose(v.detach(), want[k][f], rtol=1e-5, atol=1e-6, err_msg=f)
        sum((v * torch.from_numpy(grads[k][f]).float()).sum() for f, v in got.items()).backward()

        seqs = [bags(rng, {"q": 8}, sequence=True) for _ in range(r)]
        seq_grads = [rng.standard_normal((s["q"][0].size, 3)) for s in seqs]
        values, lengths = torch.from_numpy(seqs[k]["q"][0]), torch.from_numpy(seqs[k]["q"][1])
        (out, out_lengths), = sequence({"q": (values, lengths)}).values()
        np.testing.assert_allclose(out.detach(), seq_table[seqs[k]["q"][0]], rtol=1e-6, atol=1e-7)
        assert out_lengths.tolist() == lengths.tolist()
        (out * torch.from_numpy(seq_grads[k]).float()).sum().backward()
        for s, g in zip(seqs, seq_grads):
            np.add.at(seq_table, s["q"][0], -LR * g / r)
    for i, (name, table) in enumerate(ebc.tables.items()):
        np.testing.assert_allclose(table.get_embedding_tensor(), tables[i], rtol=1e-5, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(sequence.tables["s"].get_embedding_tensor(), seq_table, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # nothing recorded for a backward without gradients, nor in eval mode
        assert not ebc(mine)["a"].requires_grad
    ebc.eval()
    assert not ebc(mine)["a"].requires_grad


# -- checkpoints ------------------------------------------------------------------------------------------------
CKPT_TABLES = [(10, 3, "SUM", ["u"]), (15, 2, "MEAN", ["v", "w"])]
GLOBAL = 6  # bags per step in all: every replica count of the test (1-3) divides it


class Scorer(torch.nn.Module):
    def __init__(self, plan, comm=None):
        super().__init__()
        spec = pl.HostEmbeddingAdagradOptimizerSpec(LR, rowwise=True)
        self.ebc = pt.EmbeddingBagCollection(
            [pt.EmbeddingBagConfig(num_embeddings=t, embedding_dim=e, name=f"c{i}", feature_names=f, pooling=p, seed=i)
             for i, (t, e, p, f) in enumerate(CKPT_TABLES)], optimizer=spec, plan=plan, op="sum", comm=comm)
        self.dense = torch.nn.Linear(7, 1).requires_grad_(False)  # saved with the model, not trained

    def forward(self, features):
        return self.dense(torch.cat(list(self.ebc(features).values()), dim=1)).squeeze(1)


def train_slices(model, rng, steps, replica, replicas):
    """``steps`` steps of one global batch of GLOBAL bags, this replica's slice of it;
    the loss sums over bags and the tables' gradients are summed over replicas
    (``op="sum"``), so the update is the same at any replica count."""
    rows = {"u": 10, "v": 15, "w": 15}
    n = GLOBAL // replicas
    for _ in range(steps):
        batch = bags(rng, rows, batch=GLOBAL)
        starts = {f: np.concatenate([[0], np.cumsum(v[1])]) for f, v in batch.items()}
        mine = {f: (torch.from_numpy(v[0][starts[f][replica * n]:starts[f][(replica + 1) * n]]),
                    torch.from_numpy(v[1][replica * n:(replica + 1) * n])) for f, v in batch.items()}
        labels = torch.from_numpy(rng.standard_normal(GLOBAL).astype(np.float32))[replica * n:(replica + 1) * n]
        ((model(mine) - labels) ** 2).sum().backward()


@pytest.mark.mpi
def test_checkpoints_reshard_across_replica_counts_and_plans(shared, comm):
    """Saved by s replicas (a sub-communicator; s = r - 1, at least 1) row-wise, loaded
    at r into a model placed otherwise: equal tables (bit for bit); two more steps from
    there equal two more steps of the saved model (the row-wise Adagrad accumulators
    came along). The collection alone loads into the core's numpy collection."""
    r, k = comm.size, comm.rank
    s = max(1, r - 1)
    sub = comm.Split(0 if k < s else 1, k)
    saved = continued = None
    if k < s:
        torch.manual_seed(0)
        model = Scorer({"c0": "row_wise", "c1": "row_wise"}, comm=sub)
        train_slices(model, np.random.default_rng(1), 2, k, s)
        pl.save_checkpoint(shared, {"model": model, "tables": model.ebc}, step=2, comm=sub)
        saved = {n: t.get_embedding_tensor() for n, t in model.ebc.tables.items()}
        saved["dense"] = model.dense.weight.numpy().copy()
        train_slices(model, np.random.default_rng(2), 2, k, s)
        continued = {n: t.get_embedding_tensor() for n, t in model.ebc.tables.items()}
    sub.Free()
    saved, continued = comm.bcast((saved, continued), root=0)
    plan = {"c0": "column_wise", "c1": pl.ParameterSharding("table_wise", [r - 1])}
    torch.manual_seed(5)
    model = Scorer(plan)
    pl.load_checkpoint(shared / "step-00000002", {"model": model})
    for name, table in model.ebc.tables.items():
        np.testing.assert_array_equal(table.get_embedding_tensor(), saved[name], err_msg=name)
    np.testing.assert_array_equal(model.dense.weight, saved["dense"])
    train_slices(model, np.random.default_rng(2), 2, k, r)
    for name, table in model.ebc.tables.items():
        np.testing.assert_allclose(table.get_embedding_tensor(), continued[name], rtol=1e-5, atol=1e-6, err_msg=name)
    core = pl.EmbeddingBagCollection(
        [pt.EmbeddingBagConfig(num_embeddings=t, embedding_dim=e, name=f"c{i}", feature_names=f, pooling=p)
         for i, (t, e, p, f) in enumerate(CKPT_TABLES)])
    pl.load_checkpoint(shared / "step-00000002", {"tables": core})
    for name, table in core.tables.items():
        np.testing.assert_array_equal(table.get_embedding_tensor(), saved[name], err_msg=name)


# -- loss scaling ---------------------------------------------------------------------------------------------------
@pytest.mark.mpi
def test_loss_scaling_unscales_and_skips_on_every_replica(comm):
    """With a GradScaler of scale 8: the update is the unscaled one (numpy); an inf in
    the last replica's loss skips the update on every replica and lowers the scale."""
    r, k = comm.size, comm.rank
    full = np.arange(10.0, dtype=np.float32).reshape(5, 2)
    scaler = pt.GradScaler(init_scale=8.0)
    ebc = pt.EmbeddingBagCollection([pt.EmbeddingBagConfig(num_embeddings=5, embedding_dim=2, name="t",
                                                           feature_names=["f"], initializer=full)],
                                    optimizer=pl.HostEmbeddingOptimizerSpec(LR), grad_scaler=scaler)
    features = {"f": (torch.tensor([k % 5, 4]), torch.tensor([1, 1]))}  # replica k: IDs k % 5 and 4
    scaler.scale(ebc(features)["f"].sum()).backward()
    scaler.update()
    want = full.astype(np.float64)
    for j in range(r):
        want[[j % 5, 4]] -= LR / r
    np.testing.assert_allclose(ebc.tables["t"].get_embedding_tensor(), want, rtol=1e-6)
    loss = ebc(features)["f"].sum() * (float("inf") if k == r - 1 else 1.0)
    scaler.scale(loss).backward()
    scaler.update()
    np.testing.assert_allclose(ebc.tables["t"].get_embedding_tensor(), want, rtol=1e-6)
    assert scaler.get_scale() == 4.0


# -- errors on every replica -------------------------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("case", ["index", "weights_need_grad", "unknown_feature", "other_arguments"])
def test_one_replicas_bad_input_raises_on_every_replica(comm, case):
    r, k = comm.size, comm.rank
    bad = k == r - 1
    configs = [pt.EmbeddingBagConfig(num_embeddings=5, embedding_dim=2, name="t", feature_names=["f"],
                                     optimizer=pl.HostEmbeddingOptimizerSpec(LR))]
    if case == "other_arguments":
        with pytest.raises(ValueError, match=rf"replica {r - 1}: argument op: expected 'mean' or 'sum', got 'max'"):
            pt.EmbeddingBagCollection(configs, op="max" if bad else "mean")
        return
    ebc = pt.EmbeddingBagCollection(configs, is_weighted=True)
    values, lengths = torch.tensor([1, 2, 4]), torch.tensor([2, 1])
    weights = torch.ones(3, requires_grad=bad and case == "weights_need_grad")
    features = {"f": (values, lengths, weights)}
    if bad and case == "index":
        features = {"f": (torch.tensor([1, 5, 4]), lengths, weights)}
    if bad and case == "unknown_feature":
        features = {**features, "g": (values, lengths)}
    error, match = {"index": (IndexError, "feature 'f'.*got 5"),
                    "weights_need_grad": (ValueError, "require a gradient"),
                    "unknown_feature": (KeyError, "unknown features")}[case]
    before = ebc.tables["t"].get_embedding_tensor()
    with pytest.raises(error, match=rf"replica {r - 1}.*{match}"):
        ebc(features)
    np.testing.assert_array_equal(ebc.tables["t"].get_embedding_tensor(), before)
    ebc({"f": (values, lengths, torch.ones(3))})["f"].sum().backward()  # the collection still works
    assert not np.array_equal(ebc.tables["t"].get_embedding_tensor(), before)
