"""Locating the KV-pressure threshold from evidence (methods.md s10): pure functions.

A ``PressurePoint`` is one observation of a server at one pressure level: a live window, or one experiment run
or condition. It is *pressured* when it shows sustained preemptions (>= ``onset_per_minute``, methods.md s3) or
a recomputation tax above its noise (methods.md s4), *clean* when what is known of both says neither, and
*unknown* (ignored) when neither is known. ``locate`` puts the threshold at the KV-p95 cut that best separates
clean points (below) from pressured ones (above): a one-dimensional decision stump, weighted by the windows or
runs behind each point, ties going to the lowest cut (the lowest p95 band where pressure is sustained).

``quantile_bounds`` is the order-statistic interval of a quantile of dense samples (the uncertainty of a
window's p95).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from exporter import rules

ONSET_PER_MINUTE = rules.PREEMPTION_ONSET_PER_MINUTE.default  # methods.md s3: sustained preemptions mark onset
TAX_Z = 2.0              # a tax is evidence when it exceeds TAX_Z times its noise ...
MIN_TAX = 0.02           # ... and at least 2 percentage points of the prompt tokens
MIN_TAX_UNKNOWN_SE = 0.05  # without a noise estimate: at least 5 points


@dataclass(frozen=True)
class PressurePoint:
    """One live window, or one experiment run/condition."""

    kv_p95: float                          # ratio 0..1
    preemptions_per_minute: float | None
    tax: float | None                      # local_compute share minus the low-pressure reference; None unknown
    tax_se: float | None                   # noise level of the tax; None unknown
    weight: float = 1.0                    # windows/runs behind the point
    kv_p95_low: float | None = None        # the p95's own uncertainty interval (None: the p95 itself)
    kv_p95_high: float | None = None
    t: float | None = None                 # when (live windows: the window's end); not used by locate


@dataclass(frozen=True)
class LocatedThreshold:
    ratio: float                # located KV-p95 threshold
    low: float                  # uncertainty interval
    high: float
    method: str                 # "preemption_onset" | "tax_onset"
    points: int                 # points it rests on (clean and pressured; unknown ones are not counted)
    clean_below: float = 0.0    # weight of the clean points below the cut
    pressured_above: float = 0.0  # weight of the pressured points above it
    misplaced: float = 0.0      # weight of the points on the wrong side (pressured below, clean above)


def preempting(p: PressurePoint, onset_per_minute: float = ONSET_PER_MINUTE) -> bool:
    return p.preemptions_per_minute is not None and p.preemptions_per_minute >= onset_per_minute


def taxed(p: PressurePoint, z: float = TAX_Z, min_tax: float = MIN_TAX,
          min_tax_unknown_se: float = MIN_TAX_UNKNOWN_SE) -> bool:
    """The tax is above noise: > z * SE and > min_tax (without an SE: > min_tax_unknown_se)."""
    if p.tax is None:
        return False
    if p.tax_se is None:
        return p.tax > min_tax_unknown_se
    return p.tax > max(z * p.tax_se, min_tax)


def classify(p: PressurePoint, onset_per_minute: float = ONSET_PER_MINUTE) -> bool | None:
    """True: pressured; False: clean; None: nothing known (neither preemptions nor tax)."""
    if preempting(p, onset_per_minute) or taxed(p):
        return True
    if p.preemptions_per_minute is None and p.tax is None:
        return None
    return False


def locate(points: Sequence[PressurePoint], min_points: int = 3, min_side: float = 1.0,
           onset_per_minute: float = ONSET_PER_MINUTE) -> LocatedThreshold | None:
    """The KV-p95 threshold the points show, or None when the evidence is not there.

    Rule (methods.md s10): sort the known points by p95; among the cuts between two distinct p95 values, take
    the one with the least weight on the wrong side (pressured below, clean above), the lowest such cut on a tie.
    It stands only when at least ``min_points`` points are known, the clean weight below the cut and the
    pressured weight above it are each at least ``min_side``, and each side is mostly what it should be
    (pressured weight above > clean weight above; clean below > pressured below). The ratio is the middle of
    the gap at the cut; the interval runs from the highest clean point below the lowest optimal cut to the
    lowest pressured point above the highest optimal cut, widened by those points' own p95 intervals.
    The method names the evidence of the lowest pressured point above the cut: preemptions first."""
    known = sorted(((p, c) for p in points if (c := classify(p, onset_per_minute)) is not None),
                   key=lambda pc: pc[0].kv_p95)
    if len(known) < max(min_points, 2):
        return None
    total_clean = sum(p.weight for p, c in known if not c)
    pressured_below = clean_below = 0.0
    best, cuts = math.inf, []
    for i in range(1, len(known)):
        p, c = known[i - 1]
        if c:
            pressured_below += p.weight
        else:
            clean_below += p.weight
        if known[i][0].kv_p95 <= p.kv_p95:
            continue  # no cut between equal p95 values
        cost = pressured_below + (total_clean - clean_below)
        if cost < best - 1e-12:
            best, cuts = cost, [(i, clean_below, pressured_below)]
        elif cost <= best + 1e-12:
            cuts.append((i, clean_below, pressured_below))
    if not cuts:
        return None
    i, clean_w, pressured_w = cuts[0]
    total_pressured = sum(p.weight for p, c in known if c)
    above_pressured, above_clean = total_pressured - pressured_w, total_clean - clean_w
    if (clean_w < min_side or above_pressured < min_side or above_pressured <= above_clean
            or clean_w <= pressured_w):
        return None
    edge_clean = max((p for p, c in known[:i] if not c), key=lambda p: p.kv_p95)
    j = cuts[-1][0]
    first_pressured = min((p for p, c in known[i:] if c), key=lambda p: p.kv_p95)
    edge_pressured = min((p for p, c in known[j:] if c), key=lambda p: p.kv_p95, default=first_pressured)
    ratio = (known[i - 1][0].kv_p95 + known[i][0].kv_p95) / 2
    low = min(_lower(edge_clean), ratio)
    high = max(_upper(edge_pressured), ratio)
    method = "preemption_onset" if preempting(first_pressured, onset_per_minute) else "tax_onset"
    return LocatedThreshold(ratio, low, high, method, len(known), clean_w, above_pressured, best)


def _lower(p: PressurePoint) -> float:
    return p.kv_p95 if p.kv_p95_low is None else min(p.kv_p95_low, p.kv_p95)


def _upper(p: PressurePoint) -> float:
    return p.kv_p95 if p.kv_p95_high is None else max(p.kv_p95_high, p.kv_p95)


def quantile_bounds(sorted_values: Sequence[float], q: float = 0.95,
                    z: float = 1.96) -> tuple[float, float] | None:
    """Distribution-free interval for the q-quantile of the population the sorted samples come from: the
    order statistics X_(l), X_(u) with ranks nq -/+ z*sqrt(nq(1-q)) (normal approximation to the binomial
    count of samples below the quantile; ~95 % for z = 1.96), clamped to the sample range. It assumes
    independent samples; 1 s samples of a slowly moving gauge are correlated, so it is a lower bound on the
    real uncertainty (methods.md s10)."""
    n = len(sorted_values)
    if n == 0:
        return None
    half = z * math.sqrt(n * q * (1 - q))
    lo = max(math.floor(n * q - half), 1)       # 1-based ranks
    hi = min(math.ceil(n * q + half) + 1, n)
    return sorted_values[lo - 1], sorted_values[hi - 1]
