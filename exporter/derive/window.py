"""Window helpers shared by every derivation."""

from __future__ import annotations

from typing import Iterable

from exporter.samples import Interval


def covered_seconds(intervals: Iterable[Interval]) -> float:
    """Seconds of gap-free samples in the window (each interval counted once)."""
    return sum(iv.seconds for iv in intervals)


def sum_delta(intervals: Iterable[Interval], key: str) -> float | None:
    """Sum of a counter's increases, or None when no interval carries that counter (series not exported)."""
    total, seen = 0.0, False
    for iv in intervals:
        d = iv.deltas.get(key)
        if d is not None:
            total, seen = total + d, True
    return total if seen else None


def seconds_with(intervals: Iterable[Interval], key: str) -> float:
    """Seconds covered by intervals that carry ``key``: the denominator matching sum_delta."""
    return sum(iv.seconds for iv in intervals if key in iv.deltas)


def gauge_values(intervals: Iterable[Interval], key: str) -> list[float]:
    return [iv.gauges[key] for iv in intervals if key in iv.gauges]
