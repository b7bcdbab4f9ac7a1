"""Loss-scale arithmetic in one process (the cross-replica agreement is tested in tests/mpi/test_precision.py)."""

import numpy as np
import pytest

import popdist_lite as pl


def test_dynamic_scale_halves_on_overflow_and_doubles_after_n_clean_steps():
    s = pl.DynamicLossScaler(2.0 ** 10, growth_interval=3, min_scale=2.0 ** 8, max_scale=2.0 ** 11)
    trace = []
    for overflow in [False, False, True, False, False, False, False, False, False, True, True, True]:
        s.update(overflow)
        trace.append(s.scale)
    assert trace == [2 ** 10, 2 ** 10, 2 ** 9, 2 ** 9, 2 ** 9, 2 ** 10, 2 ** 10, 2 ** 10, 2 ** 11, 2 ** 10, 2 ** 9, 2 ** 8]
    s.update(True)
    assert s.scale == 2 ** 8 and s.skipped_steps == 5  # never below min_scale
    for _ in range(30):
        s.update(False)
    assert s.scale == 2 ** 11  # never above max_scale


def test_unscale_is_float32_and_exact_for_power_of_two_scales():
    s = pl.StaticLossScaler(2.0 ** 12)
    g = (np.array([1e-6, 3.0, -7e-5]) * 2 ** 12).astype(np.float16)
    out = s.unscale(g)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, g.astype(np.float32) / np.float32(2 ** 12))
    assert s.scale_loss(0.5) == 2048.0


def test_tensorflow_names():
    fixed = pl.FixedLossScale(128)
    assert isinstance(fixed, pl.StaticLossScaler) and fixed.scale == 128
    dyn = pl.DynamicLossScale(initial_loss_scale=64, increment_period=1, multiplier=4)
    dyn.update(False)
    assert dyn.scale == 256
    dyn.update(True)
    assert dyn.scale == 64


@pytest.mark.parametrize("kwargs, match", [
    (dict(initial_scale=0), "initial_scale"), (dict(growth_interval=0), "growth_interval"),
    (dict(backoff_factor=1.0), "backoff_factor"), (dict(growth_factor=1.0), "growth_factor"),
    (dict(min_scale=4.0, max_scale=2.0), "min_scale <= max_scale"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pl.DynamicLossScaler(**kwargs)
    with pytest.raises(ValueError, match="scale"):
        pl.StaticLossScaler(float("inf"))
