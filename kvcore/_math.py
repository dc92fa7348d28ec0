"""Integer helpers shared by the spec and geometry modules."""

from __future__ import annotations

import math


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def round_up(value: int, multiple: int) -> int:
    return cdiv(value, multiple) * multiple


def prod(values) -> int:
    return math.prod(values)
