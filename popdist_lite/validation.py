"""Checks of numeric arguments shared by the optimizers, the optimizer specs and the
loss scalers: one message format, ``"<owner>: argument <name>: expected ..., got ..."``."""

from __future__ import annotations

import math

import numpy as np


def check_number(owner: str, name: str, value, low: float = 0.0, high: float = math.inf, *,
                 low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a float when it is a finite real number (not a bool) between ``low``
    and ``high`` (each bound excluded when ``*_open``).

    Raises:
        ValueError: naming ``owner``, the argument, the interval and the value.
    """
    ok = isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool) \
        and math.isfinite(value) and (value > low if low_open else value >= low) \
        and (value < high if high_open else value <= high)
    if not ok:
        if high == math.inf:
            want = f"{'>' if low_open else '>='} {low}"
        else:
            want = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{owner}: argument {name}: expected a finite number {want}, got {value!r}")
    return float(value)


def check_integer(owner: str, name: str, value, low: int = 1) -> int:
    """``value`` as an int when it is an integer (not a bool) ``>= low``.

    Raises:
        ValueError: naming ``owner``, the argument, the bound and the value.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{owner}: argument {name}: expected an integer >= {low}, got {value!r}")
    return int(value)
