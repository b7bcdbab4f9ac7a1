#!/usr/bin/env python3
"""The TF-IPU host-embedding guide's Shakespeare char model in JAX: a jitted GRU + Dense
(Flax) over a popdist-lite host embedding, data-parallel over replicas.

Run it on 2 replicas (one MPI rank each) with::

    poprun-lite --num-replicas 2 python examples/shakespeare_jax.py

It is examples/shakespeare.py (the numpy job) in JAX: the same text, vocabulary,
sharded feed (``make_dataset`` read through ``popdist_lite.infeed``, imported from
shakespeare.py), host embedding ``[256, 256]`` and its optimizer, GRU(256) "reset
after" with packed ``[z | r | n]`` kernels, dense layer, loss, clipping, optimizer and
logging. The dense weights start as char_model.py's (``char_model.init_params`` of
replica 0, mapped onto the Flax parameters and broadcast), so from the same seed both
jobs print the same losses within float32 rounding (tests/test_shakespeare_jax.py).

Two paths (``--path``):

* ``split`` (default): ``popdist_lite.jax.TrainStep``: the host lookup, one jitted
  forward and backward pass giving the gradients of the parameters and of the looked-up
  activations (clipped together by their global norm, as shakespeare.py), the host
  all-reduce of the dense gradients, a jitted Optax momentum-SGD update and the host
  embedding update; the next batch's lookup runs while the Optax update computes.
* ``in-jit``: one jitted function per step: ``EmbeddingCollection.lookup_in_jit`` (host
  callbacks: the lookup in the forward pass, the embedding update in the backward pass)
  and an Optax chain starting with ``popdist_lite.jax.cross_replica_mean()``. Slower
  (docs/jax.md). The embedding update happens inside the backward pass, before the
  dense gradients exist, so the joint clipping of the split path cannot apply: this
  path needs ``--clip-norm 0``.

Checkpoints as shakespeare.py's: ``--checkpoint-dir DIR --checkpoint-every N`` saves
the table and its optimizer state, the dense parameters and Optax state (a
``popdist_lite.jax.PytreeState``), the feed position and the step every N steps;
``--resume`` continues from the newest complete checkpoint in DIR (at any replica
count; the tables reshard), with exactly the losses of an uninterrupted run at the same
replica count (tests/test_shakespeare_jax.py). A checkpoint loads into the path that
saved it (the in-jit path's parameters also hold the handle). In an elastic job
(``poprun-lite --min-replicas``, docs/elastic.md) it asks
``popdist_lite.should_checkpoint()`` at every step boundary and stops there for a
resize; ``--data-order global`` reads the text in one order at every replica count.

Options of shakespeare.py that this job does not have: ``--precision``,
``--loss-scaling`` and ``--stochastic-rounding`` (float32 only).

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

import shakespeare  # noqa: E402  (the numpy job: data, feed, defaults; it imports popdist_lite)
import char_model  # noqa: E402
import run_log  # noqa: E402

if __name__ == "__main__" and not {"-h", "--help"} & set(sys.argv[1:]):
    run_log.starting(__file__, "importing JAX and Flax")  # the first line, before an import of seconds

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402

import popdist_lite  # noqa: E402
import popdist_lite.jax as plj  # noqa: E402

FEATURE = "chars"


# --------------------------------------------------------------------------------------
# the model (Flax): char_model.py's GRU + dense, with its parameter layout
# --------------------------------------------------------------------------------------
class PackedGRU(nn.Module):
    """char_model.py's GRU ("reset after", gate order ``[z | r | n]``)::

        z = sigmoid(x Wz + bz + h Uz);  r = sigmoid(x Wr + br + h Ur)
        n = tanh(x Wn + bn + r * (h Un + bhn));  h' = (1 - z) * n + z * h

    the input projection of every step as one matmul, then ``lax.scan`` over time with
    one ``(B, H) @ (H, 3H)`` matmul per step. ``emb (B, T, E) -> outputs (T, B, H)``."""

    hidden: int

    @nn.compact
    def __call__(self, emb):
        e, h = emb.shape[-1], self.hidden
        kernel = self.param("kernel", nn.initializers.glorot_uniform(), (e, 3 * h))
        recurrent = self.param("recurrent_kernel", nn.initializers.orthogonal(), (h, 3 * h))
        bias = self.param("bias", nn.initializers.zeros, (3 * h,))
        bias_n = self.param("recurrent_bias_n", nn.initializers.zeros, (h,))
        xp = jnp.einsum("bte,eg->tbg", emb, kernel) + bias

        def step(state, x):
            hp = state @ recurrent
            zr = jax.nn.sigmoid(x[:, :2 * h] + hp[:, :2 * h])
            z, r = zr[:, :h], zr[:, h:]
            n = jnp.tanh(x[:, 2 * h:] + r * (hp[:, 2 * h:] + bias_n))
            state = n + z * (state - n)
            return state, state

        _, outputs = jax.lax.scan(step, jnp.zeros((emb.shape[0], h), emb.dtype), xp)
        return outputs


class CharModel(nn.Module):
    """Logits: ``(T*B, V)`` rows in ``(t, b)`` order (``"next"``) or ``(B, V)`` from the
    flattened outputs of all T steps (``"guide"``), as char_model.py."""

    hidden: int
    outputs: int
    mode: str

    @nn.compact
    def __call__(self, emb):
        outs = PackedGRU(self.hidden, name="gru")(emb)  # (T, B, H)
        t, b, h = outs.shape
        x = outs.reshape(t * b, h) if self.mode == "next" else outs.transpose(1, 0, 2).reshape(b, t * h)
        return nn.Dense(self.outputs, name="dense")(x)


def from_char_model(p: dict) -> dict:
    """char_model.init_params's dict as this model's Flax parameters."""
    return {"params": {"gru": {"kernel": p["gru_kernel"], "recurrent_kernel": p["gru_recurrent_kernel"],
                               "bias": p["gru_bias"], "recurrent_bias_n": p["gru_recurrent_bias_n"]},
                       "dense": {"kernel": p["dense_kernel"], "bias": p["dense_bias"]}}}


def to_char_model(params) -> dict:
    """The inverse of :func:`from_char_model` (numpy arrays), for char_model.generate."""
    gru, dense = params["params"]["gru"], params["params"]["dense"]
    return {k: np.asarray(v) for k, v in {
        "gru_kernel": gru["kernel"], "gru_recurrent_kernel": gru["recurrent_kernel"], "gru_bias": gru["bias"],
        "gru_recurrent_bias_n": gru["recurrent_bias_n"], "dense_kernel": dense["kernel"],
        "dense_bias": dense["bias"]}.items()}


def cross_entropy(model: CharModel, params, emb, labels):
    """Mean cross-entropy over every prediction (char_model.loss_and_grads's loss)."""
    logits = model.apply(params, emb)
    lab = labels.T.reshape(-1) if model.mode == "next" else labels.reshape(-1)  # (t, b) order
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, lab))


