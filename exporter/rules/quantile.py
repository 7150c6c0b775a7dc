"""The one quantile rule (PromQL quantile_over_time: linear interpolation between closest ranks), shared by
the store's aggregates and the derivations, so both read a quantile the same way."""

from __future__ import annotations

import math
from typing import Sequence


def interpolate_sorted(s: Sequence[float], q: float) -> float | None:
    """q-quantile of an already sorted list, linear interpolation between closest ranks (PromQL)."""
    if not s:
        return None
    rank = q * (len(s) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return s[lo] + (s[hi] - s[lo]) * (rank - lo)


def quantile(values: Sequence[float], q: float) -> float | None:
    """q-quantile of unsorted values, as PromQL's quantile_over_time computes it."""
    if not values:
        return None
    return interpolate_sorted(sorted(values), q)
