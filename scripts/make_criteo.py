#!/usr/bin/env python3
"""Write click logs in Criteo's TSV format with a learnable click signal, for
examples/dlrm.py's demo and tests.

Each line is what Criteo's Kaggle Display Advertising and Terabyte click logs hold: a 0/1
label, 13 integer features and 26 categorical features as 8-hex-digit (32-bit) hashes,
tab-separated, a missing value left empty::

    1<TAB>3<TAB><TAB>12<TAB>...<TAB>68fd1e64<TAB>80e26c9b<TAB><TAB>...

How the values are drawn (all from ``numpy.random.default_rng([seed, chunk])``, so the
bytes depend only on the arguments):

- categorical feature ``j``: a value rank ``k`` from a Zipf law over
  ``min(KAGGLE_CARDINALITIES[j], --max-cardinality)`` values, ``P(k) ~ 1 / (k + 1) ** s``
  (``s`` = ``--zipf``), written as the 32-bit hash :func:`category_hash` ``(j, k)``;
  empty with the feature's missing rate (:func:`feature_plan`);
- integer feature ``i``: ``floor(exp(N(mu_i, sigma_i)))`` (log-normal counts), minus 3
  for a few values of feature 1 (Criteo's I2 holds small negative values), empty with the
  feature's missing rate;
- label: ``Bernoulli(sigmoid(logit))`` of a hidden logistic model over a few features:
  a random effect ``N(0, 1)`` per value of each of the categorical features in
  ``SIGNAL_CATEGORICALS`` (scaled by ``CATEGORICAL_WEIGHT``), a weight on ``log(1 + x)``
  of the integer features in ``SIGNAL_INTEGERS``, and the dot product of 2-dimensional
  hidden vectors of the values of two categorical features (the kind of pairwise
  interaction DLRM's dot products model). A missing value contributes nothing. The
  intercept is solved on the first chunk so that about ``--ctr`` of the labels are 1.

The value ranks of the hidden model are the same in every file and every chunk, so
frequent values recur and their effects are learnable in a few hundred steps; rare ones
are seen once or never (as in the real logs). The script prints one JSON object: the
files written, the rows, the fraction of clicks, and the ROC AUC of the hidden model's
own click probabilities on these rows (``scipy.stats.mannwhitneyu``'s U over the
positive-negative pairs): the best AUC any model can reach on the data.

Usage::

    python scripts/make_criteo.py data/criteo --rows 200000 --files 4
    python scripts/make_criteo.py data/criteo-test --rows 20000 --seed 1

Files are named ``part-00000.tsv``, ``part-00001.tsv``, ...; rows are split over them in
order (file ``f`` holds rows ``[f * rows // files, (f + 1) * rows // files)``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

INT_FEATURES, CAT_FEATURES = 13, 26
#: The 26 categorical features' distinct values in Criteo's Kaggle training set (counted by
#: DLRM's reference preprocessing), capped by ``--max-cardinality``.
KAGGLE_CARDINALITIES = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
                        27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)
#: The hidden model: categorical features with a random effect per value, integer
#: features with a weight on log(1 + x), and two categorical features whose values'
#: hidden vectors interact.
SIGNAL_CATEGORICALS = (0, 1, 4, 7, 12, 18)
CATEGORICAL_WEIGHT = 0.7
SIGNAL_INTEGERS = {0: 0.35, 4: -0.25, 9: 0.3}
INTERACTING = (5, 13)
INTERACTION_DIM = 2
CHUNK_ROWS = 1 << 16
_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", np.uint8)


def category_hash(feature: np.ndarray | int, rank: np.ndarray) -> np.ndarray:
    """The 32-bit hash written for value ``rank`` of categorical feature ``feature``:
    the MurmurHash3 finalizer (``fmix32``) of ``rank * 26 + feature + 1``, so distinct
    (feature, rank) pairs give distinct hashes (fmix32 is a bijection of 32-bit
    integers). Returns uint32 in the shape of ``rank``."""
    h = (np.asarray(rank, np.uint64) * CAT_FEATURES + np.asarray(feature, np.uint64) + 1) & 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return h.astype(np.uint32)


def feature_plan(seed: int, max_cardinality: int, zipf: float) -> dict:
    """What every chunk draws from: per categorical feature its cardinality, Zipf CDF,
    missing rate, hidden effects and interaction vectors; per integer feature its
    log-normal parameters and missing rate. Drawn from ``default_rng([seed, 2**31])``."""
    rng = np.random.default_rng([seed, 1 << 31])
    cards = [min(c, max_cardinality) for c in KAGGLE_CARDINALITIES]
    cdfs = []
    for c in cards:
        w = 1.0 / np.arange(1, c + 1, dtype=np.float64) ** zipf
        cdfs.append(np.cumsum(w) / w.sum())
    # Missing rates as in the Kaggle logs: most features nearly complete, some often empty.
    cat_missing = np.where(rng.random(CAT_FEATURES) < 0.6, 0.0, rng.uniform(0.02, 0.45, CAT_FEATURES))
    int_missing = np.where(rng.random(INT_FEATURES) < 0.4, 0.0, rng.uniform(0.02, 0.45, INT_FEATURES))
    effects = {j: rng.standard_normal(cards[j]) * CATEGORICAL_WEIGHT for j in SIGNAL_CATEGORICALS}
    vectors = {j: rng.standard_normal((cards[j], INTERACTION_DIM)) for j in INTERACTING}
    return {"cards": cards, "cdfs": cdfs, "cat_missing": cat_missing, "int_missing": int_missing,
            "int_mu": rng.uniform(0.0, 3.0, INT_FEATURES), "int_sigma": rng.uniform(0.5, 1.5, INT_FEATURES),
            "effects": effects, "vectors": vectors}


def draw_chunk(plan: dict, rows: int, seed: int, chunk: int) -> dict:
    """``rows`` samples: ``ranks`` int64 (rows, 26) value ranks (-1: missing), ``ints``
    int64 (rows, 13) and ``int_missing`` bool (rows, 13), ``logit`` float64 (rows,)
    without the intercept."""
    rng = np.random.default_rng([seed, chunk])
    ranks = np.empty((rows, CAT_FEATURES), np.int64)
    for j, cdf in enumerate(plan["cdfs"]):
        ranks[:, j] = np.minimum(np.searchsorted(cdf, rng.random(rows), side="right"), len(cdf) - 1)
    ranks[rng.random((rows, CAT_FEATURES)) < plan["cat_missing"]] = -1
    ints = np.floor(np.exp(rng.normal(plan["int_mu"], plan["int_sigma"], (rows, INT_FEATURES)))).astype(np.int64)
    ints[:, 1] -= 3 * (rng.random(rows) < 0.05)  # some small negative values, as Criteo's I2
    int_missing = rng.random((rows, INT_FEATURES)) < plan["int_missing"]
    logit = np.zeros(rows)
    for j, effect in plan["effects"].items():
        seen = ranks[:, j] >= 0
        logit[seen] += effect[ranks[seen, j]]
    for i, w in SIGNAL_INTEGERS.items():
        present = ~int_missing[:, i]
        logit[present] += w * (np.log1p(np.maximum(ints[present, i], 0)) - plan["int_mu"][i])
    a, b = INTERACTING
    both = (ranks[:, a] >= 0) & (ranks[:, b] >= 0)
    logit[both] += np.einsum("nd,nd->n", plan["vectors"][a][ranks[both, a]], plan["vectors"][b][ranks[both, b]])
    return {"ranks": ranks, "ints": ints, "int_missing": int_missing, "logit": logit}


def solve_intercept(logit: np.ndarray, ctr: float) -> float:
    """The intercept ``b`` with ``mean(sigmoid(b + logit)) = ctr`` (bisection)."""
    lo, hi = -30.0, 30.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if np.mean(1 / (1 + np.exp(-(mid + logit)))) < ctr:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def format_lines(labels: np.ndarray, chunk: dict) -> list[str]:
    """The chunk's rows as Criteo TSV lines (each ending in a newline)."""
    ints = chunk["ints"].astype(str)
    ints[chunk["int_missing"]] = ""
    ranks = chunk["ranks"]
    h = category_hash(np.arange(CAT_FEATURES), np.maximum(ranks, 0))
    nibbles = (h[..., None] >> np.arange(28, -4, -4, dtype=np.uint32)) & 0xF  # 8 hex digits, high first
    hashes = _HEX_DIGITS[nibbles].view("S8")[..., 0].astype(str)
    hashes[ranks < 0] = ""
    fields = np.concatenate([labels.astype(str)[:, None], ints, hashes], axis=1)
    return ["\t".join(row) + "\n" for row in fields.tolist()]


