#!/usr/bin/env python3
"""popdist-lite against TorchRec on CPU, side by side: one job per workload, every
variant in it, their timed blocks interleaved (bench_lookup.py's method).

    python scripts/bench_torchrec.py [--ranks 2] [--workloads recsys,dlrm] [--timeout 900]
    python scripts/bench_torchrec.py --hosts 2 --ranks 2   # 2 test hosts x 1 replica, TCP (root)
    python scripts/bench_torchrec.py --check               # one step of every variant against numpy

prints one JSON object on stdout. Needs TorchRec 1.8.0 and fbgemm-gpu-cpu 1.8.0 beside
torch 2.13.0+cpu, which ``scripts/test`` installs into ``.venv`` (pinned in pyproject.toml's
``[tool.popdist-lite]``, installed with ``pip --no-deps``: the reason is there). Without
``--worker`` the script launches itself once per workload on ``--ranks`` replicas with ``poprun-lite``
(under ``--timeout``). Each replica is one MPI rank for popdist-lite and the same rank
of a gloo process group for TorchRec and torch DDP (its rendezvous on 127.0.0.1, or on
replica 0's test-network address with ``--hosts``). Block ``b`` of every variant runs
before block ``b + 1`` of any (``--blocks``, default 16), after a barrier, so load from
other processes hits every variant alike; a variant's time is its median block's mean
step, per replica, then the average and the maximum over replicas; ``*_paired`` ratios
are the median over rounds of two variants' blocks (each the slower replica's). Quote
figures only from a quiet machine: ``flock /tmp/popdist-bench.lock python
scripts/bench_torchrec.py`` (the JSON records the load average before and after).

With ``--hosts H`` (root: network-namespace test hosts, popdist_lite_launcher.testing.netns_hosts)
the replicas are spread evenly over H test hosts: MPI over TCP (``--mca btl tcp,self``),
gloo over TCP on the test network's interface.

Workloads and variants (every variant of a workload makes the same update from the same
gradients: the mean over replicas, SGD; ``--check`` tests it):

    recsys  bench_torch.py's recommender workload: one 1,000,000 x 64 float32 table
            (``--recsys-rows``), 8192 Zipf(1.1) IDs per replica and step (bench_lookup.py's
            batches), one ID per bag, sum pooling, ``out.backward(grad)`` with a gradient
            of 1e-3 everywhere, SGD lr 0.01:
        binding_bag   popdist_lite.torch.HostEmbeddingBag(mode="sum"), update in backward
        binding       popdist_lite.torch.HostEmbedding
        numpy_bag     the numpy API: lookup_bags + apply_bag_gradients (loss_scale = replicas)
        numpy         the numpy API: lookup + apply_gradients (loss_scale = replicas)
        torchrec_rw   torchrec.EmbeddingBagCollection sharded ROW_WISE by
                      DistributedModelParallel on gloo: fbgemm's fused CPU kernel
                      (SplitTableBatchedEmbeddingBagsCodegen, EXACT_SGD), the optimizer
                      applied in backward (torch.distributed.optim._apply_optimizer_in_backward)
        torchrec_tw   the same, TABLE_WISE (the whole table on replica 0)
    dlrm    DLRM (Naumov et al., 2019) at Criteo Kaggle's shape: 13 dense features into a
            bottom MLP 512-256-64-16, 26 categorical features, one table each, their
            cardinalities those of the Criteo Kaggle data hashed down to at most
            ``--dlrm-rows`` (default 1,000,000: 5.57M rows in all, where the full data has
            33.8M), embedding dim 16 (the DLRM reference's Kaggle configuration; 356 MB of
            tables, so the four variants with tables hold about 0.7 GB per replica), pairwise dot
            interaction, top MLP 512-256-1, BCE with logits; 2048 samples per replica and
            step (``--dlrm-batch``), one Zipf(1.1) ID per feature and sample; SGD lr 0.1
            for tables and dense layers. Reported as samples/s per replica:
        popdist       torchrec.models.dlrm.DLRMTrain(DLRM(...)) whose embedding_bag_collection
                      is popdist_lite.torch.EmbeddingBagCollection (:func:`popdist_collection`:
                      the 26 tables in one collection, one exchange per lookup and per
                      update; every table row-wise, examples/dlrm.py's default, or placed by
                      the library's planner with ``--dlrm-sharding planner``), its dense
                      layers under popdist_lite.torch.DistributedDataParallel
        popdist_stacked  the same with the 26 tables' rows stacked in one table read by the 26
                      features (each feature's IDs offset into it), placed as ``popdist``'s
                      tables: the issue's goal, a step with 26 tables within 1.1x of one
                      stacked table's (``popdist_over_popdist_stacked``; bench_collection.py
                      measures the same for the numpy API, without the dense model)
        torchrec      the same DLRMTrain(DLRM(...)) on torchrec.EmbeddingBagCollection,
                      sharded by DistributedModelParallel with the plan of its default
                      EmbeddingShardingPlanner (recorded in the JSON; at the default
                      sizes and 2 replicas the 8 smallest tables DATA_PARALLEL, their
                      gradients all-reduced with the dense layers' and applied by the
                      dense optimizer, the others TABLE_WISE with the fused CPU kernel,
                      SGD in backward); the dense layers under torch DDP on gloo, as DMP
                      wraps them
        torchrec_tw   the same with every table TABLE_WISE, table i on replica i % replicas
        dense_only    the dense part alone (bottom MLP, interaction, top MLP, loss; local
                      SGD) on fixed pooled embeddings, no table and no communication: the
                      compute every variant shares

``--check`` runs, in one job on ``--ranks`` replicas, one step of every recsys variant on a
1000 x 8 table (random initial table and random per-replica gradients, Zipf IDs with
repeats) and compares the output and the whole table after the update with numpy
(``W0 - lr * sum of the replicas' gradients per row / replicas``), and three steps of
the popdist, popdist_stacked and torchrec DLRMs at small sizes from the same initial
weights (``--dlrm-sharding`` places the popdist ones), comparing their losses, logits and
final tables (popdist_stacked's cut back into the 26 tables). It prints ``{"check":
{variant: {"ok": ...}}}`` and exits 1 when a variant differs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Callable, NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import numpy as np  # noqa: E402

from _launch import on_test_hosts, run_ranks, test_hosts_setup, under_mpi  # noqa: E402
from bench_lookup import BATCHES, WORKLOADS, across, batches, interleaved, paired_ratio  # noqa: E402

RECSYS = {"rows": WORKLOADS["recsys"]["t"], "dim": WORKLOADS["recsys"]["e"], "ids": WORKLOADS["recsys"]["shape"][0],
          "lr": 0.01, "grad": 1e-3}
#: The 26 categorical features' cardinalities in the Criteo Kaggle (Display Advertising
#: Challenge) data, C1..C26, as the DLRM reference and TorchRec's DLRM example give them.
CRITEO_KAGGLE_ROWS = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
                      5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)
#: DLRM at the DLRM reference's Criteo Kaggle configuration (dlrm_s_pytorch.py's
#: --arch-sparse-feature-size=16 --arch-mlp-bot=13-512-256-64-16 --arch-mlp-top=512-256-1).
DLRM = {"dense_in": 13, "dim": 16, "bottom": [512, 256, 64, 16], "top": [512, 256, 1], "lr": 0.1}
VARIANTS = {"recsys": ("binding_bag", "binding", "numpy_bag", "numpy", "torchrec_rw", "torchrec_tw"),
            "dlrm": ("popdist", "popdist_stacked", "torchrec", "torchrec_tw", "dense_only")}
#: The goal on each workload: popdist-lite's throughput at least this many times that of
#: TorchRec's faster variant.
GOAL_OVER_TORCHREC = 4.0
#: The goal of the DLRM step with 26 tables against one stacked table's: at most this ratio.
GOAL_TABLES_OVER_STACKED = 1.1


class Variant(NamedTuple):
    """A variant of a workload: ``step(s)`` runs training step ``s`` (batch ``s % 4``) and
    returns what the step computed (the lookup's output; DLRM: the loss and logits);
    ``tables()`` returns the whole tables, name -> array, on every replica (collective)."""
    step: Callable[[int], object]
    tables: Callable[[], dict]
    info: dict


# ------------------------------------------------------------------------ process groups

#: The test hosts' network interface (popdist_lite_launcher.testing.netns_hosts names it eth0).
TEST_HOST_INTERFACE = "eth0"


def gloo_group(comm, across_hosts: bool) -> None:
    """A gloo process group over the replicas (rank = replica). Replica 0 picks a free
    port on 127.0.0.1, or across test hosts on its own test-network address (its host
    name's), and broadcasts it; across test hosts gloo's connections use the test
    network's interface (``GLOO_SOCKET_IFNAME``)."""
    import torch.distributed as dist

    if across_hosts:
        os.environ["GLOO_SOCKET_IFNAME"] = TEST_HOST_INTERFACE
    where = None
    if comm.rank == 0:
        host = socket.gethostbyname(socket.gethostname()) if across_hosts else "127.0.0.1"
        with socket.socket() as s:
            s.bind((host, 0))
            where = (host, s.getsockname()[1])
    host, port = comm.bcast(where)  # once per job: pickling is fine here
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=comm.rank, world_size=comm.size)


def gather_objects(obj) -> list:
    import torch.distributed as dist

    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, obj)
    return got


