"""Aggregates for tests that build Intervals by hand: derive functions take an aggregate only, so a list of
intervals goes through ``aggregate_of`` (the store's), and the collapse signature through the same cut the
daemon makes (exporter.model.server.ServerModel._collapse) on a list."""

from __future__ import annotations

from typing import Sequence

from exporter.derive import collapse
from exporter.samples import Interval
from exporter.store import WindowAggregate, buckets_of
from exporter.store import aggregate_of as _aggregate_of


def aggregate_of(intervals: Sequence[Interval]) -> WindowAggregate:
    """A fresh aggregate over ``intervals`` (oldest first)."""
    return _aggregate_of(intervals)


def collapse_at(intervals: Sequence[Interval], now: float, offload_enabled: bool | None,
                th: collapse.CollapseThresholds = collapse.CollapseThresholds(),
                previous: collapse.CollapseResult | None = None) -> collapse.CollapseResult:
    """The signature at ``now`` from the intervals ended by then: the recent window cut as
    ServerHistory.window cuts it (started inside it), the reference buckets by the store's grid rule."""
    held = [iv for iv in intervals if iv.t1 <= now + 1e-9]
    recent = _aggregate_of(iv for iv in held if iv.t0 >= now - th.recent_seconds - 1e-6)
    start, end = collapse.reference_span(now, th)
    rates = collapse.reference_rates_from_buckets(buckets_of(held, th.recent_seconds, start, end),
                                                  th.recent_seconds)
    return collapse.evaluate_aggregates(recent, rates, now, offload_enabled, th, previous)
