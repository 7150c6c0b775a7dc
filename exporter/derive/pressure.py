"""KV pressure regime (methods.md s3): dense-sample quantiles of KV usage, preemption and token rates."""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from exporter import rules
from exporter.rules.quantile import interpolate_sorted, quantile
from exporter.store import WindowAggregate

__all__ = ["quantile", "kv_usage_quantile", "pools_above_threshold", "above_threshold", "rate_per_second",
           "labelled_per_minute", "preemption_onset", "CapacityWait", "waiting_for_capacity",
           "plausible_preemptions", "preemptions_per_minute", "MAX_STEPS_PER_SECOND"]

MAX_STEPS_PER_SECOND = 1000.0  # engine steps per second when the engine does not count them (1 ms a step)


def kv_usage_quantile(x: WindowAggregate, q: float) -> float | None:
    """Quantile of vllm:kv_cache_usage_perc over the window's dense (tick) samples: PromQL's quantile_over_time,
    rank q x (n - 1) in the sorted samples, linear between its two neighbours (interpolate_sorted)."""
    return interpolate_sorted(x.sorted_gauge("kv_usage"), q)


def pools_above_threshold(x: WindowAggregate, threshold: float) -> int | None:
    """How many KV pools (data-parallel ranks, a router's workers) have a window p95 usage above the threshold;
    None for a server with one pool (its kv_usage p95 says it). ``kv_usage`` is the fullest pool at each tick."""
    pools = x.pools()
    if not pools:
        return None
    return sum(1 for key in pools if (x.quantile(key, 0.95) or 0.0) > threshold)


def above_threshold(p95: float | None, threshold: float) -> bool | None:
    return None if p95 is None else p95 > threshold


def rate_per_second(x: WindowAggregate, key: str) -> float | None:
    """Counter increase per second over the intervals that carry the counter; None without any."""
    seconds = x.seconds_with(key)
    total = x.delta(key)
    if total is None or seconds <= 0:
        return None
    return total / seconds


def labelled_per_minute(agg: WindowAggregate, prefix: str) -> dict[str, float] | None:
    """{label value: increase per minute} of a labelled counter family (sources/engine.py
    LABELLED_COUNTER_KEYS, e.g. admission_rejections by reason); None when the family is not exported."""
    head = prefix + "@"
    out = {k[len(head):]: r * 60.0 for k in agg.keys() if k.startswith(head)
           for r in (rate_per_second(agg, k),) if r is not None}
    return out or None


def plausible_preemptions(agg: WindowAggregate) -> float:
    """The most preemptions a window can hold: each engine step can preempt at most the requests there are
    (running + waiting, at least 1), and there are at most the steps the engine counted (else
    MAX_STEPS_PER_SECOND over the covered seconds). A counter that jumps past it is a glitch, not evidence."""
    requests = max((agg.gauge_max("running") or 0.0) + (agg.gauge_max("waiting") or 0.0), 1.0)
    steps = agg.delta("engine_steps")
    if not steps:
        steps = MAX_STEPS_PER_SECOND * agg.covered_seconds
    return requests * steps


def preemptions_per_minute(agg: WindowAggregate) -> float | None:
    """Preemptions per minute over the window (methods.md s3): the one definition every figure, verdict and
    evidence window reads. None where the counter is not read, or where its increase is implausible for the
    window (plausible_preemptions: a counter glitch is neither a rate nor evidence)."""
    per_second = rate_per_second(agg, "preemptions")
    if per_second is None or (agg.delta("preemptions") or 0.0) > plausible_preemptions(agg):
        return None
    return per_second * 60.0


def preemption_onset(per_minute: float | None, covered: float, window_seconds: float,
                     onset_per_minute: float) -> bool | None:
    """Sustained preemptions (methods.md s3: >= ``preemption_onset_per_minute`` marks onset). "Sustained" = over a
    window at least ``rules.SUSTAINED_MIN_COVERED`` covered, so one burst right after start-up does not count."""
    if per_minute is None or covered < rules.SUSTAINED_MIN_COVERED.default * window_seconds:
        return None
    return per_minute >= onset_per_minute


@dataclass(frozen=True)
class CapacityWait:
    """Requests waiting because the KV cache has no room for them (vLLM's
    ``vllm:num_requests_waiting_by_reason{reason="capacity"}``) over a window's samples: the most direct sign of
    KV pressure the engine exports (methods.md s10)."""

    mean: float | None  # requests waiting for KV capacity, averaged over the window's samples (None: not recorded,
                        # a window read back keeps only its share: pressure_evidence.recorded_evidence)
    share: float        # share of the samples with at least one such request (0..1)
    samples: int | None


def waiting_for_capacity(x: WindowAggregate) -> CapacityWait | None:
    """The window's CapacityWait; None when the engine does not export the gauge (vLLM < 0.20, other engines).
    Read from the gauge's sorted values a distinct value at a time (O(distinct values x log n): the count is a
    small integer), so its cost does not grow with the window's length."""
    s = x.sorted_gauge("waiting_capacity")
    n = len(s)
    if not n:
        return None
    zero = bisect_right(s, 0.0)
    total, i = 0.0, zero
    while i < n:
        v = s[i]
        j = bisect_right(s, v, i)
        total += v * (j - i)
        i = j
    return CapacityWait(total / n, (n - zero) / n, n)