# ------------------------------------------------------------------------------ TorchRec

def sharded_model(model, plan_by_table: dict | None, local_size: int):
    """``model`` (its EmbeddingBagCollections on the meta device, SGD already applied in
    backward to their parameters) sharded by TorchRec's DistributedModelParallel on the
    default (gloo) process group, its other parameters under torch DDP. ``plan_by_table``:
    collection's module path -> {table: ``torchrec.distributed.sharding_plan`` generator};
    ``None``: the plan of DMP's default EmbeddingShardingPlanner, which picks each table's
    sharding and kernel (the fused CPU kernel, or DATA_PARALLEL with the dense kernel for
    small tables)."""
    import torch
    import torch.distributed as dist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    sharder = EmbeddingBagCollectionSharder()
    plan = None
    if plan_by_table is not None:
        w = dist.get_world_size()
        plan = ShardingPlan({path: construct_module_sharding_plan(model.get_submodule(path), tables, sharder=sharder,
                                                                  local_size=local_size, world_size=w,
                                                                  device_type="cpu")
                             for path, tables in plan_by_table.items()})
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                    device=torch.device("cpu"), plan=plan, sharders=[sharder])


def torchrec_plan_summary(dmp) -> dict:
    """table -> "SHARDING_TYPE/kernel ranks" of a DistributedModelParallel's plan."""
    out = {}
    for module_plan in dmp.plan.plan.values():
        for table, p in module_plan.items():
            out[table] = f"{p.sharding_type}/{p.compute_kernel} ranks={p.ranks}"
    return out


