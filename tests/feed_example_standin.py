"""A small stand-in for examples/shakespeare.py reading its data through the infeed,
shaped as the example is (see docs/infeed.md, "The Shakespeare example"): the feed is
created right after init(), before any replica collective, and its make_dataset
(a copy of the example's: endless, chunk-level ``ds.shard``, per-shard RNG) reads the
text only when the session starts. A bigram softmax model trained with cross-replica
momentum SGD; replica 0 prints ``Step N, loss = X``.
"""

import argparse
from pathlib import Path

import numpy as np

import popdist_lite


def make_dataset(shard_index, num_shards, *, text_ids, seq_len, batch_size, seed):
    chunk = seq_len + 1
    n_chunks = len(text_ids) // chunk
    chunks = text_ids[: n_chunks * chunk].reshape(n_chunks, chunk)[shard_index::num_shards]
    chunks = np.ascontiguousarray(chunks, dtype=np.int32)

    def batches():
        rng = np.random.default_rng([seed, shard_index, num_shards])
        pending = np.empty(0, dtype=np.int64)
        while True:
            while len(pending) < batch_size:
                pending = np.concatenate([pending, rng.permutation(len(chunks))])
            take, pending = pending[:batch_size], pending[batch_size:]
            yield {"ids": chunks[take]}

    return batches()


def encode_text(text):
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    return vocab, np.array([index[c] for c in text], dtype=np.int32)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    popdist_lite.init()

    def load_batches(shard_index, num_shards):  # on a feeder, or the replica's thread
        _, text_ids = encode_text(args.data.read_text())
        return make_dataset(shard_index, num_shards, text_ids=text_ids, seq_len=args.seq_len,
                            batch_size=args.batch_size, seed=args.seed)

    dataset = popdist_lite.infeed(load_batches)  # a feeder serves from here and exits

    vocab, _ = encode_text(args.data.read_text())
    v = len(vocab)
    params = {"w": np.random.default_rng(args.seed).normal(0, 0.1, (v, v))}
    popdist_lite.broadcast_parameters(params, root=0)
    optimizer = popdist_lite.CrossReplicaOptimizer(popdist_lite.MomentumSGD(0.5, momentum=0.9))
    for step in range(args.steps):
        ids = next(dataset)["ids"]
        x, y = ids[:, :-1].ravel(), ids[:, 1:].ravel()
        logits = params["w"][x]
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        loss = -np.mean(np.log(p[np.arange(len(y)), y]))
        d = p
        d[np.arange(len(y)), y] -= 1
        grad = np.zeros_like(params["w"])
        np.add.at(grad, x, d / len(y))
        optimizer.step(params, {"w": grad})
        mean = popdist_lite.all_reduce(np.array([loss]), op="mean")[0]
        if popdist_lite.replica_id() == 0:
            print(f"Step {step}, loss = {mean:.6f}", flush=True)


if __name__ == "__main__":
    main()
