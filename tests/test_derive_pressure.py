"""Pure derivations for KV pressure and recomputation, checked against hand calculations."""

import pytest

from exporter.derive import pressure, recompute
from exporter.samples import Interval
from tests.support.aggregates import aggregate_of


def iv(t, deltas=None, gauges=None, dt=1.0):
    return Interval(t0=t - dt, t1=t, deltas=dict(deltas or {}), gauges=dict(gauges or {}))


def test_quantile_matches_promql_linear_interpolation():
    # quantile_over_time(0.95, [1..10]) = 1 + 0.95*9 = 9.55
    assert pressure.quantile([float(v) for v in range(10, 0, -1)], 0.95) == pytest.approx(9.55)
    assert pressure.quantile([0.5], 0.95) == 0.5
    assert pressure.quantile([], 0.95) is None


def test_p95_sees_peaks_that_a_sparse_scrape_would_miss():
    usage = [0.5] * 90 + [0.99] * 10  # 10 s of peak in 100 s of 1 s samples
    ivs = [iv(t + 1, gauges={"kv_usage": u}) for t, u in enumerate(usage)]
    assert pressure.kv_usage_quantile(aggregate_of(ivs), 0.95) == pytest.approx(0.99)
    sparse = ivs[::15]  # what a 15 s scrape sees
    assert pressure.kv_usage_quantile(aggregate_of(sparse), 0.95) < 0.9


def test_above_threshold_is_strict_and_unknown_without_samples():
    assert pressure.above_threshold(0.91, 0.90) is True
    assert pressure.above_threshold(0.90, 0.90) is False
    assert pressure.above_threshold(None, 0.90) is None


def test_rates_use_only_intervals_that_carry_the_counter():
    ivs = [iv(1, {"preemptions": 1}), iv(2, {"preemptions": 0}), iv(3, {})]
    assert pressure.rate_per_second(aggregate_of(ivs), "preemptions") == pytest.approx(0.5)
    assert pressure.rate_per_second(aggregate_of([iv(1, {})]), "preemptions") is None


def test_preemption_onset_needs_a_mostly_covered_window():
    assert pressure.preemption_onset(0.6, covered=60, window_seconds=60, onset_per_minute=0.5) is True
    assert pressure.preemption_onset(0.4, covered=60, window_seconds=60, onset_per_minute=0.5) is False
    assert pressure.preemption_onset(5.0, covered=10, window_seconds=60, onset_per_minute=0.5) is None


def test_token_shares_from_by_source_counters_sum_to_one():
    ivs = [iv(1, {"prompt_local_compute": 8280, "prompt_local_cache_hit": 30720, "prompt_external_kv_transfer": 0})]
    shares = recompute.token_shares(recompute.token_counts(aggregate_of(ivs)))
    assert shares["local_compute"] == pytest.approx(8280 / 39000)
    assert sum(shares.values()) == pytest.approx(1.0)


def test_token_shares_fall_back_to_prefix_cache_counters_before_0_16():
    ivs = [iv(1, {"prefix_queries": 39000, "prefix_hits": 30720})]
    counts = recompute.token_counts(aggregate_of(ivs))
    assert counts == {"local_compute": 8280, "local_cache_hit": 30720, "external_kv_transfer": 0.0}


def test_no_prompt_tokens_means_unknown_shares_not_zero():
    ivs = [iv(1, {"prompt_local_compute": 0, "prompt_local_cache_hit": 0, "prompt_external_kv_transfer": 0})]
    assert recompute.token_shares(recompute.token_counts(aggregate_of(ivs))) is None
    assert recompute.token_counts(aggregate_of([iv(1, {})])) is None


def test_mfu_view_is_unknown_when_the_server_has_mfu_metrics_off():
    on = [iv(1, {"flops": 4e10, "generation_tokens": 100}), iv(2, {"flops": 6e10, "generation_tokens": 100})]
    assert recompute.mfu_view(aggregate_of(on), 200) == (pytest.approx(5e10), pytest.approx(5e8))
    off = [iv(1, {"flops": 0, "generation_tokens": 100})]
    assert recompute.mfu_view(aggregate_of(off), 100) == (None, None)