def torchrec_tables(dmp) -> dict:
    """Every table of a sharded model, whole, on every rank: each rank's shards (the
    fbgemm weights' ShardedTensor views in ``state_dict()``) all-gathered. Collective."""
    import torch

    local, shapes = [], {}
    for key, value in dmp.state_dict().items():
        if ".embedding_bags." not in key or not key.endswith(".weight"):
            continue
        name = key.split(".embedding_bags.")[1][:-len(".weight")]
        shapes[name] = tuple(value.size())
        if isinstance(value, torch.Tensor) and not hasattr(value, "local_shards"):
            local.append((name, (0, 0), value.detach().numpy().copy()))  # replicated (DATA_PARALLEL)
            continue
        for shard in value.local_shards():
            local.append((name, tuple(shard.metadata.shard_offsets), shard.tensor.detach().numpy().copy()))
    out = {name: np.full(shape, np.nan, np.float32) for name, shape in shapes.items()}
    for part in gather_objects(local):
        for name, (r0, c0), block in part:
            out[name][r0:r0 + block.shape[0], c0:c0 + block.shape[1]] = block
    return out


def set_torchrec_tables(dmp, tables: dict) -> None:
    """Overwrite this rank's shards of each named table with the matching slice of the
    whole table in ``tables`` (the fbgemm weights, in place)."""
    import torch

    for key, value in dmp.state_dict().items():
        if ".embedding_bags." not in key or not key.endswith(".weight"):
            continue
        full = torch.from_numpy(tables[key.split(".embedding_bags.")[1][:-len(".weight")]])
        if not hasattr(value, "local_shards"):
            value.detach().copy_(full)
            continue
        for shard in value.local_shards():
            (r0, c0), (rows, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            shard.tensor.detach().copy_(full[r0:r0 + rows, c0:c0 + cols])


def kjt(keys: list[str], ids: list[np.ndarray]):
    """A KeyedJaggedTensor of one ID per sample and feature (``ids[f]`` for ``keys[f]``)."""
    import torch
    from torchrec import KeyedJaggedTensor

    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.from_numpy(np.concatenate(ids).astype(np.int64)),
                                               lengths=torch.ones(sum(i.size for i in ids), dtype=torch.int32))


# ------------------------------------------------------------------------ recsys workload