def clip_jointly(max_norm: float):
    """``grad_transform`` of TrainStep: scale the dense gradients and the activation
    gradients together so their joint L2 norm is at most ``max_norm`` (shakespeare.py's
    ``clip_by_global_norm`` on the dense gradients and ``d_emb``)."""

    def clip(g_params, g_acts):
        norm = optax.global_norm((g_params, g_acts))
        scale = jnp.where(norm > max_norm, max_norm / norm, 1.0)
        return jax.tree.map(lambda g: g * scale.astype(g.dtype), (g_params, g_acts))

    return clip


# --------------------------------------------------------------------------------------
# options
# --------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=shakespeare._HelpFormatter,
        epilog="examples:\n"
               "  poprun-lite --num-replicas 2 python examples/shakespeare_jax.py\n"
               "  poprun-lite --num-replicas 2 python examples/shakespeare_jax.py --path in-jit --clip-norm 0\n"
               "  python examples/shakespeare_jax.py --data my.txt --steps 50")
    p.add_argument("--steps", type=int, default=shakespeare.DEFAULT_STEPS, help="training steps")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per replica per step")
    p.add_argument("--seq-len", type=int, default=100,
                   help="characters per sequence (with --guide-config: including the label)")
    p.add_argument("--lr", type=float, default=None,
                   help=f"dense learning rate (default: {shakespeare.DEFAULT_LR}; {shakespeare.GUIDE_LR} with "
                        f"--guide-config)")
    p.add_argument("--momentum", type=float, default=None,
                   help=f"dense momentum (default: {shakespeare.DEFAULT_MOMENTUM}; {shakespeare.GUIDE_MOMENTUM} "
                        f"with --guide-config)")
    p.add_argument("--emb-lr", type=float, default=None,
                   help=f"host embedding learning rate (default: SGD {shakespeare.DEFAULT_EMB_LR}, Adam "
                        f"{shakespeare.DEFAULT_EMB_ADAM_LR}; --lr with --guide-config)")
    p.add_argument("--emb-optimizer", choices=["sgd", "adam"], default="sgd",
                   help="host embedding optimizer: SGD (the guide's) or Adam on touched rows")
    p.add_argument("--clip-norm", type=float, default=None,
                   help=f"clip each replica's gradient (dense and embedding together) to this global norm; "
                        f"0 = off (default: {shakespeare.DEFAULT_CLIP_NORM}; off with --guide-config)")
    p.add_argument("--data", type=Path, default=None,
                   help=f"text file (default: {shakespeare.DEFAULT_DATA.relative_to(shakespeare.ROOT)}, "
                        f"fetched if missing)")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--partition-strategy", choices=["TOKEN", "ENCODING"], default="TOKEN",
                   help="how the embedding table is split across replicas")
    p.add_argument("--guide-config", action="store_true",
                   help="the guide example's set-up: label = last character, lr 1e-4, momentum 0.99")
    p.add_argument("--path", choices=["split", "in-jit"], default="split",
                   help="split: host lookup and update around the jitted step (fast); in-jit: one jitted "
                        "function with host callbacks")
    p.add_argument("--log-every", type=int, default=None,
                   help="print the loss every N steps, averaged over those steps and over the replicas "
                        "(default: steps/30, at least 1)")
    p.add_argument("--sample-chars", type=int, default=400,
                   help="characters of text to generate at the end (0: none)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    shakespeare.add_checkpoint_args(p)
    run_log.add_log_dir_argument(p)
    args = p.parse_args(argv)
    if args.lr is None:
        args.lr = shakespeare.GUIDE_LR if args.guide_config else shakespeare.DEFAULT_LR
    if args.momentum is None:
        args.momentum = shakespeare.GUIDE_MOMENTUM if args.guide_config else shakespeare.DEFAULT_MOMENTUM
    if args.emb_lr is None:
        args.emb_lr = args.lr if args.guide_config else \
            shakespeare.DEFAULT_EMB_ADAM_LR if args.emb_optimizer == "adam" else shakespeare.DEFAULT_EMB_LR
    if args.clip_norm is None:
        args.clip_norm = 0.0 if args.guide_config else shakespeare.DEFAULT_CLIP_NORM
    if args.log_every is None:
        args.log_every = max(1, args.steps // 30)
    if args.steps < 0 or args.log_every < 1:
        p.error("--steps must be >= 0 and --log-every >= 1")
    shakespeare.check_checkpoint_args(p, args)
    if args.seq_len < (2 if args.guide_config else 1):
        p.error(f"--seq-len must be >= {2 if args.guide_config else 1}")
    if args.path == "in-jit" and args.clip_norm > 0:
        p.error("--path in-jit needs --clip-norm 0: its embedding update runs inside the backward pass, before "
                "the gradients that the joint clipping scales are known")
    return args


# --------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------
class Job:
    """The model, embedding and optimizer of one run, and its step function (``--path``)."""

    def __init__(self, args, model: CharModel, params, embeddings: plj.EmbeddingCollection):
        self.model, self.embeddings, self.path = model, embeddings, args.path
        replicas = popdist_lite.num_replicas()

        def loss_fn(params, acts, labels):
            return cross_entropy(model, params, acts[FEATURE], labels)

        if args.path == "split":
            self.train = plj.TrainStep(embeddings, loss_fn, optax.sgd(args.lr, momentum=args.momentum),
                                       grad_transform=clip_jointly(args.clip_norm) if args.clip_norm > 0 else None)
            self.params, self.opt_state = self.train.init(params)
            return
        optimizer = optax.chain(plj.cross_replica_mean(), optax.sgd(args.lr, momentum=args.momentum))

        def step(state, ids, labels):
            params, opt_state = state

            def loss(params):
                acts = embeddings.lookup_in_jit(params["handle"], {FEATURE: ids}, loss_scale=replicas)
                return loss_fn(params["model"], acts, labels)

            value, grads = jax.value_and_grad(loss)(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), value

        params = {"model": plj.broadcast_parameters(params), "handle": embeddings.handle()}
        # committed to the device as the jitted step's outputs are, or the second step
        # would compile the step again for the new placement
        self.params, self.opt_state = jax.device_put((params, optimizer.init(params)), jax.devices()[0])
        self._step = jax.jit(step)

    def step(self, features, labels, next_features=None):
        """One training step (``features``: ``{FEATURE: ids}``); returns this replica's
        loss (a ``jax.Array``, not waited for)."""
        if self.path == "split":
            self.params, self.opt_state, loss = self.train(self.params, self.opt_state, features, labels,
                                                           next_features=next_features)
            return loss
        (self.params, self.opt_state), loss = self._step((self.params, self.opt_state), features[FEATURE], labels)
        return loss

    def model_params(self):
        return self.params if self.path == "split" else self.params["model"]


def main(argv=None) -> int:
    args = parse_args(argv)
    chunk_len = args.seq_len if args.guide_config else args.seq_len + 1
    data = args.data if args.data is not None else shakespeare.DEFAULT_DATA
    run_log.starting(__file__, f"starting MPI, then reading {data} and making the {shakespeare.TABLE_SHAPE[0]} x "
                               f"{shakespeare.TABLE_SHAPE[1]} {args.partition_strategy} embedding table")
    popdist_lite.init()

    # Before any collective: on a feeder this call serves its replica and never returns.
    dataset = popdist_lite.infeed(shakespeare.batch_loader(data, seq_len=chunk_len - 1, batch_size=args.batch_size,
                                                           seed=args.seed, data_order=args.data_order),
                                  prefetch_depth=3)
    rank, replicas = popdist_lite.replica_id(), popdist_lite.num_replicas()
    lead = rank == 0

    run = run_log.RunLog(lead, bar=shakespeare.stdout_is_terminal(), log_dir=args.log_dir)
    log = run.say

    shakespeare.ensure_data(data, is_default=args.data is None)
    text = data.read_bytes().decode("utf-8")
    vocab, text_ids = shakespeare.encode_text(text)
    if len(vocab) > shakespeare.TABLE_SHAPE[0]:
        raise SystemExit(f"shakespeare_jax.py: {data} has {len(vocab)} distinct characters; the embedding table "
                         f"has {shakespeare.TABLE_SHAPE[0]} rows")
    mode = "guide" if args.guide_config else "next"
    model_len = chunk_len - 1
    model = CharModel(hidden=shakespeare.HIDDEN, outputs=shakespeare.OUTPUTS, mode=mode)
    # char_model.py's initial weights (replica 0's are broadcast by TrainStep.init /
    # broadcast_parameters), so that both jobs start from the same weights.
    init = char_model.init_params(np.random.default_rng([args.seed, rank]), vocab=shakespeare.OUTPUTS,
                                  emb_dim=shakespeare.TABLE_SHAPE[1], hidden=shakespeare.HIDDEN, seq_len=model_len,
                                  mode=mode)
    optimizer_spec = (popdist_lite.HostEmbeddingAdamOptimizerSpec(args.emb_lr) if args.emb_optimizer == "adam"
                      else popdist_lite.HostEmbeddingOptimizerSpec(args.emb_lr))
    table = plj.TableSpec("char_embedding", *shakespeare.TABLE_SHAPE, optimizer=optimizer_spec,
                          partition_strategy=args.partition_strategy, seed=args.seed)
    feature = plj.FeatureSpec(FEATURE, table, input_shape=(args.batch_size, model_len),
                              output_shape=(args.batch_size, model_len, shakespeare.TABLE_SHAPE[1]))
    embeddings = plj.EmbeddingCollection([feature])
    job = Job(args, model, from_char_model(init), embeddings)
    # Everything a resumed run needs to continue exactly (docs/checkpoint.md, docs/jax.md).
    dense = plj.PytreeState({"params": job.params, "opt_state": job.opt_state})
    state = {"step": 0, "dense": dense, "embedding": embeddings, "feed": dataset}
    checkpoints = run_log.Checkpoints(run, args.checkpoint_dir, args.checkpoint_keep, args.checkpoint_async)
    committed = checkpoints.committed  # waits for a background save, then says it is saved
    first = checkpoints.resume(state) if args.resume else 0
    job.params, job.opt_state = dense.tree["params"], dense.tree["opt_state"]  # the loaded trees, if resumed

    def saves_after(step: int) -> bool:
        return bool(args.checkpoint_every) and (step + 1) % args.checkpoint_every == 0

    def save(step: int) -> None:
        dense.tree = {"params": job.params, "opt_state": job.opt_state}
        state["step"] = step
        checkpoints.save(state, step)

    log(f"{len(text_ids)} characters, vocabulary of {len(vocab)}, {replicas} replica(s) x batch {args.batch_size}, "
        f"sequences of {model_len}, {args.partition_strategy} embedding, "
        f"{'guide config (last-char label)' if args.guide_config else 'next-char labels'}, lr {args.lr:g}, "
        f"momentum {args.momentum:g}, embedding lr {args.emb_lr:g}, clip norm {args.clip_norm:g}, "
        f"JAX {args.path} path")

    run.start(min(first, args.steps), args.steps)

    def split(batch):
        """``({FEATURE: inputs}, labels)``; the dict is the object TrainStep prefetches for."""
        ids = batch["ids"]
        return {FEATURE: ids[:, :-1]}, (ids[:, 1:] if mode == "next" else ids[:, -1])

    def take(step: int):
        """The batch of ``step``, or None past the last step."""
        if step >= args.steps:
            return None
        with popdist_lite.timeline.span("data"):
            return split(next(dataset))

    window = []  # this replica's losses since the last print (jax.Arrays: read when printed)
    start = time.perf_counter()
    upcoming = take(first)
    for step in range(first, args.steps):
        popdist_lite.timeline.step(step)
        # An elastic job's launcher may ask for a resize (docs/elastic.md): asked before the
        # next batch is taken, so that every replica stops after this step with the feed
        # at the batches trained on.
        resize = args.checkpoint_dir is not None and shakespeare.resize_asked(args, step + 1, first)
        # The next batch is taken one step ahead (TrainStep looks it up while this step
        # computes), except before a checkpoint: the feed position saved is then exactly
        # the batches trained on.
        current, upcoming = upcoming, None if resize or saves_after(step) else take(step + 1)
        with popdist_lite.timeline.span("model"):  # the jitted step, the lookups and updates around it
            window.append(job.step(*current, next_features=upcoming and upcoming[0]))
        if step == 0 or (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            local = np.array([np.mean([float(x) for x in window])], dtype=np.float32)
            mean = popdist_lite.all_reduce(local, op="mean")[0]
            window.clear()
            if not np.isfinite(mean):
                raise FloatingPointError(f"loss became {float(mean)} at step {step}; try a smaller --lr / --emb-lr")
            run.loss(step, float(mean))
        run.advance()
        if resize:
            save(step + 1)
            committed()
            run.close_bar()
            log(f"stopping at step {step + 1} for a resize (checkpoint saved)")
            return 0
        if saves_after(step):
            committed()  # the previous background save, if any
            save(step + 1)
            upcoming = take(step + 1)
    if args.checkpoint_dir is not None:
        if first < args.steps and (not args.checkpoint_every or args.steps % args.checkpoint_every):
            save(args.steps)
        committed()  # a background save, if any, is committed before we exit
    elapsed = time.perf_counter() - start
    run.close_bar()
    trained = args.steps - first

    full = np.asarray(embeddings.tables[table.name].get_embedding_tensor())  # collective
    if lead and args.sample_chars > 0:
        char2idx = {c: i for i, c in enumerate(vocab)}
        prompt = next((p for p in ("ROMEO.\n", "KING.\n", "\n") if all(c in char2idx for c in p)), text[:model_len])
        ids = char_model.generate(to_char_model(job.model_params()), full, [char2idx[c] for c in prompt],
                                  args.sample_chars, np.random.default_rng(args.seed), temperature=args.temperature,
                                  num_valid=len(vocab))
        log("\n--- sample ---\n" + prompt + "".join(np.array(vocab)[ids]) + "\n--------------")
    if trained > 0:
        run.finish(f"trained {trained} steps in {elapsed:.1f} s ({1000 * elapsed / trained:.1f} ms/step) on "
                   f"{replicas} replica(s), JAX {args.path} path",
                   title=f"examples/shakespeare_jax.py: {replicas} replica(s), {args.partition_strategy}")
    else:
        run.finish(f"nothing to train: the run was at step {first} of {args.steps}", title="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