def generate(out_dir: Path, rows: int, files: int, seed: int = 0, max_cardinality: int = 100_000,
             zipf: float = 1.1, ctr: float = 0.25) -> dict:
    """Write ``rows`` lines into ``files`` files under ``out_dir``; returns the summary
    (files, rows, click rate, the hidden model's AUC)."""
    from scipy.stats import mannwhitneyu

    plan = feature_plan(seed, max_cardinality, zipf)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"part-{f:05d}.tsv" for f in range(files)]
    bounds = [f * rows // files for f in range(files + 1)]
    intercept = None
    probs, labels_all = [], []
    written = 0
    handles = [p.open("w", encoding="ascii", newline="\n") for p in paths]
    try:
        for chunk_index, start in enumerate(range(0, rows, CHUNK_ROWS)):
            n = min(CHUNK_ROWS, rows - start)
            chunk = draw_chunk(plan, n, seed, chunk_index)
            if intercept is None:
                intercept = solve_intercept(chunk["logit"], ctr)
            p = 1 / (1 + np.exp(-(intercept + chunk["logit"])))
            labels = (np.random.default_rng([seed, chunk_index, 1]).random(n) < p).astype(np.int64)
            probs.append(p)
            labels_all.append(labels)
            lines = format_lines(labels, chunk)
            for f, h in enumerate(handles):  # the part of the chunk that falls in file f
                lo, hi = max(bounds[f], start), min(bounds[f + 1], start + n)
                if lo < hi:
                    h.write("".join(lines[lo - start:hi - start]))
            written += n
    finally:
        for h in handles:
            h.close()
    p, y = np.concatenate(probs) if probs else np.zeros(0), np.concatenate(labels_all) if labels_all else np.zeros(0)
    positives, negatives = p[y == 1], p[y == 0]
    auc = (float(mannwhitneyu(positives, negatives).statistic) / (positives.size * negatives.size)
           if positives.size and negatives.size else None)
    return {"files": [str(x) for x in paths], "rows": written, "click_rate": float(y.mean()) if y.size else None,
            "hidden_model_auc": auc, "seed": seed, "max_cardinality": max_cardinality, "zipf": zipf}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("out_dir", type=Path, help="directory to write part-NNNNN.tsv files into (created)")
    p.add_argument("--rows", type=int, default=200_000, help="lines in all files together")
    p.add_argument("--files", type=int, default=4, help="files to split the lines over")
    p.add_argument("--seed", type=int, default=0, help="random seed (the same seed writes the same bytes)")
    p.add_argument("--max-cardinality", type=int, default=100_000,
                   help="cap on each categorical feature's distinct values (Kaggle's counts above it are cut)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent s of the categorical values")
    p.add_argument("--ctr", type=float, default=0.25, help="fraction of clicks to aim for (Kaggle's: about 0.26)")
    args = p.parse_args(argv)
    if args.rows < 0 or args.files < 1 or args.max_cardinality < 1 or args.zipf <= 0 or not 0 < args.ctr < 1:
        p.error("--rows must be >= 0, --files and --max-cardinality >= 1, --zipf > 0 and --ctr in (0, 1)")
    print(json.dumps(generate(args.out_dir, args.rows, args.files, args.seed, args.max_cardinality, args.zipf,
                              args.ctr)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