def recsys_variants(comm, names, rows: int, dim: int, lr: float, ids: list[np.ndarray], grads: list[np.ndarray],
                    initial: np.ndarray | None = None, local_size: int = 1) -> dict:
    """The recsys workload's variants (:class:`Variant`) on one table of ``rows x dim``:
    step ``s`` looks up ``ids[s % len(ids)]`` (one ID per bag) and back-propagates
    ``grads[s % len(grads)]``; ``initial``: the initial table (default: each library's own)."""
    import torch
    from torch.distributed.optim import _apply_optimizer_in_backward
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
    from torchrec.distributed.sharding_plan import row_wise, table_wise

    import popdist_lite as pl
    import popdist_lite.torch as pt

    tids = [torch.from_numpy(i) for i in ids]
    tgrads = [torch.from_numpy(g) for g in grads]
    offsets = [torch.arange(i.size) for i in ids]
    lengths = [np.ones(i.size, np.int64) for i in ids]
    n = len(ids)
    spec = pl.HostEmbeddingOptimizerSpec(lr)
    init = {} if initial is None else {"initializer": initial}
    out = {}
    if "binding_bag" in names:
        bag = pt.HostEmbeddingBag(rows, dim, mode="sum", optimizer_spec=spec, name="trec.binding_bag", **init)

        def bag_step(s):
            pooled = bag(tids[s % n], offsets[s % n])
            pooled.backward(tgrads[s % n])
            return pooled
        out["binding_bag"] = Variant(bag_step, lambda: {"t0": bag.get_embedding_tensor().numpy()}, {})
    if "binding" in names:
        emb = pt.HostEmbedding(rows, dim, optimizer_spec=spec, name="trec.binding", **init)

        def emb_step(s):
            looked_up = emb(tids[s % n])
            looked_up.backward(tgrads[s % n])
            return looked_up
        out["binding"] = Variant(emb_step, lambda: {"t0": emb.get_embedding_tensor().numpy()}, {})
    if "numpy_bag" in names:
        bag_table = pl.create_host_embedding("trec.numpy_bag", shape=[rows, dim], optimizer_spec=spec, **init)

        def numpy_bag_step(s):
            pooled = bag_table.lookup_bags(ids[s % n], lengths[s % n])
            bag_table.apply_bag_gradients(ids[s % n], grads[s % n], lengths[s % n], loss_scale=comm.size)  # mean
            return pooled
        out["numpy_bag"] = Variant(numpy_bag_step, lambda: {"t0": bag_table.get_embedding_tensor()}, {})
    if "numpy" in names:
        table = pl.create_host_embedding("trec.numpy", shape=[rows, dim], optimizer_spec=spec, **init)

        def numpy_step(s):
            looked_up = table.lookup(ids[s % n])
            table.apply_gradients(ids[s % n], grads[s % n], loss_scale=comm.size)  # mean
            return looked_up
        out["numpy"] = Variant(numpy_step, lambda: {"t0": table.get_embedding_tensor()}, {})

    class Lookup(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
                name="t0", embedding_dim=dim, num_embeddings=rows, feature_names=["f0"], pooling=PoolingType.SUM)],
                device=torch.device("meta"))

        def forward(self, features):
            return self.ebc(features)

    for name, generator in (("torchrec_rw", lambda: row_wise(compute_kernel="fused")),
                            ("torchrec_tw", lambda: table_wise(rank=0, compute_kernel="fused"))):
        if name not in names:
            continue
        model = Lookup()
        _apply_optimizer_in_backward(torch.optim.SGD, model.ebc.parameters(), {"lr": lr})
        dmp = sharded_model(model, {"ebc": {"t0": generator()}}, local_size)
        if initial is not None:
            set_torchrec_tables(dmp, {"t0": initial})
        features = [kjt(["f0"], [i]) for i in ids]

        def torchrec_step(s, dmp=dmp, features=features):
            # TorchRec's collectives divide the gradient by the replica count in backward
            # (torchrec.distributed.comm_ops' gradient division): the mean, as the others
            pooled = dmp(features[s % n]).values()
            pooled.backward(tgrads[s % n])
            return pooled
        out[name] = Variant(torchrec_step, lambda dmp=dmp: torchrec_tables(dmp), {"plan": torchrec_plan_summary(dmp)})
    return out


# -------------------------------------------------------------------------- dlrm workload

def dlrm_tables(rows_cap: int, dim: int):
    """The 26 EmbeddingBagConfigs: table ``t_cat_i`` of min(Criteo Kaggle's C(i+1) count,
    ``rows_cap``) rows, feature ``cat_i``, sum pooling."""
    from torchrec import EmbeddingBagConfig, PoolingType

    return [EmbeddingBagConfig(name=f"t_cat_{i}", embedding_dim=dim, num_embeddings=min(c, rows_cap),
                               feature_names=[f"cat_{i}"], pooling=PoolingType.SUM)
            for i, c in enumerate(CRITEO_KAGGLE_ROWS)]


def popdist_collection(tables, lr: float, initial: dict | None = None, sharding: str = "row_wise", batch: int = 512):
    """THE popdist-lite side's EmbeddingBagCollection in the DLRM workload:
    ``popdist_lite.torch.EmbeddingBagCollection`` of ``tables`` (torchrec
    EmbeddingBagConfigs, taken as they are: the model's one import changed) trained
    with SGD at ``lr`` in backward; ``initial`` (table name -> whole array) their initial
    values (the configs then become the library's, with those initializers), else the
    library's initializer. ``sharding``: every table's placement (``row_wise``,
    examples/dlrm.py's default), or ``planner``: the library's planner told ``batch``."""
    import popdist_lite as pl
    import popdist_lite.torch as pt

    if initial is not None:
        tables = [pt.EmbeddingBagConfig(num_embeddings=c.num_embeddings, embedding_dim=c.embedding_dim, name=c.name,
                                        feature_names=list(c.feature_names), pooling=c.pooling,
                                        initializer=initial[c.name]) for c in tables]
    plan = None if sharding == "planner" else {c.name: sharding for c in tables}
    return pt.EmbeddingBagCollection(tables=tables, optimizer=pl.HostEmbeddingOptimizerSpec(lr), plan=plan,
                                     planner=pl.EmbeddingShardingPlanner(batch_size=batch))


def collection_tables(ebc) -> dict:
    """Every table of a popdist-lite collection, whole, on every replica (each
    ``ShardedTable.get_embedding_tensor()``, in the collection's table order). Collective."""
    return {name: table.get_embedding_tensor() for name, table in ebc.tables.items()}


def collection_plan(ebc) -> dict:
    """table -> "sharding ranks" of a popdist-lite collection's plan."""
    return {name: f"{s.sharding_type.value} ranks={list(s.ranks)}" for name, s in ebc.plan.shardings.items()}


