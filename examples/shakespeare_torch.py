#!/usr/bin/env python3
"""The Shakespeare char model of examples/shakespeare.py in PyTorch, data-parallel over replicas.

Run it on 2 replicas (one MPI rank each) with::

    poprun-lite --num-replicas 2 python examples/shakespeare_torch.py

or as a single process with ``python examples/shakespeare_torch.py``. It needs the
``[torch]`` extra (docs/torch.md).

The same job as examples/shakespeare.py, written as a PyTorch user would:

* the same data and feed: ``make_dataset`` and ``ensure_data`` of examples/shakespeare.py,
  through ``popdist_lite.infeed`` (a thread or ``--feeders-per-replica`` processes);
* ``popdist_lite.torch.HostEmbedding`` ``[256, 256]``, split over the replicas
  (``--partition-strategy``) and updated by its own optimizer in the backward pass;
* ``torch.nn.GRU(256)`` and ``torch.nn.Linear(256, 256)`` under
  ``popdist_lite.torch.DistributedDataParallel``, trained with ``torch.optim.SGD`` with
  momentum; the loss is ``F.cross_entropy`` over every next character;
* the same initial weights as the numpy example: its ``char_model.init_params`` (Keras's
  initialisers, seeded the same way) mapped into torch's layout, and the same table.

The GRU is the numpy model's: torch's GRU computes the same "reset after" cell, with its
gates packed ``[r | z | n]`` where char_model packs ``[z | r | n]``. char_model has one
recurrent bias, the candidate's (``b_hn``); torch has one for each gate, and the update
and reset gates' recurrent biases only add to their input biases, so here they stay at
zero (their gradient is masked) and both models have the same parameters.

Differences from the numpy example: gradient clipping (``--clip-norm``) clips the dense
gradients after the all-reduce (torch practice: ``clip_grad_norm_`` before
``optimizer.step()``), while the numpy example clips each replica's own gradient, dense and
embedding together, before it; the embedding's gradient is never clipped here, since the
table updates inside backward. ``--precision mixed`` keeps the table in float16 with float32
master weights and the dense layers in float32 (the numpy example also sends float16 dense
gradients). Without clipping, in float32, the two examples compute the same losses (test:
tests/test_torch_example.py).

Checkpoints as shakespeare.py's: ``--checkpoint-dir DIR --checkpoint-every N`` saves the
table and its optimizer state, the GRU and dense weights, the ``torch.optim`` optimizer's
state, the loss scaler, the feed position and the step every N steps (the torch objects
join ``popdist_lite.save_checkpoint`` as they are: docs/torch.md); ``--resume`` continues
from the newest complete checkpoint in DIR at any replica count (the table reshards), with
exactly the losses of an uninterrupted run at the same replica count
(tests/test_torch_example.py). In an elastic job (``poprun-lite --min-replicas``,
docs/elastic.md) it asks ``popdist_lite.should_checkpoint()`` at every step boundary and
stops there for a resize; ``--data-order global`` reads the text in one order at every
replica count, so a resize neither repeats nor skips a sample.

What replica 0 prints, and ``--log-dir``, are shakespeare.py's (run_log.py: a first line
before the framework's import, a progress bar, rates and ETAs, checkpoint lines, the final
loss last, the loss curve); steps, data loading and the model's computation are marked
on the timeline (``popdist_lite.timeline``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import char_model  # noqa: E402
import run_log  # noqa: E402
import shakespeare  # noqa: E402  (the data, the feed, the numpy model's settings)

if __name__ == "__main__" and not {"-h", "--help"} & set(sys.argv[1:]):
    run_log.starting(__file__, "importing PyTorch")  # the first line, before an import of seconds

import popdist_lite as pl  # noqa: E402
import torch  # noqa: E402
import popdist_lite.torch as pt  # noqa: E402

F = torch.nn.functional


class CharModel(torch.nn.Module):
    """GRU(hidden) over the embedded characters, then a dense layer to the outputs."""

    def __init__(self, emb_dim: int, hidden: int, outputs: int):
        super().__init__()
        self.gru = torch.nn.GRU(emb_dim, hidden, batch_first=True)
        self.dense = torch.nn.Linear(hidden, outputs)
        # Only the candidate's recurrent bias is a parameter of the model (see the module doc).
        mask = torch.zeros(3 * hidden)
        mask[2 * hidden:] = 1
        self.gru.bias_hh_l0.register_hook(lambda g: g * mask)

    def forward(self, emb: torch.Tensor, h: torch.Tensor | None = None):
        out, h = self.gru(emb, h)
        return self.dense(out), h

    @torch.no_grad()
    def load_char_model(self, params: dict[str, np.ndarray]) -> None:
        """Copy char_model's parameters (``init_params``'s names, gates ``[z|r|n]``)
        into torch's layout (gates ``[r|z|n]``, kernels transposed)."""
        H = params["gru_recurrent_kernel"].shape[0]

        def rzn(a):  # the last axis [z | r | n] -> [r | z | n]
            return np.concatenate([a[..., H:2 * H], a[..., :H], a[..., 2 * H:]], axis=-1)

        self.gru.weight_ih_l0.copy_(torch.from_numpy(rzn(params["gru_kernel"]).T.copy()))
        self.gru.weight_hh_l0.copy_(torch.from_numpy(rzn(params["gru_recurrent_kernel"]).T.copy()))
        self.gru.bias_ih_l0.copy_(torch.from_numpy(rzn(params["gru_bias"])))
        self.gru.bias_hh_l0.zero_()
        self.gru.bias_hh_l0[2 * H:] = torch.from_numpy(params["gru_recurrent_bias_n"])
        self.dense.weight.copy_(torch.from_numpy(params["dense_kernel"].T.copy()))
        self.dense.bias.copy_(torch.from_numpy(params["dense_bias"]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=shakespeare.DEFAULT_STEPS, help="training steps")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per replica per step")
    p.add_argument("--seq-len", type=int, default=100, help="characters per sequence")
    p.add_argument("--lr", type=float, default=shakespeare.DEFAULT_LR, help="dense learning rate")
    p.add_argument("--momentum", type=float, default=shakespeare.DEFAULT_MOMENTUM, help="dense momentum")
    p.add_argument("--emb-optimizer", choices=["sgd", "adam"], default="sgd",
                   help="host embedding optimizer: SGD or Adam on touched rows")
    p.add_argument("--emb-lr", type=float, default=None,
                   help=f"host embedding learning rate (default: SGD {shakespeare.DEFAULT_EMB_LR}, "
                        f"Adam {shakespeare.DEFAULT_EMB_ADAM_LR})")
    p.add_argument("--clip-norm", type=float, default=shakespeare.DEFAULT_CLIP_NORM,
                   help="clip the all-reduced dense gradients to this global norm; 0 = off")
    p.add_argument("--data", type=Path, default=None,
                   help=f"text file (default: {shakespeare.DEFAULT_DATA.relative_to(shakespeare.ROOT)}, "
                        f"fetched if missing)")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--partition-strategy", choices=["TOKEN", "ENCODING"], default="TOKEN",
                   help="how the embedding table is split across replicas")
    p.add_argument("--log-every", type=int, default=None,
                   help="print the loss every N steps, averaged over those steps and the replicas "
                        "(default: steps/30, at least 1)")
    p.add_argument("--precision", choices=["fp32", "mixed"], default="fp32",
                   help="mixed: float16 lookups and embedding gradients with float32 master weights")
    p.add_argument("--loss-scaling", choices=["static", "dynamic"], default=None,
                   help="scale the loss (default: off; static 2^8, dynamic from 2^12)")
    p.add_argument("--stochastic-rounding", action="store_true",
                   help="round the float16 table's updates stochastically")
    p.add_argument("--sample-chars", type=int, default=400, help="characters to generate at the end (0: none)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    shakespeare.add_checkpoint_args(p)
    run_log.add_log_dir_argument(p)
    args = p.parse_args(argv)
    if args.emb_lr is None:
        args.emb_lr = shakespeare.DEFAULT_EMB_ADAM_LR if args.emb_optimizer == "adam" else shakespeare.DEFAULT_EMB_LR
    if args.log_every is None:
        args.log_every = max(1, args.steps // 30)
    if args.steps < 0 or args.log_every < 1 or args.seq_len < 1:
        p.error("--steps must be >= 0, --log-every and --seq-len >= 1")
    shakespeare.check_checkpoint_args(p, args)
    return args


def generate(model: CharModel, table: torch.Tensor, prompt: list[int], n: int, rng: np.random.Generator,
             temperature: float, num_valid: int) -> list[int]:
    """Sample ``n`` characters after ``prompt``, carrying the GRU state one character at
    a time (``temperature <= 0``: greedy)."""
    out, h = [], None
    with torch.no_grad():
        logits, h = model(table[prompt][None], h)
        for _ in range(n):
            last = logits[0, -1, :num_valid].double().numpy()
            if temperature <= 0:
                nxt = int(np.argmax(last))
            else:
                p = np.exp((last - last.max()) / temperature)
                nxt = int(rng.choice(num_valid, p=p / p.sum()))
            out.append(nxt)
            logits, h = model(table[[nxt]][None], h)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    data = args.data if args.data is not None else shakespeare.DEFAULT_DATA
    run_log.starting(__file__, f"starting MPI, then reading {data} and making the {shakespeare.TABLE_SHAPE[0]} x "
                               f"{shakespeare.TABLE_SHAPE[1]} {args.partition_strategy} embedding table")
    pl.init()

    # Before any collective: on a feeder this call serves its replica and never returns.
    dataset = pl.infeed(shakespeare.batch_loader(data, seq_len=args.seq_len, batch_size=args.batch_size,
                                                 seed=args.seed, data_order=args.data_order), prefetch_depth=3)
    rank, replicas = pl.replica_id(), pl.num_replicas()

    run = run_log.RunLog(rank == 0, bar=shakespeare.stdout_is_terminal(), log_dir=args.log_dir)
    log = run.say

    shakespeare.ensure_data(data, is_default=args.data is None)
    text = data.read_bytes().decode("utf-8")
    vocab, text_ids = shakespeare.encode_text(text)
    table_rows, emb_dim = shakespeare.TABLE_SHAPE
    if len(vocab) > table_rows:
        raise SystemExit(f"shakespeare_torch.py: {data} has {len(vocab)} distinct characters; the table has "
                         f"{table_rows} rows")

    # The numpy example's initial weights: each replica draws its own, DDP broadcasts replica 0's.
    model = CharModel(emb_dim, shakespeare.HIDDEN, shakespeare.OUTPUTS)
    model.load_char_model(char_model.init_params(np.random.default_rng([args.seed, rank]),
                                                 vocab=shakespeare.OUTPUTS, emb_dim=emb_dim,
                                                 hidden=shakespeare.HIDDEN, seq_len=args.seq_len))
    ddp = pt.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
    scaler = {"static": lambda: pt.GradScaler(loss_scaler=pl.StaticLossScaler(2.0 ** 8)),
              "dynamic": lambda: pt.GradScaler(init_scale=2.0 ** 12, growth_interval=200),
              None: lambda: None}[args.loss_scaling]()
    mixed = args.precision == "mixed"
    embedding = pt.HostEmbedding(
        table_rows, emb_dim, name="char_embedding", partition_strategy=args.partition_strategy,
        optimizer_spec=(pl.HostEmbeddingAdamOptimizerSpec(args.emb_lr) if args.emb_optimizer == "adam"
                        else pl.HostEmbeddingOptimizerSpec(args.emb_lr)),
        dtype=torch.float16 if mixed else torch.float32, master_weights=torch.float32 if mixed else None,
        stochastic_rounding="ON" if args.stochastic_rounding else "OFF", seed=args.seed, grad_scaler=scaler)

    # Everything a resumed run needs to continue exactly (docs/checkpoint.md, docs/torch.md).
    state = {"step": 0, "model": ddp, "optimizer": optimizer, "embedding": embedding, "feed": dataset,
             **({"scaler": scaler} if scaler is not None else {})}
    checkpoints = run_log.Checkpoints(run, args.checkpoint_dir, args.checkpoint_keep, args.checkpoint_async)
    committed = checkpoints.committed  # waits for a background save, then says it is saved
    first = checkpoints.resume(state) if args.resume else 0

    def save(step: int) -> None:
        state["step"] = step
        checkpoints.save(state, step)

    log(f"{len(text_ids)} characters, vocabulary of {len(vocab)}, {replicas} replica(s) x batch "
        f"{args.batch_size}, sequences of {args.seq_len}, {args.partition_strategy} embedding (torch), "
        f"lr {args.lr:g}, momentum {args.momentum:g}, embedding lr {args.emb_lr:g}, clip norm {args.clip_norm:g}")
    run.start(min(first, args.steps), args.steps)
    window = []
    start = time.perf_counter()
    for step in range(first, args.steps):
        pl.timeline.step(step)
        with pl.timeline.span("data"):
            ids = torch.from_numpy(next(dataset)["ids"]).long()
        inputs, labels = ids[:, :-1], ids[:, 1:]
        with pl.timeline.span("model"):  # forward, backward (the table's update inside) and the optimizer
            logits, _ = ddp(embedding(inputs).float())
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            optimizer.zero_grad()
            if scaler is None:
                loss.backward()  # the table's update and the dense all-reduce
                if args.clip_norm > 0:
                    torch.nn.utils.clip_grad_norm_(ddp.parameters(), args.clip_norm)
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                if args.clip_norm > 0:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(ddp.parameters(), args.clip_norm)
                scaler.step(optimizer)
                scaler.update()
        window.append(float(loss))
        if step == 0 or (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            mean = pl.all_reduce(np.array([np.mean(window)], np.float32), op="mean")[0]
            window.clear()
            if not np.isfinite(mean):
                raise FloatingPointError(f"loss became {float(mean)} at step {step}; try a smaller --lr / --emb-lr")
            run.loss(step, float(mean))
        run.advance()
        if args.checkpoint_dir is not None and shakespeare.resize_asked(args, step + 1, first):
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

    table = embedding.get_embedding_tensor().float()  # collective: every replica takes part
    if rank == 0 and args.sample_chars > 0:
        char2idx = {c: i for i, c in enumerate(vocab)}
        prompt = next((p for p in ("ROMEO.\n", "KING.\n", "\n") if all(c in char2idx for c in p)), text[:8])
        ids = generate(model, table, [char2idx[c] for c in prompt], args.sample_chars,
                       np.random.default_rng(args.seed), args.temperature, len(vocab))
        log("\n--- sample ---\n" + prompt + "".join(vocab[i] for i in ids) + "\n--------------")
    if trained > 0:
        run.finish(f"trained {trained} steps in {elapsed:.1f} s ({1000 * elapsed / trained:.1f} ms/step) on "
                   f"{replicas} replica(s), precision {args.precision}"
                   + (f", final loss scale {scaler.get_scale():g}, {scaler.loss_scaler.skipped_steps} step(s) "
                      f"skipped" if scaler else ""),
                   title=f"examples/shakespeare_torch.py: {replicas} replica(s), {args.partition_strategy}")
    else:
        run.finish(f"nothing to train: the run was at step {first} of {args.steps}", title="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
