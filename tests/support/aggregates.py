"""Aggregates for tests that build Intervals by hand: derive functions take an aggregate only, so a list of
intervals goes through ``aggregate_of`` (the store's), and the collapse signature through the same cut the
daemon makes (exporter.model.server.ServerModel._collapse) on a list."""

from __future__ import annotations

from typing import Sequence

from exporter.derive import collapse
from exporter.samples import Interval
from exporter.store import WindowAggregate, buckets_of
from exporter.store import aggregate_of as _aggregate_of
from exporter.store.buckets import EPS, Bucket, bucket_index


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
    rates = collapse.reference_rates_from_buckets(_reference_buckets(held, th.recent_seconds, start, end),
                                                  th.recent_seconds)
    return collapse.evaluate_aggregates(recent, rates, now, offload_enabled, th, previous)


_BUCKETS: dict[tuple, tuple[list[Bucket], list[Interval]]] = {}  # (width, k, its intervals' ids) -> its buckets


def _reference_buckets(held: list[Interval], width: float, start: float, end: float) -> list[Bucket]:
    """``buckets_of(held, width, start, end)``, bucket by bucket: an interval is in the bucket its end falls in, so
    each bucket is buckets_of over its own intervals; one made from the same interval objects before is reused (a
    sweep over a 20-minute run re-added every interval of its 10-minute reference at each step). The cache keeps
    the intervals, so their ids stay theirs."""
    groups: dict[int, list[Interval]] = {}
    for iv in held:
        if iv.t1 > start - width:  # an interval ending earlier lies in no bucket starting at or after ``start``
            groups.setdefault(bucket_index(iv.t1, width), []).append(iv)
    if len(_BUCKETS) > 512:  # a sweep needs its reference span's (~10-20); a fresh list each call needs none
        _BUCKETS.clear()
    out: list[Bucket] = []
    for k in sorted(groups):
        if not (k * width >= start - EPS and (k + 1) * width <= end + EPS):  # not wholly inside [start, end]
            continue
        key = (width, k, tuple(map(id, groups[k])))
        if key not in _BUCKETS:
            _BUCKETS[key] = (buckets_of(groups[k], width), groups[k])
        out += [b for b in _BUCKETS[key][0] if b.t0 >= start - EPS and b.t1 <= end + EPS]
    return out