def stacked_config(tables, dim: int):
    """One torchrec EmbeddingBagConfig ``stacked`` of all ``tables``' rows, read by all their
    features (feature ``j``'s IDs offset by the rows of the tables before its own), and
    those offsets."""
    from torchrec import EmbeddingBagConfig, PoolingType

    offsets = np.cumsum([0] + [c.num_embeddings for c in tables[:-1]])
    rows = int(sum(c.num_embeddings for c in tables))
    return EmbeddingBagConfig(name="stacked", embedding_dim=dim, num_embeddings=rows, pooling=PoolingType.SUM,
                              feature_names=[f for c in tables for f in c.feature_names]), offsets


def dlrm_batches(rank: int, batch: int, rows: list[int], dense_in: int) -> list[tuple]:
    """``BATCHES`` batches of this replica: (dense (B, 13) float32 = log(1 + x) of
    integer counts, IDs per feature (one per sample, Zipf(1.1) - 1 clipped to the
    table), labels (B,) 0/1), from a fixed seed per replica."""
    rng = np.random.default_rng([2024, rank])
    out = []
    for _ in range(BATCHES):
        dense = np.log1p(rng.geometric(0.01, size=(batch, dense_in)).astype(np.float32))
        ids = [np.minimum(rng.zipf(1.1, size=batch) - 1, t - 1) for t in rows]
        out.append((dense, ids, rng.integers(0, 2, size=batch)))
    return out


def dlrm_variants(comm, names, batch: int, rows_cap: int, dim: int, local_size: int,
                  same_start: bool = False, sharding: str = "row_wise") -> dict:
    """The dlrm workload's variants (:class:`Variant`; ``step(s)`` returns (loss, logits)).
    ``same_start``: every variant starts from the torchrec variant's initial tables and
    dense weights (for ``--check``); ``sharding``: the popdist variants' placement
    (:func:`popdist_collection`)."""
    import torch
    from torch.distributed.optim import _apply_optimizer_in_backward
    from torchrec import EmbeddingBagCollection, KeyedTensor
    from torchrec.datasets.utils import Batch
    from torchrec.distributed.sharding_plan import table_wise
    from torchrec.models.dlrm import DLRM as TorchRecDLRM
    from torchrec.models.dlrm import DLRMTrain
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    import popdist_lite.torch as pt

    cfg = DLRM
    bottom = cfg["bottom"][:-1] + [dim]
    tables = dlrm_tables(rows_cap, dim)
    keys = [c.feature_names[0] for c in tables]
    batches = dlrm_batches(comm.rank, batch, [c.num_embeddings for c in tables], cfg["dense_in"])
    data = [Batch(dense_features=torch.from_numpy(d), sparse_features=kjt(keys, ids), labels=torch.from_numpy(labels))
            for d, ids, labels in batches]
    stacked, offsets = stacked_config(tables, dim)
    data_stacked = [Batch(dense_features=torch.from_numpy(d),
                          sparse_features=kjt(keys, [i + o for i, o in zip(ids, offsets)]),
                          labels=torch.from_numpy(labels)) for d, ids, labels in batches]
    n, lr = len(data), cfg["lr"]

    def dlrm(ebc):
        torch.manual_seed(0)  # the same dense weights in every variant
        return DLRMTrain(TorchRecDLRM(embedding_bag_collection=ebc, dense_in_features=cfg["dense_in"],
                                      dense_arch_layer_sizes=bottom, over_arch_layer_sizes=cfg["top"]))

    def trainer(model, dense_params, inputs=data):
        opt = torch.optim.SGD(dense_params, lr=lr)

        def step(s):
            loss, (_, logits, _) = model(inputs[s % n])
            opt.zero_grad()
            loss.backward()  # the tables' SGD steps run here, in backward
            opt.step()
            return loss.detach(), logits
        return step

    out, initial = {}, None
    for name in ("torchrec", "torchrec_tw"):
        if name not in names and not (same_start and name == "torchrec"):
            continue
        model = dlrm(EmbeddingBagCollection(tables=tables, device=torch.device("meta")))
        ebc = model.model.sparse_arch.embedding_bag_collection
        _apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": lr})
        plan = None if name == "torchrec" else {"model.sparse_arch.embedding_bag_collection": {
            c.name: table_wise(rank=i % comm.size, compute_kernel="fused") for i, c in enumerate(tables)}}
        dmp = sharded_model(model, plan, local_size)
        if same_start and initial is None:
            initial = {"tables": torchrec_tables(dmp),
                       "dense": {k: v.detach().clone() for k, v in dmp.module.named_parameters()
                                 if "sparse_arch" not in k}}
        if same_start:
            set_torchrec_tables(dmp, initial["tables"])
        # TorchRec's dense optimizer: every parameter without an optimizer in backward (the
        # dense layers, and the tables the planner made DATA_PARALLEL, whose gradients DDP
        # all-reduces), as TorchRec's examples build it
        dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
        out[name] = Variant(trainer(dmp, dense), lambda dmp=dmp: torchrec_tables(dmp),
                            {"plan": torchrec_plan_summary(dmp)})
    for name in ("popdist", "popdist_stacked"):
        if name not in names:
            continue
        if name == "popdist":
            ebc = popdist_collection(tables, lr, initial["tables"] if initial else None, sharding, batch)
        else:  # the whole tables back from the stacked one's slices
            whole = {"stacked": np.concatenate([initial["tables"][c.name] for c in tables])} if initial else None
            ebc = popdist_collection([stacked], lr, whole, sharding, batch)
        model = dlrm(ebc)
        if initial:
            with torch.no_grad():
                for k, p in model.named_parameters():
                    p.copy_(initial["dense"][k.removeprefix("module.")])
        ddp = pt.DistributedDataParallel(model)

        def whole_tables(ebc=ebc, name=name):
            got = collection_tables(ebc)
            if name == "popdist":
                return got
            parts = np.split(got["stacked"], offsets[1:])
            return {c.name: part for c, part in zip(tables, parts)}
        out[name] = Variant(trainer(ddp, list(ddp.parameters()), data if name == "popdist" else data_stacked),
                            whole_tables, {"collection": f"{type(ebc).__module__}.{type(ebc).__name__}",
                                           "plan": collection_plan(ebc)})
    if "dense_only" in names:
        pooled = torch.randn(batch, len(keys) * dim, generator=torch.Generator().manual_seed(0), requires_grad=True)

        class Fixed(torch.nn.Module):
            """Fixed pooled embeddings in an EmbeddingBagCollection's interface (no table;
            backward computes their gradient, as for a table, and stops there)."""

            def embedding_bag_configs(self):
                return tables

            def forward(self, features):
                return KeyedTensor(keys=keys, length_per_key=[dim] * len(keys), values=pooled)

        model = dlrm(Fixed())
        out["dense_only"] = Variant(trainer(model, list(model.parameters())), dict, {})
    if same_start and "torchrec" not in names:
        out.pop("torchrec", None)
    return out


