"""Preemptions per request (vLLM 0.30+: the histogram vllm:request_num_preemptions, observed once per finished
request with the number of times it was preempted).

Over a window the histogram's counters are differenced like any counter: N finished requests, S preemptions
among them, and F(b) requests preempted at most b times for each bucket bound b.

    quantile q   0 when at most (1 - q) N requests can have been preempted (the share's upper bound below);
                 else the smallest bucket bound b with F(b) >= q N: preemptions are whole numbers, so this is
                 an upper edge ("at most b"), never an interpolated 0.5 preemption; None above the largest bound
    share preempted at least once, as [lower, upper]:
                 a bucket at 0 (custom buckets) gives it exactly: (N - F(0)) / N.
                 vLLM's default first bucket is 1 (0.32: 1, 2, 3, 4, 5, 10, 20), which holds never- and
                 once-preempted requests together. Then the once-preempted are n1 = S - T, where T is what the
                 requests above 1 contributed to S; whole numbers bound T per bucket (b_prev, b] between
                 floor(b_prev) + 1 and floor(b) each, so with every such request in a unit-wide bucket (2..5)
                 the share is exact, and otherwise the bounds say how far it can be off.
                 Any other first bound: lower = (N - F(b0)) / N, upper = min(N, S) / N.
"""

from __future__ import annotations

import math

from exporter.rules.keys import labelled
from exporter.store import WindowAggregate

QUANTILES = (0.5, 0.99)
_LE = "preemption_hist_le"


def histogram(agg: WindowAggregate) -> tuple[float, float, list[tuple[float, float]]] | None:
    """(N, S, [(bound, F(bound)) for the finite bounds, ascending]) over the window; None without the
    histogram, without a finished request, or when the window's deltas are not a histogram."""
    n, s = agg.delta("preemption_hist_count"), agg.delta("preemption_hist_sum")
    if n is None or s is None or n <= 0:
        return None
    cums = labelled({k: agg.delta(k) for k in agg.keys()}, _LE)
    buckets = []
    for bound, cum in cums.items():
        b = _bound(bound)
        if b is not None and math.isfinite(b) and cum is not None:
            buckets.append((b, cum))
    buckets.sort()
    # the families are differenced one by one (a refused or re-based one can lag the others): a window whose
    # buckets do not form a histogram of its N requests says nothing
    cums = [cum for _, cum in buckets]
    if s < 0 or any(c < 0 or c > n + 1e-9 for c in cums) or any(b < a for a, b in zip(cums, cums[1:])):
        return None
    return n, s, buckets


def _bound(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def quantiles(h: tuple[float, float, list[tuple[float, float]]] | None) -> dict[str, float] | None:
    """{"p50": b, "p99": b}: preemptions per request at each quantile (upper bucket edge, see above)."""
    if h is None:
        return None
    n, _, buckets = h
    share = preempted_share(h)
    out = {}
    for q in QUANTILES:
        if share is not None and share["upper"] <= 1 - q + 1e-12:
            out[f"p{q * 100:g}"] = 0.0  # at least a share q of the requests was never preempted
            continue
        edge = next((b for b, cum in buckets if cum >= q * n - 1e-9), None)
        if edge is not None:
            out[f"p{q * 100:g}"] = edge
    return out or None


def preempted_share(h: tuple[float, float, list[tuple[float, float]]] | None) -> dict[str, float] | None:
    """{"lower": ..., "upper": ...}: the share of finished requests preempted at least once (see above)."""
    if h is None or not h[2]:
        return None
    n, s, buckets = h
    b0, f0 = buckets[0]
    if b0 == 0:
        exact = (n - f0) / n
        return {"lower": exact, "upper": exact}
    if b0 != 1:
        lower = (n - f0) / n
        return {"lower": lower, "upper": max(lower, min(n, s) / n)}
    above = n - f0  # preempted at least twice
    t_min, t_max, prev, prev_cum = 0.0, 0.0, b0, f0
    for b, cum in buckets[1:]:
        count = max(cum - prev_cum, 0.0)
        t_min += count * (math.floor(prev) + 1)
        t_max += count * math.floor(b)
        prev, prev_cum = b, cum
    beyond = max(n - prev_cum, 0.0)  # above the largest bound: at least floor(prev) + 1 each, at most all of S
    t_min += beyond * (math.floor(prev) + 1)
    once_max = min(max(s - t_min, 0.0), f0)
    once_min = min(max(s - (s if beyond > 0 else t_max), 0.0), once_max)
    return {"lower": (above + once_min) / n, "upper": (above + once_max) / n}
