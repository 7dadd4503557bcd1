"""Checks of option values shared by ``PolyAttnConfig`` and the kinds' own options: each refuses
what could be silently misread ("no" as True, 4.0 truncated, NaN, a float32 overflow) with a
ValueError naming the option and what is allowed. Pure Python."""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["FLOAT32_MAX", "check_bool", "check_choice", "check_coefficients", "check_float", "check_head_pairs",
           "check_int", "is_power_of_two"]

# Every float option enters the kernels, which compute in float32: 1e300 is finite in Python but
# inf there (a denominator_offset of 1e300 zeroes the attention like inf did).
FLOAT32_MAX = 3.4028234663852886e38


def is_power_of_two(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


def check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    # bool is an int subclass (True would be degree 1); floats such as 4.0 are refused, not truncated.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be an int in [{minimum}, {maximum}], got {value!r}")
    return int(value)


def real(name: str, value: Any, what: str, shown: str) -> float:
    # NaN/inf would not fail here or in the kernels: NaN compares False with everything and
    # silently zeroes (or NaNs) the attention weights downstream; so would a float32 overflow.
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be {what}, got {shown}")
    if abs(value) > FLOAT32_MAX:
        raise ValueError(f"{name} must be {what} of magnitude <= {FLOAT32_MAX:.8g} (float32, the kernels' "
                         f"working precision), got {shown}")
    return float(value)


def check_float(name: str, value: Any) -> float:
    return real(name, value, "a finite real number (int or float)", repr(value))


def check_bool(name: str, value: Any) -> bool:
    # A string such as "no" or "false" is truthy: it would switch the option ON.
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (True or False), got {value!r}")
    return value


def check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
    return value


def check_coefficients(name: str, value: Any) -> tuple[float, ...]:
    # A str is a sequence too: "12" would become (1.0, 2.0).
    what = "a list or tuple of finite real numbers a_0..a_D"
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return tuple(real(name, c, what, f"{c!r} at index {i} of {value!r}") for i, c in enumerate(value))


def check_head_pairs(name: str, value: Any) -> tuple[tuple[int, int], ...] | None:
    """(layer, kv_head) pairs: a list or tuple of 2-item lists or tuples of ints >= 0, no pair twice. Returned sorted
    (a set of heads: the order carries nothing); an empty list means no pair and is returned as None."""
    what = "a list of [layer, kv_head] pairs of ints >= 0"
    # A str or a dict is iterable too: "01" would read as the pair (0, 1).
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    pairs = []
    for i, pair in enumerate(value):
        if (not isinstance(pair, (list, tuple)) or len(pair) != 2
                or any(isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 0 for x in pair)):
            raise ValueError(f"{name} must be {what}, got {pair!r} at index {i} of {value!r}")
        pairs.append((int(pair[0]), int(pair[1])))
    twice = sorted({p for p in pairs if pairs.count(p) > 1})
    if twice:
        raise ValueError(f"{name} must name each (layer, kv_head) pair once, got {twice} more than once")
    return tuple(sorted(pairs)) or None
