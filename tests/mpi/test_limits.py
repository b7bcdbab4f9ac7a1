"""ID limits, dropping, minibatching and bag combiners at any number of replicas.

Every replica builds every replica's inputs from the same generator, so each one knows
the whole step and checks its own result against a numpy reference (and every replica
checks the errors it must raise).
"""

import numpy as np
import pytest

import popdist_lite as pl
from popdist_lite.embedding.id_limits.minibatch_split import NUM_BUCKETS, bucket_of, split_mask

EXCHANGES = ["sparse", "dense"]


def zipf_step(rng, r, t, sizes):
    """Skewed indices per replica, hot IDs scattered over the table (not all on owner 0)."""
    perm = np.random.default_rng(99).permutation(t)
    return [perm[np.minimum(rng.zipf(1.2, size=n) - 1, t - 1)] for n in sizes]


def partition_loads(idx, r):
    """``(senders, owners, 64)`` loads with and without duplicates."""
    ids = np.zeros((r, r, NUM_BUCKETS), dtype=np.int64)
    uniq = np.zeros_like(ids)
    for s, x in enumerate(idx):
        np.add.at(ids[s], (x % r, bucket_of(x)), 1)
        u = np.unique(x)
        np.add.at(uniq[s], (u % r, bucket_of(u)), 1)
    return ids, uniq


def make(name, full, exchange="sparse", lr=0.5, **limits):
    spec = pl.HostEmbeddingOptimizerSpec(lr) if lr else None
    return pl.create_host_embedding(name, shape=list(full.shape), initializer=full, optimizer_spec=spec,
                                    exchange=exchange, **limits)


def sgd_reference(table, idx, grads, lr):
    acc = np.zeros_like(table)
    for i, g in zip(idx, grads):
        np.add.at(acc, i, g)
    return table - lr * acc


