"""Stochastic rounding in one process: the swamping numbers of Graphcore's FP16
mixed-precision tutorial, unbiasedness, the neighbours-only property, special values,
and the three modes."""

import numpy as np
import pytest

from popdist_lite.stochastic_rounding import (StochasticRounding, StochasticRoundingBehaviour, round_to_nearest,
                                              stochastic_round)

F16 = np.float16


def accumulate(n_runs, rounding, steps=10_000, addend=0.0001):
    """The tutorial's loop: start at 0.0 in float16 and add 0.0001 (a float16) ``steps``
    times; each addition is exact in float64, then rounded to float16 by ``rounding``."""
    total = np.zeros(n_runs, F16)
    y = np.float64(F16(addend))
    for _ in range(steps):
        total = rounding(total.astype(np.float64) + y)
    return total


def test_swamping_with_round_to_nearest_gives_0_25():
    # The tutorial's own numpy code, verbatim in spirit: float16 += 0.0001, 10,000 times.
    x = np.array([0.0]).astype(F16)
    for _ in range(10000):
        x += 0.0001
    assert x[0] == 0.25
    assert accumulate(1, round_to_nearest)[0] == 0.25


def test_swamping_with_stochastic_rounding_averages_1():
    rng = np.random.default_rng(2024)
    runs = accumulate(20, lambda v: stochastic_round(v, rng))  # 20 independent runs, as in the tutorial
    assert runs.dtype == F16
    assert abs(runs.astype(np.float64).mean() - 1.0) < 0.02
    assert runs.min() > 0.9 and runs.max() < 1.1  # every run is far from the swamped 0.25
    assert len(np.unique(runs)) > 5  # independent runs differ


def test_unbiased_across_binades_and_subnormals():
    rng = np.random.default_rng(7)
    n, samples = 400, 4000
    x = (rng.uniform(-1, 1, n) * 2.0 ** rng.integers(-27, 14, n)).astype(np.float32)  # includes float16 subnormals
    near = x.astype(F16).astype(np.float64)
    lo = np.where(near > x, np.nextafter(x.astype(F16), F16(-np.inf)), x.astype(F16)).astype(np.float64)
    hi = np.where(near > x, x.astype(F16), np.nextafter(x.astype(F16), F16(np.inf))).astype(np.float64)
    gap = hi - lo
    draws = stochastic_round(np.broadcast_to(x, (samples, n)), rng).astype(np.float64)
    assert np.all((draws == lo) | (draws == hi))  # only the two neighbours
    p = (x - lo) / gap
    # mean of Bernoulli(p) draws: standard error sqrt(p(1-p)/samples) <= 0.008 of a gap
    err = (draws.mean(axis=0) - x) / gap
    assert np.all(np.abs(err) < 5 * np.sqrt(p * (1 - p) / samples) + 1e-9)
    # round-to-nearest is biased on the same data (the test can tell them apart)
    rtn_err = (near - x) / gap
    assert np.abs(rtn_err).mean() > 0.1


def test_exact_values_and_specials_are_kept():
    rng = np.random.default_rng(1)
    exact = np.array([0.0, -0.0, 1.0, -2.5, 65504.0, 2.0 ** -24, -(2.0 ** -20)], np.float32)
    for _ in range(20):
        np.testing.assert_array_equal(stochastic_round(exact, rng), exact.astype(F16))
    special = np.array([np.inf, -np.inf, np.nan, 1e6, -70000.0, 65510.0], np.float32)
    out = stochastic_round(special, rng)
    np.testing.assert_array_equal(out, np.array([np.inf, -np.inf, np.nan, np.inf, -np.inf, 65504], F16))  # to nearest
    tiny = np.full(20000, 2.0 ** -26, np.float32)  # a quarter of the smallest subnormal
    assert abs(stochastic_round(tiny, rng).astype(np.float64).mean() / 2.0 ** -26 - 1) < 0.1


@pytest.mark.parametrize("mode", list(StochasticRoundingBehaviour))
def test_modes(mode):
    x = np.full(1000, 1.0 + 2.0 ** -12, np.float32)  # a quarter of the way to the next float16
    a, b = StochasticRounding(mode, seed=5, replica=0), StochasticRounding(mode, seed=5, replica=1)
    rep_a, rep_b = a.round(x, replicated=True), b.round(x, replicated=True)
    own_a, own_b = a.round(x, replicated=False), b.round(x, replicated=False)
    np.testing.assert_array_equal(rep_a, rep_b)  # replicated tensors: identical on every replica
    nearest = x.astype(F16)
    stochastic_rep = not np.array_equal(rep_a, nearest)
    stochastic_own = not np.array_equal(own_a, nearest)
    assert stochastic_rep == (mode is not StochasticRoundingBehaviour.OFF)
    assert stochastic_own == (mode is StochasticRoundingBehaviour.ON)
    if mode is StochasticRoundingBehaviour.ON:
        assert not np.array_equal(own_a, own_b)  # owned tensors: per-replica streams
    assert StochasticRoundingBehaviour.parse(mode.name.lower()) is mode


def test_bad_mode():
    with pytest.raises(ValueError, match="expected one of \\['OFF', 'ON', 'REPLICA_IDENTICAL_ONLY'\\]"):
        StochasticRounding("sometimes")