# --------------------------------------------------------------------------------- worker

def local_size(comm) -> int:
    """Replicas on this replica's host."""
    from mpi4py import MPI

    return comm.Split_type(MPI.COMM_TYPE_SHARED).size


def worker(opts) -> None:
    import torch

    import popdist_lite as pl

    pl.init()
    comm = pl.replica_comm()
    gloo_group(comm, opts.hosts > 0)
    local = local_size(comm)
    names = opts.variants.split(",")
    if opts.workload == "recsys":
        r = RECSYS
        ids = batches({**WORKLOADS["recsys"], "t": opts.recsys_rows}, comm.rank)
        grads = [np.full((i.size, r["dim"]), r["grad"], np.float32) for i in ids]
        variants = recsys_variants(comm, names, opts.recsys_rows, r["dim"], r["lr"], ids, grads, local_size=local)
    else:
        variants = dlrm_variants(comm, names, opts.dlrm_batch, opts.dlrm_rows, opts.dlrm_dim, local,
                                 sharding=opts.dlrm_sharding)
    variants = {n: variants[n] for n in names if n in variants}
    times = interleaved(comm, {n: v.step for n, v in variants.items()}, opts.steps, opts.blocks, lambda v, s: v(s))
    report = {}
    for name in variants:
        ms = across(comm, float(np.median(times[name])))
        report[name] = {"workload": opts.workload, "variant": name, "steps": opts.steps, "blocks": opts.blocks,
                        "step_ms": ms, **variants[name].info}
        if opts.workload == "dlrm":
            report[name]["samples_per_s_per_replica"] = round(opts.dlrm_batch / (ms["max"] / 1e3), 1)
    paired = {f"{a}_over_{b}": paired_ratio(comm, times[a], times[b]) for a, b in pairs(list(variants))}
    if comm.rank == 0:
        print("JSON " + json.dumps({"variants": report, "paired": paired,
                                    "torch_threads": torch.get_num_threads()}), flush=True)
    quit_worker(comm)


def quit_worker(comm) -> None:
    """Finalize MPI and leave without destructors once every replica is done: tearing
    down gloo and TorchRec's modules at exit sometimes aborts ("terminate called without
    an active exception") after the work is done; ``os._exit`` avoids it."""
    from mpi4py import MPI

    comm.Barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    MPI.Finalize()
    os._exit(0)


# ---------------------------------------------------------------------------------- check

def check_worker(opts) -> None:
    """``--check``: see the module docstring."""
    import popdist_lite as pl

    pl.init()
    comm = pl.replica_comm()
    gloo_group(comm, opts.hosts > 0)
    local = local_size(comm)
    report = {"recsys": check_recsys(comm, local), "dlrm": check_dlrm(comm, local, opts)}
    if comm.rank == 0:
        print("JSON " + json.dumps({"check": {f"{w}.{v}": r for w, got in report.items() for v, r in got.items()}}),
              flush=True)
    quit_worker(comm)


def _array(x) -> np.ndarray:
    return x.detach().numpy() if hasattr(x, "detach") else np.asarray(x)


