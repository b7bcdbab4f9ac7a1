"""Single-process parts of ID limits and minibatching: the hash, the tree split against
a brute-force reference, minibatch ranges, the dropping rule, combiners' math and the
limit-suggesting recorder."""

import json

import numpy as np
import pytest

from popdist_lite import IdLimitRecorder, bucket_of, minibatch_ranges, split_mask
from popdist_lite.embedding import combiners
from popdist_lite.embedding.id_limits import stats as id_stats
from popdist_lite.embedding.id_limits.minibatch_split import boundaries, minibatch_of_bucket, splitmix64
from popdist_lite.embedding.id_limits.partitions import keep_mask
from popdist_lite.embedding.id_limits.settings import IdLimits

M64 = (1 << 64) - 1


def splitmix64_python(x: int) -> int:
    """SplitMix64's finaliser with Python ints (the textbook constants)."""
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def test_hash_is_splitmix64_and_fixed():
    ids = np.array([0, 1, 2, 3, 12345, 2**31 - 1, 2**40 + 7, -1], dtype=np.int64)
    got = splitmix64(ids)
    assert [int(v) for v in got] == [splitmix64_python(int(i) & M64) for i in ids]
    # Pinned: the bucket of an ID never changes between processes, runs or versions.
    assert bucket_of(np.arange(10)).tolist() == [47, 1, 14, 45, 10, 26, 0, 23, 54, 36]
    assert bucket_of(np.arange(10, dtype=np.int32)).tolist() == bucket_of(np.arange(10)).tolist()
    counts = np.bincount(bucket_of(np.arange(64_000)), minlength=64)
    assert counts.min() > 850 and counts.max() < 1150  # spreads sequential IDs evenly


def test_worked_example_from_sparsecore():
    assert split_mask([2, 5, 1, 6, 3, 4, 2, 0], 7) == 0b1110000
    assert minibatch_ranges(0b1110000, 8) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert boundaries(8).tolist() == [1, 3, 5, 7, 2, 6, 4]
    assert split_mask([2, 5, 1, 6, 3, 4, 2, 0], 23) == 0  # everything fits: one minibatch
    # limit 6: the first three pairs split, {4,2} of the second level merges (bit 5 clear)
    assert split_mask([2, 5, 1, 6, 3, 4, 2, 0], 6) == 0b1010111
    assert minibatch_ranges(0b1010111, 8) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 8)]