@pytest.mark.mpi
@pytest.mark.parametrize("exchange", EXCHANGES)
def test_minibatching_equals_single_pass(comm, rng, exchange):
    r, k, t, e, lr = comm.size, comm.rank, 3000, 8, 0.5
    full = rng.standard_normal((t, e)).astype(np.float32)
    idx = zipf_step(rng, r, t, [400 + 50 * s for s in range(r)])
    ids, uniq = partition_loads(idx, r)
    # Limits that force several minibatches but that no single bucket exceeds.
    max_ids = int(max(ids.max(), ids.sum(axis=2).max() // 3))
    max_unique = int(max(uniq.max(), uniq.sum(axis=2).max() // 5))
    limits = dict(max_ids_per_partition=max_ids, max_unique_ids_per_partition=max_unique, enable_minibatching=True)
    plain, mini = make("plain", full, exchange), make("mini", full, exchange, **limits)
    expect_mask = 0
    for s in range(r):
        expect_mask |= split_mask(ids[s], max_ids) | split_mask(uniq[s], max_unique)
    reference = full.astype(np.float64)
    for step in range(2):
        out = mini.lookup(idx[k])
        np.testing.assert_array_equal(out, plain.lookup(idx[k]))
        np.testing.assert_allclose(out, reference[idx[k]], rtol=1e-4, atol=1e-4)
        got = pl.last_id_stats("mini")["mini/lookup"]
        assert got["num_minibatches"] == bin(expect_mask).count("1") + 1 >= 3
        assert got["split_mask"] == expect_mask
        assert got["max_ids_per_partition"] == ids.sum(axis=2).max()
        assert got["max_unique_ids_per_partition"] == uniq.sum(axis=2).max()
        assert got["dropped_ids"] == 0
        grads = [np.random.default_rng([step, s]).standard_normal((x.size, e)).astype(np.float32) for s, x in enumerate(idx)]
        mini.apply_gradients(idx[k], grads[k])
        plain.apply_gradients(idx[k], grads[k])
        assert pl.last_id_stats("mini")["mini/update"]["num_minibatches"] == got["num_minibatches"]
        np.testing.assert_allclose(mini.local_shard, plain.local_shard, rtol=1e-6, atol=1e-6)
        reference = sgd_reference(reference, idx, grads, lr)
        np.testing.assert_allclose(mini.get_embedding_tensor(), reference, rtol=1e-4, atol=1e-4)  # fp32 sums of hot rows


@pytest.mark.mpi
@pytest.mark.parametrize("exchange", EXCHANGES)
def test_within_limits_is_one_pass(comm, rng, exchange):
    r, k = comm.size, comm.rank
    full = rng.standard_normal((50, 3)).astype(np.float32)
    emb = make("roomy", full, exchange, max_ids_per_partition=64, max_unique_ids_per_partition=64,
               enable_minibatching=True)
    idx = [rng.integers(0, 50, size=40) for _ in range(r)]
    pl.reset_stats()
    np.testing.assert_array_equal(emb.lookup(idx[k]), full[idx[k]])
    s = pl.stats()
    assert s["phases"]["limits.check"]["calls"] == 1 and "limits.split" not in s["phases"]
    assert pl.last_id_stats("roomy")["roomy/lookup"]["num_minibatches"] == 1


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["lookup", "update"])
def test_exceeding_a_limit_raises_on_every_replica(comm, rng, op):
    r, k, t = comm.size, comm.rank, 40
    full = rng.standard_normal((t, 2)).astype(np.float32)
    emb = make("user_table", full, max_ids_per_partition=6)
    bad = r - 1  # only this replica sends too much, all to owner 0
    idx = [np.arange(3) * r for _ in range(r)]
    idx[bad] = np.arange(9) * r
    with pytest.raises(pl.IdLimitError) as err:
        if op == "lookup":
            emb.lookup(idx[k])
        else:
            emb.apply_gradients(idx[k], np.ones((idx[k].size, 2), np.float32))
    msg = str(err.value)
    assert ("Observed max ids per partition: 9 for table: user_table is greater than the set max ids per "
            "partition: 6") in msg
    assert f"sender replica {bad} -> owner replica 0" in msg
    np.testing.assert_array_equal(emb.get_embedding_tensor(), full)  # nothing updated
    np.testing.assert_array_equal(emb.lookup(np.arange(3) * r), full[np.arange(3) * r])  # the runtime still works
    uniq = make("uniq_table", full, max_unique_ids_per_partition=2)
    with pytest.raises(pl.IdLimitError, match="Observed max unique ids per partition: 3 for table: uniq_table"):
        uniq.lookup(np.array([0, 0, r, 2 * r, 0]) if k == 0 else np.zeros(0, np.int64))


def reference_keep(flat, r, max_ids, max_unique):
    """The documented dropping rule, one ID at a time."""
    keep, distinct, used = [], {o: [] for o in range(r)}, {o: 0 for o in range(r)}
    for i in flat.tolist():
        o = i % r
        if i not in distinct[o]:
            distinct[o].append(i)
        ok = (max_unique is None or distinct[o].index(i) < max_unique) and (max_ids is None or used[o] < max_ids)
        used[o] += ok
        keep.append(ok)
    return np.array(keep, dtype=bool)


@pytest.mark.mpi
@pytest.mark.parametrize("exchange", EXCHANGES)
def test_dropping_zeroes_rows_and_ignores_gradients(comm, rng, exchange):
    r, k, t, e, lr = comm.size, comm.rank, 200, 4, 1.0
    full = rng.standard_normal((t, e)).astype(np.float32) + 5  # no row is zero
    emb = make("drop", full, exchange, lr=lr, max_ids_per_partition=12, max_unique_ids_per_partition=5,
               allow_id_dropping=True)
    idx = zipf_step(rng, r, t, [30 + 10 * s for s in range(r)])
    keeps = [reference_keep(x, r, 12, 5) for x in idx]
    assert sum(int((~kp).sum()) for kp in keeps) > 0
    out = emb.lookup(idx[k])
    want = np.where(keeps[k][:, None], full[idx[k]], 0)
    np.testing.assert_array_equal(out, want)
    assert pl.last_id_stats("drop")["drop/lookup"]["dropped_ids"] == int((~keeps[k]).sum())
    grads = [np.random.default_rng(s).standard_normal((x.size, e)).astype(np.float32) for s, x in enumerate(idx)]
    emb.apply_gradients(idx[k], grads[k])
    reference = sgd_reference(full.astype(np.float64), [x[kp] for x, kp in zip(idx, keeps)],
                              [g[kp] for g, kp in zip(grads, keeps)], lr)
    np.testing.assert_allclose(emb.get_embedding_tensor(), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.mpi
def test_one_bucket_over_the_limit(comm, rng):
    """A hot ID repeated more than max_ids: no split helps; error, or dropping per minibatch."""
    r, k, t = comm.size, comm.rank, 100
    full = rng.standard_normal((t, 2)).astype(np.float32) + 5
    idx = np.concatenate([np.full(20, 7), np.arange(30)]) if k == 0 else np.arange(10)
    strict = make("hot", full, max_ids_per_partition=10, enable_minibatching=True)
    with pytest.raises(pl.IdLimitError, match=r"Observed max ids per partition in one hash bucket: \d+ for "
                                              r"table: hot .*sender replica 0 -> owner replica .*cannot split"):
        strict.lookup(idx)
    lenient = make("hot2", full, max_ids_per_partition=10, enable_minibatching=True, allow_id_dropping=True)
    out = lenient.lookup(idx)
    kept = (out != 0).all(axis=1)
    np.testing.assert_array_equal(out[kept], full[idx[kept]])
    stats = pl.last_id_stats("hot2")["hot2/lookup"]
    assert stats["dropped_ids"] == int((~kept).sum()) and (stats["dropped_ids"] > 0) == (k == 0)
    assert stats["num_minibatches"] > 1


def bag_reference(table, values, lengths, weights, combiner):
    out = np.zeros((len(lengths), table.shape[1]))
    per_id_scale = np.zeros(values.size)
    pos = 0
    for b, n in enumerate(lengths):
        ids, w = values[pos:pos + n], weights[pos:pos + n]
        d = {"sum": 1.0, "mean": w.sum(), "sqrtn": np.sqrt((w * w).sum())}[combiner]
        if n:
            out[b] = (w[:, None] * table[ids]).sum(axis=0) / d
            per_id_scale[pos:pos + n] = w / d
        pos += n
    return out, per_id_scale


@pytest.mark.mpi
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("exchange,minibatching", [("sparse", False), ("dense", False), ("sparse", True)])
def test_bags_spanning_replicas(comm, rng, combiner, exchange, minibatching):
    r, k, t, e, lr = comm.size, comm.rank, 60, 3, 0.5
    full = rng.standard_normal((t, e)).astype(np.float64)
    steps = []
    for s in range(r):  # every bag holds IDs of several owners; some bags are empty
        lengths = np.array([4, 0, 1, 3 + s, 2, 0])
        values = rng.integers(0, t, size=lengths.sum())
        values[:4] = np.arange(4) + s  # owners s, s+1, s+2, s+3 (mod r)
        weights = rng.random(values.size) + 0.5
        steps.append((values, lengths, weights))
    ids, uniq = partition_loads([v for v, _, _ in steps], r)
    limits = dict(max_unique_ids_per_partition=int(max(uniq.max(), uniq.sum(axis=2).max() // 3)),
                  max_ids_per_partition=int(max(ids.max(), ids.sum(axis=2).max() // 3)),
                  enable_minibatching=True) if minibatching else {}
    emb = pl.create_host_embedding("bags", shape=[t, e], dtype=np.float64, initializer=full, exchange=exchange,
                                   optimizer_spec=pl.HostEmbeddingOptimizerSpec(lr), **limits)
    values, lengths, weights = steps[k]
    out = emb.lookup_bags(values, lengths, weights, combiner=combiner)
    want, _ = bag_reference(full, values, lengths, weights, combiner)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    assert (out[[1, 5]] == 0).all()
    if minibatching:
        assert pl.last_id_stats("bags")["bags/lookup"]["num_minibatches"] > 1
    # Padded format, unweighted, padding id -1: the same bags.
    width = lengths.max()
    padded = np.full((lengths.size, width), -1)
    for b, (lo, n) in enumerate(zip(np.cumsum(lengths) - lengths, lengths)):
        padded[b, :n] = values[lo:lo + n]
    want_unweighted, _ = bag_reference(full, values, lengths, np.ones(values.size), combiner)
    np.testing.assert_allclose(emb.lookup_bags(padded, combiner=combiner, padding_id=-1), want_unweighted,
                               rtol=1e-12, atol=1e-12)
    # Gradients: each ID gets g_b * w_i / d_b, summed over every replica's bags.
    reference = full.copy()
    for s, (v, ln, w) in enumerate(steps):
        g = np.random.default_rng(s).standard_normal((ln.size, e))
        _, scale = bag_reference(full, v, ln, w, combiner)
        np.add.at(reference, v, -lr * np.repeat(g, ln, axis=0) * scale[:, None])
        if s == k:
            mine = g
    emb.apply_bag_gradients(values, mine, lengths, weights, combiner=combiner)
    np.testing.assert_allclose(emb.get_embedding_tensor(), reference, rtol=1e-12, atol=1e-12)


@pytest.mark.mpi
def test_bad_bags_raise_on_every_replica(comm):
    emb = make("badbags", np.ones((10, 2), np.float32))
    values = np.arange(4)
    lengths = np.array([1, 1]) if comm.rank == comm.size - 1 else np.array([2, 2])
    with pytest.raises(ValueError, match=f"replica {comm.size - 1}: .*lengths"):
        emb.lookup_bags(values, lengths)
    with pytest.raises(ValueError, match="grads"):
        emb.apply_bag_gradients(values, np.ones((3, 2), np.float32) if comm.rank == 0 else np.ones((2, 2), np.float32),
                                np.array([2, 2]))
    np.testing.assert_array_equal(emb.get_embedding_tensor(), np.ones((10, 2)))
