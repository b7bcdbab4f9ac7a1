#!/usr/bin/env python3
"""DLRM on Criteo-format click logs in PyTorch, the tables sharded over the replicas.

Run it on 2 replicas (one MPI rank each) with::

    poprun-lite --num-replicas 2 python examples/dlrm.py

or as a single process with ``python examples/dlrm.py``. It needs the ``[dlrm]`` extra
(PyTorch and scikit-learn: docs/dlrm.md). Without ``--data`` it trains on
``data/criteo-synthetic``, written by ``scripts/make_criteo.py`` (200,000 lines) when
missing; ``--data`` takes Criteo's own files (Kaggle's ``train.txt``, Terabyte's
``day_N`` or ``day_N.gz``) or directories of them.

The model is DLRM (Naumov et al., "Deep Learning Recommendation Model for
Personalization and Recommendation Systems", 2019) as ``torchrec.models.dlrm.DLRM``
builds it, with TorchRec's module names:

* ``DenseArch``: an MLP (ReLU after every layer) over the 13 dense features,
  ``log(1 + x)`` of Criteo's integers, to ``embedding_dim``;
* ``SparseArch``: an ``EmbeddingBagCollection`` of 26 tables, one per categorical
  feature, pooled to ``(B, 26, embedding_dim)``: ``popdist_lite.torch``'s, whose tables
  are placed over the replicas (row-wise by default; ``--sharding``) and updated by
  their own optimizer in the backward pass, every table's IDs, rows and gradients in
  one exchange;
* ``InteractionArch``: the dense output and the 26 pooled vectors, pairwise dot
  products (the upper triangle), concatenated with the dense output;
* ``OverArch``: an MLP (ReLU but after the last layer) to one logit; the loss is binary
  cross-entropy.

The dense layers are data-parallel under ``popdist_lite.torch.DistributedDataParallel``,
trained by ``torch.optim`` (SGD or Adagrad); the tables by the library's SGD or
row-wise Adagrad (TorchRec's ``EXACT_SGD`` and ``EXACT_ROWWISE_ADAGRAD``). The data come
through ``popdist_lite.infeed`` from host feed processes (``poprun-lite
--feeders-per-replica F``; a thread with F = 0) that read and parse the TSV files
(examples/criteo.py), each its own batches of one global sequence.

Every ``--log-every`` steps replica 0 prints the log loss and ROC AUC of the window's
predictions, gathered from all replicas (scikit-learn's ``log_loss`` and
``roc_auc_score``). Each prediction is made before the model trains on it (progressive
validation), so the figures measure samples the model has not seen. What replica 0
prints, and ``--log-dir``, are the Shakespeare examples' (run_log.py): a first line
before the slow start-up, a tqdm bar on a terminal, ``Step N, loss = X, AUC = Y, R
steps/s, ETA T``, ``checkpoint step N saved (path, size, seconds)``, and the final log
loss and AUC on the last line; with ``--log-dir DIR`` the lines in ``DIR/log.txt`` and
the loss curve in ``DIR/loss.png``. Every step and its data loading and model
computation are marked on the timeline (``poprun-lite --timeline``).

Checkpoints, elastic resizes and Slurm as examples/shakespeare_torch.py:
``--checkpoint-dir DIR --checkpoint-every N`` saves the dense weights, the tables and
their optimizer state, the ``torch.optim`` state, the feed position and the step;
``--resume`` continues from the newest complete checkpoint at any replica count, with
exactly the losses of an uninterrupted run at the same replica count
(tests/test_dlrm_example.py). The feed's sharding continues after the batches already
taken at any replica count, so an elastic job's resize (``poprun-lite --min-replicas``:
the example asks ``popdist_lite.should_checkpoint()`` at every step boundary, then saves
and stops) neither repeats nor skips a sample. ``--emb-cache-kib`` keeps the larger
tables on local disk behind a cache (``popdist_lite.DiskStorage``, docs/offload.md).

The sparse tables are built in one place, ``make_tables`` below, as TorchRec builds
them (``EmbeddingBagConfig`` s into an ``EmbeddingBagCollection``); a TorchRec
collection would take their place by changing the import and the optimizer's spelling
(docs/torch.md, "Coming from TorchRec").
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import criteo  # noqa: E402  (the TSV format, the feed's dataset)
import run_log  # noqa: E402  (what replica 0 prints)

if __name__ == "__main__" and not {"-h", "--help"} & set(sys.argv[1:]):
    run_log.starting(__file__, "importing PyTorch")  # the first line, before an import of seconds

import popdist_lite as pl  # noqa: E402
import torch  # noqa: E402
import popdist_lite.torch as pt  # noqa: E402

from popdist_lite.torch import EmbeddingBagCollection, EmbeddingBagConfig  # noqa: E402

F = torch.nn.functional
DEFAULT_DATA = ROOT / "data" / "criteo-synthetic"
GENERATOR = ROOT / "scripts" / "make_criteo.py"
DEFAULT_ROWS = 200_000


# --------------------------------------------------------------------------------------
# the model (torchrec.models.dlrm's modules)
# --------------------------------------------------------------------------------------
def mlp(in_features: int, sizes: list[int], relu_last: bool = True) -> torch.nn.Sequential:
    """Linear layers of ``sizes`` from ``in_features``, a ReLU after each (after the
    last one only with ``relu_last``)."""
    layers = []
    for k, size in enumerate(sizes):
        layers.append(torch.nn.Linear(in_features, size))
        if relu_last or k + 1 < len(sizes):
            layers.append(torch.nn.ReLU())
        in_features = size
    return torch.nn.Sequential(*layers)


class DenseArch(torch.nn.Module):
    """The dense features ``(B, in_features)`` -> ``(B, layer_sizes[-1])``."""

    def __init__(self, in_features: int, layer_sizes: list[int]):
        super().__init__()
        self.model = mlp(in_features, layer_sizes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)


class SparseArch(torch.nn.Module):
    """The collection's pooled lookups ``(B, F, D)``, features in the tables' order."""

    def __init__(self, embedding_bag_collection: torch.nn.Module):
        super().__init__()
        self.embedding_bag_collection = embedding_bag_collection
        configs = embedding_bag_collection.embedding_bag_configs()
        self.sparse_feature_names = [name for c in configs for name in c.feature_names]

    def forward(self, features) -> torch.Tensor:
        pooled = self.embedding_bag_collection(features)
        if hasattr(pooled, "to_dict"):  # a TorchRec KeyedTensor
            pooled = pooled.to_dict()
        return torch.stack([pooled[name] for name in self.sparse_feature_names], dim=1)


class InteractionArch(torch.nn.Module):
    """``(B, D)`` dense and ``(B, F, D)`` sparse -> ``(B, D + F + F(F-1)/2)``: the dense
    vector, then the dot products of every pair of the ``F + 1`` vectors."""

    def __init__(self, num_sparse_features: int):
        super().__init__()
        self.register_buffer("triu_indices", torch.triu_indices(num_sparse_features + 1, num_sparse_features + 1,
                                                                offset=1), persistent=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        combined = torch.cat([dense.unsqueeze(1), sparse], dim=1)
        interactions = torch.bmm(combined, combined.transpose(1, 2))
        return torch.cat([dense, interactions[:, self.triu_indices[0], self.triu_indices[1]]], dim=1)


class OverArch(torch.nn.Module):
    """``(B, in_features)`` -> ``(B, layer_sizes[-1])`` logits."""

    def __init__(self, in_features: int, layer_sizes: list[int]):
        super().__init__()
        self.model = mlp(in_features, layer_sizes, relu_last=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model(features)


class DLRM(torch.nn.Module):
    """DLRM with ``torchrec.models.dlrm.DLRM``'s arguments; ``forward(dense_features,
    sparse_features)`` -> logits ``(B, over_arch_layer_sizes[-1])``."""

    def __init__(self, embedding_bag_collection: torch.nn.Module, dense_in_features: int,
                 dense_arch_layer_sizes: list[int], over_arch_layer_sizes: list[int]):
        super().__init__()
        dims = {c.embedding_dim for c in embedding_bag_collection.embedding_bag_configs()}
        if dims != {dense_arch_layer_sizes[-1]}:
            raise ValueError(f"DLRM: every table's embedding_dim and the dense arch's last layer must be equal, "
                             f"got {sorted(dims)} and {dense_arch_layer_sizes[-1]}")
        self.sparse_arch = SparseArch(embedding_bag_collection)
        f, d = len(self.sparse_arch.sparse_feature_names), dense_arch_layer_sizes[-1]
        self.dense_arch = DenseArch(dense_in_features, dense_arch_layer_sizes)
        self.inter_arch = InteractionArch(f)
        self.over_arch = OverArch(d + f + f * (f - 1) // 2, over_arch_layer_sizes)

    def forward(self, dense_features: torch.Tensor, sparse_features) -> torch.Tensor:
        dense = self.dense_arch(dense_features)
        return self.over_arch(self.inter_arch(dense, self.sparse_arch(sparse_features)))


def make_tables(sizes: list[int], dim: int, args) -> EmbeddingBagCollection:
    """The 26 tables, one per categorical feature (table ``t_cat_j`` looks up feature
    ``cat_j``, initialised with seed ``args.seed + j``), in one ``EmbeddingBagCollection``
    placed by ``--sharding``; with ``--emb-cache-kib``, the tables whose weights per
    replica exceed the cache on local disk, sharing one cache of that size per table."""
    row_wise_adagrad = args.optimizer == "adagrad"
    spec = (pl.HostEmbeddingAdagradOptimizerSpec(args.emb_lr, rowwise=True) if row_wise_adagrad
            else pl.HostEmbeddingOptimizerSpec(args.emb_lr))
    tables = [EmbeddingBagConfig(name=f"t_{name}", embedding_dim=dim, num_embeddings=n, feature_names=[name],
                                 seed=args.seed + j)
              for j, (name, n) in enumerate(zip(criteo.CAT_NAMES, sizes))]
    storage = {}
    if args.emb_cache_kib is not None:
        cache = int(args.emb_cache_kib * 1024)
        big = [t.name for t in tables if -(-t.num_embeddings // pl.num_replicas()) * dim * 4 > cache]
        if big:  # one disk stack: its cache is that of the tables it holds
            disk = pl.DiskStorage(cache * len(big), directory=None if args.emb_dir is None else str(args.emb_dir))
            storage = {name: disk for name in big}
    plan = None if args.sharding == "planner" else {t.name: args.sharding for t in tables}
    planner = pl.EmbeddingShardingPlanner(batch_size=args.batch_size)  # one ID per bag and feature
    return EmbeddingBagCollection(tables=tables, optimizer=spec, storage=storage, plan=plan, planner=planner)


def sparse_features(ids: np.ndarray) -> pl.KeyedJaggedArray:
    """The feed's ``(B, 26)`` IDs as the collection's keyed input: one ID per bag,
    feature after feature (``KeyedJaggedTensor.from_lengths_sync``'s layout)."""
    return pl.KeyedJaggedArray.from_lengths(criteo.CAT_NAMES, np.ascontiguousarray(ids.T).reshape(-1),
                                            np.ones(ids.size, np.int64))


# --------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------
def window_metrics(predictions: list[np.ndarray], labels: list[np.ndarray]) -> tuple[float, float] | None:
    """Log loss and ROC AUC (scikit-learn) of the window's predictions of every replica,
    on replica 0 (None elsewhere); the AUC is NaN when the window holds one class only.
    Collective: an all-gather of each replica's predictions and labels (the same count
    on every replica: whole batches of one size)."""
    mine = np.stack([np.concatenate(predictions), np.concatenate(labels)]).astype(np.float32)
    everyone = pl.all_gather(mine)  # (replicas, 2, n)
    if not np.isfinite(everyone).all():  # on every replica alike
        raise FloatingPointError("a prediction became NaN; try a smaller --lr / --emb-lr")
    if pl.replica_id() != 0:
        return None
    from sklearn.metrics import log_loss, roc_auc_score

    p, y = everyone[:, 0].ravel().astype(np.float64), everyone[:, 1].ravel()
    loss = log_loss(y, p, labels=[0, 1])
    auc = roc_auc_score(y, p) if 0 < y.sum() < y.size else float("nan")
    return float(loss), float(auc)


# --------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------
def ensure_data(path: Path, say) -> None:
    """Write the default synthetic data on replica 0 if it is missing (``say`` tells the
    user); every replica learns the outcome through a broadcast."""
    missing = pl.all_reduce(np.array([0 if path.exists() else 1], np.int32), op="max")
    if not missing[0]:
        return
    ok = np.zeros(1, np.int32)
    if pl.replica_id() == 0:
        say(f"{path} is missing; writing {DEFAULT_ROWS} synthetic lines with {GENERATOR} ...")
        tmp = path.with_name(path.name + ".tmp")
        try:
            r = subprocess.run([sys.executable, str(GENERATOR), str(tmp), "--rows", str(DEFAULT_ROWS)],
                               stdout=subprocess.DEVNULL, timeout=600)
            if r.returncode == 0:
                tmp.rename(path)  # whole or not at all
            ok[0] = int(path.exists())
        except (OSError, subprocess.TimeoutExpired) as e:
            print(f"dlrm.py: {GENERATOR} failed: {e}", file=sys.stderr)
    if not pl.broadcast(ok, root=0)[0]:
        raise SystemExit(f"dlrm.py: replica {pl.replica_id()}: could not write {path}; run {GENERATOR} by hand")


#: Data up to this many bytes (uncompressed) are counted for the progress bar's total.
COUNT_MAX_BYTES = 1 << 30


def steps_in_data(paths: list[Path], batch_size: int, replicas: int, epochs: int, position: int) -> int | None:
    """The steps left in the data for ``replicas`` replicas after ``position`` global
    batches (the feed's): each of the ``epochs`` passes is every line once, global batch
    ``g`` lines ``[g*B, (g+1)*B)`` (the last partial one dropped), and the replicas stop
    together when the one with the fewest batches has none left. ``None`` when counting
    would cost a read of more than :data:`COUNT_MAX_BYTES` or of compressed files (the
    bar then shows no total and the step lines no ETA). Local: replica 0's display only."""
    try:
        files = criteo.list_files(paths)
        if any(f.suffix == ".gz" for f in files) or sum(f.stat().st_size for f in files) > COUNT_MAX_BYTES:
            return None
        lines = 0
        for f in files:
            with open(f, "rb") as stream:
                last = b"\n"
                while chunk := stream.read(1 << 20):
                    lines += chunk.count(b"\n")
                    last = chunk[-1:]
                lines += last != b"\n"  # a last line without its newline is a line
    except (OSError, ValueError):
        return None  # the feed says what is wrong with the data
    return max(lines * epochs // batch_size - position, 0) // replicas


# --------------------------------------------------------------------------------------
# the job
# --------------------------------------------------------------------------------------
def layer_sizes(text: str) -> list[int]:
    sizes = [int(s) for s in text.split(",")]
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated sizes >= 1, got {text!r}")
    return sizes


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="examples:\n"
               "  poprun-lite --num-replicas 2 python examples/dlrm.py\n"
               "  poprun-lite --num-replicas 2 --feeders-per-replica 1 python examples/dlrm.py --data train.txt "
               "--num-embeddings 1000000 --checkpoint-dir ckpt --checkpoint-every 1000 --resume")
    p.add_argument("--data", type=Path, nargs="+", default=None,
                   help=f"Criteo TSV files or directories of them, read in order (default: {DEFAULT_DATA.relative_to(ROOT)}, "
                        "written by scripts/make_criteo.py if missing)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: until the data end)")
    p.add_argument("--epochs", type=int, default=1, help="passes over the data")
    p.add_argument("--batch-size", type=int, default=256, help="samples per replica per step")
    p.add_argument("--num-embeddings", type=int, default=100_000,
                   help="rows of every table (each hash is taken modulo this: DLRM's --max-ind-range)")
    p.add_argument("--num-embeddings-per-feature", type=layer_sizes, default=None,
                   help="26 comma-separated row counts, one per table (instead of --num-embeddings)")
    p.add_argument("--embedding-dim", type=int, default=16, help="the tables' width (= the dense arch's last layer)")
    p.add_argument("--dense-arch-layer-sizes", type=layer_sizes, default=[64, 16],
                   help="the bottom MLP's layers (the last equals --embedding-dim)")
    p.add_argument("--over-arch-layer-sizes", type=layer_sizes, default=[64, 32, 1], help="the top MLP's layers")
    p.add_argument("--optimizer", choices=["sgd", "adagrad"], default="adagrad",
                   help="dense: torch.optim's SGD or Adagrad; tables: SGD or row-wise Adagrad")
    p.add_argument("--lr", type=float, default=0.05, help="dense learning rate")
    p.add_argument("--emb-lr", type=float, default=1.0, help="the tables' learning rate")
    p.add_argument("--sharding", choices=["row_wise", "column_wise", "table_wise", "data_parallel", "planner"],
                   default="row_wise",
                   help="every table's placement over the replicas (row_wise: TOKEN, column_wise: ENCODING), or "
                        "each table's by the planner (EmbeddingShardingPlanner)")
    p.add_argument("--emb-cache-kib", type=float, default=None, metavar="KIB",
                   help="keep each table whose weights per replica exceed KIB KiB on local disk (--emb-dir) behind "
                        "a cache of KIB KiB (DiskStorage, docs/offload.md); default: all in memory")
    p.add_argument("--emb-dir", type=Path, default=None,
                   help="directory of --emb-cache-kib's partition files (default: the system's temporary directory)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    p.add_argument("--log-every", type=int, default=50,
                   help="print the log loss and AUC of the last N steps' predictions every N steps")
    p.add_argument("--checkpoint-dir", type=Path, default=None,
                   help="save checkpoints under this directory (one path every replica sees)")
    p.add_argument("--checkpoint-every", type=int, default=None,
                   help="save a checkpoint every N steps (default: at the end only)")
    p.add_argument("--checkpoint-keep", type=int, default=2, help="keep the newest K checkpoints")
    p.add_argument("--checkpoint-async", action="store_true",
                   help="save in the background (training continues while the files are written)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --checkpoint-dir, if any")
    run_log.add_log_dir_argument(p)
    args = p.parse_args(argv)
    if (args.resume or args.checkpoint_every is not None) and args.checkpoint_dir is None:
        p.error("--resume and --checkpoint-every need --checkpoint-dir")
    if any(v is not None and v < 1 for v in (args.checkpoint_every, args.checkpoint_keep, args.batch_size,
                                             args.log_every, args.num_embeddings, args.embedding_dim)):
        p.error("--checkpoint-every, --checkpoint-keep, --batch-size, --log-every, --num-embeddings and "
                "--embedding-dim must be >= 1")
    if (args.steps is not None and args.steps < 0) or args.epochs < 0:
        p.error("--steps and --epochs must be >= 0")
    if args.num_embeddings_per_feature is not None and len(args.num_embeddings_per_feature) != criteo.CAT_FEATURES:
        p.error(f"--num-embeddings-per-feature: expected {criteo.CAT_FEATURES} sizes, "
                f"got {len(args.num_embeddings_per_feature)}")
    if args.dense_arch_layer_sizes[-1] != args.embedding_dim:
        p.error(f"--dense-arch-layer-sizes must end with --embedding-dim {args.embedding_dim}")
    if args.emb_cache_kib is not None and args.emb_cache_kib <= 0:
        p.error("--emb-cache-kib must be > 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    data = args.data if args.data is not None else [DEFAULT_DATA]
    sizes = args.num_embeddings_per_feature or [args.num_embeddings] * criteo.CAT_FEATURES
    run_log.starting(__file__, f"starting MPI, then reading {', '.join(map(str, data))} and making the "
                               f"{criteo.CAT_FEATURES} tables")
    pl.init()

    # Before any collective: on a feed process this call serves its replica and never returns.
    feed = pl.infeed(criteo.make_dataset(data, batch_size=args.batch_size, num_embeddings=sizes, epochs=args.epochs),
                     prefetch_depth=3)
    rank, replicas = pl.replica_id(), pl.num_replicas()
    run = run_log.RunLog(rank == 0, bar=run_log.stdout_is_terminal(), log_dir=args.log_dir)
    log = run.say

    if args.data is None:
        ensure_data(DEFAULT_DATA, log)

    # Every replica builds the same model (seeded); DistributedDataParallel broadcasts replica 0's.
    torch.manual_seed(args.seed)
    model = DLRM(make_tables(sizes, args.embedding_dim, args), dense_in_features=criteo.INT_FEATURES,
                 dense_arch_layer_sizes=args.dense_arch_layer_sizes, over_arch_layer_sizes=args.over_arch_layer_sizes)
    ddp = pt.DistributedDataParallel(model)
    if args.sharding == "planner":
        log(str(model.sparse_arch.embedding_bag_collection.plan))
    optimizer = (torch.optim.Adagrad(ddp.parameters(), lr=args.lr) if args.optimizer == "adagrad"
                 else torch.optim.SGD(ddp.parameters(), lr=args.lr))

    # Everything a resumed run needs to continue exactly (docs/checkpoint.md, docs/torch.md).
    state = {"step": 0, "model": ddp, "optimizer": optimizer, "feed": feed}
    checkpoints = run_log.Checkpoints(run, args.checkpoint_dir, args.checkpoint_keep, args.checkpoint_async)
    committed = checkpoints.committed  # waits for a background save, then says it is saved
    first = checkpoints.resume(state) if args.resume else 0

    def save(step: int) -> None:
        state["step"] = step
        checkpoints.save(state, step)

    dense_params = sum(p.numel() for p in ddp.parameters())
    log(f"DLRM: {criteo.CAT_FEATURES} tables of {sizes[0] if len(set(sizes)) == 1 else 'up to ' + str(max(sizes))} "
        f"x {args.embedding_dim} ({args.sharding}), dense arch {args.dense_arch_layer_sizes}, "
        f"over arch {args.over_arch_layer_sizes} ({dense_params} dense parameters), {args.optimizer} "
        f"(lr {args.lr:g}, tables {args.emb_lr:g}); {replicas} replica(s) x batch {args.batch_size}; "
        f"data {', '.join(map(str, data))}")

    total = args.steps
    if rank == 0:  # the bar's total and the ETA: the steps the data hold, when they are cheap to count
        left = steps_in_data(data, args.batch_size, replicas, args.epochs, feed.position)
        if left is not None:
            total = first + left if total is None else min(total, first + left)
    run.start(first if total is None else min(first, total), total)
    predictions, labels = [], []
    start = time.perf_counter()
    done = first  # steps done
    steps = range(first, args.steps) if args.steps is not None else itertools.count(first)
    for step in steps:
        pl.timeline.step(step)
        with pl.timeline.span("data"):
            batch = next(feed, None)
        if batch is None:  # the data ended (on every replica at the same step)
            break
        label = torch.from_numpy(batch["label"])
        with pl.timeline.span("model"):  # forward, backward (the tables' update inside) and the optimizer
            logits = ddp(torch.from_numpy(batch["dense"]), sparse_features(batch["sparse"])).squeeze(1)
            loss = F.binary_cross_entropy_with_logits(logits, label)
            optimizer.zero_grad()
            loss.backward()  # the tables' updates and the dense all-reduce
            optimizer.step()
        predictions.append(torch.sigmoid(logits.detach()).numpy())  # made before this step's update
        labels.append(batch["label"])
        done = step + 1
        if step == 0 or done % args.log_every == 0 or done == args.steps:
            metrics = window_metrics(predictions, labels)
            if metrics is not None:
                run.loss(step, metrics[0], {"AUC": metrics[1]})
            predictions, labels = [], []
        run.advance()
        if args.checkpoint_dir is not None and pl.should_checkpoint():
            # an elastic job's launcher or the scheduler asks us to stop: every replica stops at this step
            save(done)
            committed()
            run.close_bar()
            log(f"stopping at step {done} for a resize or a requeue (checkpoint saved)")
            return 0
        if args.checkpoint_every and done % args.checkpoint_every == 0:
            committed()  # the previous background save, if any
            save(done)
    trained = done - first
    if labels:  # the window the data ended in
        metrics = window_metrics(predictions, labels)
        if metrics is not None:
            run.loss(done - 1, metrics[0], {"AUC": metrics[1]})
    if args.checkpoint_dir is not None:
        if trained > 0 and (not args.checkpoint_every or done % args.checkpoint_every):
            save(done)
        committed()  # a background save, if any, is committed before we exit
    elapsed = time.perf_counter() - start
    run.close_bar()
    collection = model.sparse_arch.embedding_bag_collection
    disks = [stack.shard.disk.stats for stack in collection.core.stacks if stack.shard.disk is not None]
    if disks and trained > 0:  # the disk tables' stacks (tables of one kind share a stack, its file and cache)
        hits, misses = sum(d["hits"] for d in disks), sum(d["misses"] for d in disks)
        on_disk = sum(t.storage_stats is not None for t in collection.tables.values())
        log(f"{on_disk} table(s) on disk (replica 0): hit rate {hits / max(hits + misses, 1):.3f}, "
            f"{sum(d['rows_read'] for d in disks)} rows read, {sum(d['rows_written'] for d in disks)} written")
    if trained > 0:
        run.finish(f"trained {trained} steps in {elapsed:.1f} s ({1000 * elapsed / trained:.1f} ms/step, "
                   f"{trained * args.batch_size * replicas / elapsed:.0f} samples/s) on {replicas} replica(s)",
                   title=f"examples/dlrm.py: {replicas} replica(s), {args.sharding} (log loss)")
    else:
        run.finish(f"nothing to train: the run was at step {first}" + (f" of {args.steps}" if args.steps else "")
                   + " (or the data had no batch left)", title="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