def check_recsys(comm, local: int) -> dict:
    """One step of every recsys variant on a 1000 x 8 table: the output against the
    initial rows, the whole table after the update against numpy's."""
    w, rank = comm.size, comm.rank
    t, e, n, lr = 1000, 8, 64, 0.5
    initial = np.random.default_rng(0).standard_normal((t, e)).astype(np.float32)
    ids = [batches({"t": t, "shape": (n,), "kind": "zipf"}, r)[0] for r in range(w)]
    grads = [np.random.default_rng([100, r]).standard_normal((n, e)).astype(np.float32) for r in range(w)]
    expect = initial.copy()
    for r in range(w):
        np.add.at(expect, ids[r], -lr * grads[r] / w)  # the mean over replicas, then SGD
    untouched = np.ones(t, bool)
    untouched[np.concatenate(ids)] = False
    out = {}
    for name, v in recsys_variants(comm, VARIANTS["recsys"], t, e, lr, [ids[rank]], [grads[rank]], initial,
                                   local).items():
        forward_err = float(np.abs(_array(v.step(0)) - initial[ids[rank]]).max())
        table = v.tables()["t0"]
        errors = comm.allgather((forward_err, float(np.abs(table - expect).max()),
                                 bool(np.array_equal(table[untouched], initial[untouched]))))
        fwd, upd = max(x[0] for x in errors), max(x[1] for x in errors)
        out[name] = {"ok": fwd < 1e-6 and upd < 1e-5 and all(x[2] for x in errors), "forward_max_abs_err": fwd,
                     "update_max_abs_err": upd, "untouched_rows_unchanged": all(x[2] for x in errors),
                     **v.info}
    return out


def check_dlrm(comm, local: int, opts) -> dict:
    """Three steps of the DLRM variants from the torchrec variant's initial weights at small
    sizes: every variant's losses, logits and final tables against the torchrec variant's."""
    steps = 3
    variants = dlrm_variants(comm, ["torchrec", "torchrec_tw", "popdist", "popdist_stacked"], batch=64,
                             rows_cap=1000, dim=8, local_size=local, same_start=True, sharding=opts.dlrm_sharding)
    initial = variants["torchrec"].tables()
    runs = {}
    for name, v in variants.items():
        got = [v.step(s) for s in range(steps)]
        runs[name] = ([float(loss) for loss, _ in got], np.stack([_array(logits) for _, logits in got]), v.tables(),
                      v.info)
    ref_losses, ref_logits, ref_tables, _ = runs["torchrec"]
    # the comparison means something only if the steps moved the tables
    moved = max(float(np.abs(ref_tables[k] - initial[k]).max()) for k in initial)
    out = {}
    for name, (losses, logits, tables, info) in runs.items():
        errors = comm.allgather((float(np.abs(np.array(losses) - ref_losses).max()),
                                 float(np.abs(logits - ref_logits).max()),
                                 max(float(np.abs(tables[k] - ref_tables[k]).max()) for k in ref_tables)))
        loss_err, logit_err, table_err = (max(x[i] for x in errors) for i in range(3))
        out[name] = {"ok": moved > 0 and loss_err < 1e-5 and logit_err < 1e-4 and table_err < 1e-3 * moved,
                     "losses": losses, "loss_max_abs_err": loss_err, "logit_max_abs_err": logit_err,
                     "table_max_abs_err": table_err, "tables_moved_max": moved, **info}
    return out


# ----------------------------------------------------------------------------------- main