def reference_split(loads, limit):
    """Brute force, top-down recursion: (mask, carried value per partition)."""
    loads = np.atleast_2d(np.asarray(loads, dtype=np.int64))
    n = loads.shape[1]
    levels = n.bit_length() - 1
    first = [sum(n >> (lv + 1) for lv in range(L)) for L in range(levels)]  # first bit of each level
    mask = 0

    def node(lo, hi):
        nonlocal mask
        if hi - lo == 1:
            return [int(loads[p, lo]) for p in range(loads.shape[0])]
        mid = (lo + hi) // 2
        left, right = node(lo, mid), node(mid, hi)
        level = (hi - lo).bit_length() - 2
        if any(a + b > limit for a, b in zip(left, right)):
            mask |= 1 << (first[level] + lo // (hi - lo))
            return [max(a, b) for a, b in zip(left, right)]
        return [a + b for a, b in zip(left, right)]

    node(0, n)
    return mask


@pytest.mark.parametrize("seed", range(40))
def test_split_matches_brute_force_and_fits(seed):
    rng = np.random.default_rng(seed)
    parts = int(rng.integers(1, 5))
    limit = int(rng.integers(1, 60))
    loads = rng.integers(0, limit + 1, size=(parts, 64)) * (rng.random((parts, 64)) < rng.random())
    mask = split_mask(loads, limit)
    assert mask == reference_split(loads, limit)
    assert 0 <= mask < 1 << 63
    for lo, hi in minibatch_ranges(mask):  # no bucket over the limit: every minibatch fits
        assert (loads[:, lo:hi].sum(axis=1) <= limit).all()
    # OR of several partitions' masks (what replicas do) still fits every partition.
    other = rng.integers(0, limit + 1, size=(2, 64))
    both = mask | split_mask(other, limit)
    for lo, hi in minibatch_ranges(both):
        assert (loads[:, lo:hi].sum(axis=1) <= limit).all() and (other[:, lo:hi].sum(axis=1) <= limit).all()


def test_minibatch_ranges_cover_all_buckets():
    rng = np.random.default_rng(0)
    for _ in range(20):
        mask = int(rng.integers(0, 1 << 62)) | int(rng.integers(0, 2)) << 62
        ranges = minibatch_ranges(mask)
        assert len(ranges) == bin(mask).count("1") + 1
        assert ranges[0][0] == 0 and ranges[-1][1] == 64
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        of = minibatch_of_bucket(mask)
        assert of.tolist() == [i for i, (lo, hi) in enumerate(ranges) for _ in range(lo, hi)]
    assert minibatch_ranges(0) == [(0, 64)]
    assert len(minibatch_ranges((1 << 63) - 1)) == 64


def reference_keep(flat, r, max_ids, max_unique):
    keep = []
    distinct = {o: [] for o in range(r)}
    used = {o: 0 for o in range(r)}
    for i in flat.tolist():  # the documented rule, one ID at a time
        o = i % r
        if i not in distinct[o]:
            distinct[o].append(i)
        ok = max_unique is None or distinct[o].index(i) < max_unique
        ok = ok and (max_ids is None or used[o] < max_ids)
        used[o] += ok
        keep.append(ok)
    return np.array(keep, dtype=bool)


@pytest.mark.parametrize("seed", range(10))
def test_keep_mask_follows_the_documented_rule(seed):
    rng = np.random.default_rng(seed)
    r = int(rng.integers(1, 5))
    flat = np.minimum(rng.zipf(1.3, size=int(rng.integers(0, 200))) - 1, 99).astype(np.int64)
    for max_ids, max_unique in ((7, None), (None, 3), (9, 4), (1, 1)):
        got = keep_mask(flat, r, IdLimits(max_ids, max_unique, allow_id_dropping=True))
        np.testing.assert_array_equal(got, reference_keep(flat, r, max_ids, max_unique))


def reference_pool(table, bags, weights, combiner):
    out = np.zeros((len(bags), table.shape[1]))
    for b, (ids, w) in enumerate(zip(bags, weights)):
        if len(ids) == 0:
            continue
        s = sum(wi * table[i] for i, wi in zip(ids, w))
        d = {"sum": 1.0, "mean": sum(w), "sqrtn": np.sqrt(sum(wi * wi for wi in w))}[combiner]
        out[b] = s / d if d else 0
    return out


@pytest.mark.parametrize("combiner", combiners.COMBINERS)
@pytest.mark.parametrize("weighted", [False, True])
def test_pool_ragged_and_padded_match_reference(combiner, weighted):
    rng = np.random.default_rng(5)
    table = rng.standard_normal((30, 4))
    lengths = np.array([3, 0, 1, 5, 2, 0])
    values = rng.integers(0, 30, size=lengths.sum())
    weights = rng.random(values.size) + 0.1 if weighted else None
    bags = combiners.make_bags(values, lengths, weights, combiner)
    got = combiners.pool(table[bags.ids], bags)
    w = weights if weighted else np.ones(values.size)
    split = np.cumsum(lengths)[:-1]
    want = reference_pool(table, np.split(values, split), np.split(w, split), combiner)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    # The same bags padded to width 5 with padding id -1.
    padded = np.full((lengths.size, 5), -1)
    pw = np.zeros((lengths.size, 5))
    for b, (ids, ws) in enumerate(zip(np.split(values, split), np.split(w, split))):
        padded[b, :ids.size], pw[b, :ids.size] = ids, ws
    pbags = combiners.make_bags(padded, weights=pw if weighted else None, combiner=combiner, padding_id=-1)
    np.testing.assert_allclose(combiners.pool(table[pbags.ids], pbags), want, rtol=1e-12)
    # Gradient: the adjoint of pooling, <pool(x), g> == <x, unpool(g)>.
    g = rng.standard_normal((lengths.size, 4))
    per_id = combiners.unpool(g, bags, 4, np.float64)
    x = rng.standard_normal((values.size, 4))
    np.testing.assert_allclose((combiners.pool(x, bags) * g).sum(), (x * per_id).sum(), rtol=1e-12)


def test_make_bags_rejects_bad_input():
    with pytest.raises(ValueError, match="combiner"):
        combiners.make_bags(np.arange(3), [3], combiner="max")
    with pytest.raises(ValueError, match="adding up"):
        combiners.make_bags(np.arange(3), [2])
    with pytest.raises(ValueError, match="weights"):
        combiners.make_bags(np.arange(3), [3], weights=np.ones(2))
    with pytest.raises(TypeError, match="integer"):
        combiners.make_bags(np.ones(3), [3])


def test_recorder_suggests_limits(tmp_path):
    with IdLimitRecorder(headroom=1.5, multiple=8) as rec:
        for step, (m, u) in enumerate([(100, 40), (130, 60), (90, 10)]):
            id_stats.publish({"table": "t", "op": "lookup", "max_ids_per_partition": m,
                              "max_unique_ids_per_partition": u, "max_ids_partition": [0, 0],
                              "max_unique_ids_partition": [0, 0], "num_minibatches": 1 + step,
                              "dropped_ids": step, "_check": True})
            rec.end_step()
    id_stats.publish({"table": "t", "op": "lookup", "max_ids_per_partition": 10**6,
                      "max_unique_ids_per_partition": 1, "max_ids_partition": [0, 0],
                      "max_unique_ids_partition": [0, 0], "num_minibatches": 1, "dropped_ids": 0})  # closed
    assert rec.suggest() == {"t": {"max_ids_per_partition": 200, "max_unique_ids_per_partition": 96}}
    summary = rec.summary()["t"]
    assert summary == {"calls": 3, "max_ids_per_partition": 130, "max_unique_ids_per_partition": 60,
                       "max_num_minibatches": 3, "dropped_ids": 3}
    data = json.loads(rec.to_json(tmp_path / "limits.json"))
    assert data == json.loads((tmp_path / "limits.json").read_text())
    assert [r["step"] for r in data["records"]] == [0, 1, 2] and "_check" not in data["records"][0]