def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "torchrec", "fbgemm-gpu-cpu", "numpy", "mpi4py"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hosts", type=int, default=0,
                        help="spread the replicas over this many network-namespace test hosts, TCP only (root)")
    parser.add_argument("--workloads", default=",".join(VARIANTS))
    parser.add_argument("--steps-recsys", type=int, default=160)
    parser.add_argument("--steps-dlrm", type=int, default=48)
    parser.add_argument("--blocks", type=int, default=16, help="timed blocks per variant (median kept)")
    parser.add_argument("--recsys-rows", type=int, default=RECSYS["rows"], help="the recsys table's rows")
    parser.add_argument("--dlrm-rows", type=int, default=1_000_000, help="the DLRM tables' rows at most (hashed down)")
    parser.add_argument("--dlrm-dim", type=int, default=DLRM["dim"], help="the DLRM tables' dimension")
    parser.add_argument("--dlrm-batch", type=int, default=2048, help="DLRM samples per replica and step")
    parser.add_argument("--dlrm-sharding", choices=["row_wise", "column_wise", "table_wise", "data_parallel",
                                                    "planner"], default="row_wise",
                        help="the popdist DLRM variants' placement (every table's, or each by the library's planner)")
    parser.add_argument("--recsys-variants", default=",".join(VARIANTS["recsys"]))
    parser.add_argument("--dlrm-variants", default=",".join(VARIANTS["dlrm"]))
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--check", action="store_true",
                        help="one step of every variant against numpy (exit 1 on a difference)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--variants", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker or under_mpi():
        (check_worker if opts.check else worker)(opts)
        return
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    common = ["--hosts", str(opts.hosts), "--recsys-rows", str(opts.recsys_rows), "--dlrm-rows", str(opts.dlrm_rows),
              "--dlrm-dim", str(opts.dlrm_dim), "--dlrm-batch", str(opts.dlrm_batch),
              "--dlrm-sharding", opts.dlrm_sharding]
    results, summary = {}, {}
    with on_test_hosts(opts.hosts, opts.ranks) as launcher_args:
        if opts.check:
            got = run_ranks(os.path.abspath(__file__), ["--check", *common], opts.ranks, opts.timeout, launcher_args)[0]
            print(json.dumps(got, indent=1))
            sys.exit(0 if all(v["ok"] for v in got["check"].values()) else 1)
        for workload in opts.workloads.split(","):
            steps = opts.steps_recsys if workload == "recsys" else opts.steps_dlrm
            variants = opts.recsys_variants if workload == "recsys" else opts.dlrm_variants
            args = ["--workload", workload, "--variants", variants, "--steps", str(steps), "--blocks", str(opts.blocks),
                    *common]
            got = run_ranks(os.path.abspath(__file__), args, opts.ranks, opts.timeout, launcher_args)[0]
            results[workload] = got["variants"]
            summary[workload] = summarize(workload, got)
    where = test_hosts_setup(opts.hosts, opts.ranks) if opts.hosts else {}
    sizes = {"recsys": {"table": [opts.recsys_rows, RECSYS["dim"]], "ids_per_replica": RECSYS["ids"]},
             "dlrm": {"tables": [min(c, opts.dlrm_rows) for c in CRITEO_KAGGLE_ROWS], "dim": opts.dlrm_dim,
                      "rows": sum(min(c, opts.dlrm_rows) for c in CRITEO_KAGGLE_ROWS),
                      "batch_per_replica": opts.dlrm_batch, "bottom": DLRM["bottom"][:-1] + [opts.dlrm_dim],
                      "top": DLRM["top"], "popdist_sharding": opts.dlrm_sharding}}
    print(json.dumps({"benchmark": "torchrec", "replicas": opts.ranks, **where,
                      "seconds": round(time.perf_counter() - start, 1), "versions": _versions(),
                      "machine": {"cpus": os.cpu_count(), "load_avg_1min_before": round(load_before, 2),
                                  "load_avg_1min_after": round(os.getloadavg()[0], 2)},
                      "sizes": {w: sizes[w] for w in results}, "summary": summary, "results": results}, indent=1))


def pairs(names: list[str]) -> list[tuple[str, str]]:
    """The ratios reported: each TorchRec variant's step over each popdist-lite variant's
    (how many times popdist-lite's throughput is TorchRec's), the 26 tables' DLRM step
    over the stacked table's (``popdist_over_popdist_stacked``), and every variant's
    over ``dense_only`` (the share of the step outside the shared dense compute)."""
    theirs = [n for n in names if n.startswith("torchrec")]
    ours = [n for n in names if n not in theirs and n != "dense_only"]
    out = [(a, b) for a in theirs for b in ours]
    if "popdist" in names and "popdist_stacked" in names:
        out.append(("popdist", "popdist_stacked"))
    if "dense_only" in names:
        out += [(a, "dense_only") for a in ours + theirs]
    return out


def summarize(workload: str, got: dict) -> dict:
    """The slower replica's median step per variant (and DLRM's samples/s per replica),
    the ratios of :func:`pairs` from them and per round (``*_paired``), and the goal:
    popdist-lite's main variant against TorchRec's faster one."""
    ms = {name: r["step_ms"]["max"] for name, r in got["variants"].items()}
    s = {"step_ms_max": ms}
    if workload == "dlrm":
        s["samples_per_s_per_replica"] = {n: r["samples_per_s_per_replica"] for n, r in got["variants"].items()}
    s.update({f"{a}_over_{b}": round(ms[a] / ms[b], 2) for a, b in pairs(list(ms))})
    s.update({k + "_paired": v for k, v in got["paired"].items()})
    theirs = [n for n in ms if n.startswith("torchrec")]
    ours = "binding_bag" if workload == "recsys" else "popdist"
    if theirs and ours in ms:
        best = min(theirs, key=ms.get)
        ratio = ms[best] / ms[ours]
        s["goal"] = {"what": f"{ours}'s throughput / TorchRec's faster variant's ({best})",
                     "at_least": GOAL_OVER_TORCHREC, "ratio": round(ratio, 2), "met": ratio >= GOAL_OVER_TORCHREC}
    if workload == "dlrm" and "popdist" in ms and "popdist_stacked" in ms:
        ratio = ms["popdist"] / ms["popdist_stacked"]
        s["goal_tables"] = {"what": "popdist's step (26 tables) / popdist_stacked's (one stacked table)",
                            "at_most": GOAL_TABLES_OVER_STACKED, "ratio": round(ratio, 3),
                            "paired": got["paired"].get("popdist_over_popdist_stacked"),
                            "met": ratio <= GOAL_TABLES_OVER_STACKED}
    return s


if __name__ == "__main__":
    main()
