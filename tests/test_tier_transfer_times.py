"""Each offload tier's transfer times (issue 41 item 2; methods.md s14): vLLM 0.32's
``kv_offload_tiering_{read,write}_time{tier}`` (seconds summed over the tier's finished jobs) read into the tier's
read and write bandwidth and its busy seconds per second, s7's kappa_crit with a reload from the tier, and its
lookup delay from vLLM's lookup histograms. Expected values worked by hand."""

from __future__ import annotations

import pytest

from exporter.derive import kappa
from exporter.derive import offload as O
from exporter.samples import Interval
from exporter.sources.expfmt import parse
from exporter.sources.vllm import extract
from tests.support.aggregates import aggregate_of

SECONDS = 20


def interval(t: float, deltas: dict[str, float]) -> Interval:
    return Interval(t0=t, t1=t + 1.0, deltas=deltas, gauges={}, energy_joules={}, idle_joules={})


def timed(t: float, **extra: float) -> Interval:
    """1:fs reads 500 B in 0.25 s of transfer and writes 1,000 B in 2 s (two jobs at once) each second; the CPU
    tier only answers lookups (vLLM counts no bytes for it)."""
    deltas = {"tier_read_bytes@1:fs": 500.0, "tier_read_seconds@1:fs": 0.25, "tier_write_bytes@1:fs": 1000.0,
              "tier_write_seconds@1:fs": 2.0, "tier_chunk_queries@0:primary": 4.0, "tier_chunk_hits@0:primary": 3.0}
    return interval(t, {**deltas, **extra})


def flows(ivs, critical=None) -> dict[str, O.TierFlows]:
    return {f.tier: f for f in O.tier_flows(aggregate_of(ivs), critical=critical)}


def test_bandwidth_is_bytes_per_second_of_transfer_and_busy_is_transfer_seconds_per_second():
    fs = flows([timed(float(t)) for t in range(SECONDS)])["1:fs"]
    assert fs.read_bandwidth_bytes_per_second == pytest.approx(500 / 0.25)  # 2,000 B/s while reading
    assert fs.write_bandwidth_bytes_per_second == pytest.approx(1000 / 2.0)
    assert fs.read_seconds_per_second == pytest.approx(0.25)
    assert fs.write_seconds_per_second == pytest.approx(2.0)  # two writes in flight on average: above 1
    assert fs.transfer_time_reason == ""


def test_kappa_crit_of_a_tier_puts_its_read_and_the_link_in_series():
    # s7's kappa_crit 12 over a 6,000 B/s link; the tier reads at 2,000 B/s: load time per byte 1/2000 + 1/6000,
    # so kappa_crit_t = 12 x 2000 / (2000 + 6000) = 3
    fs = flows([timed(float(t)) for t in range(SECONDS)], critical=(12.0, 6000.0))["1:fs"]
    assert fs.critical_cached_to_prefill == pytest.approx(3.0) and fs.critical_reason == ""
    assert kappa.tier_critical(12.0, 50e9, 50e9) == pytest.approx(6.0)  # a tier as fast as the link: half
    assert kappa.tier_critical(12.0, 50e9, 1e15) == pytest.approx(12.0, rel=1e-4)  # a free tier: the link's


def test_unknown_with_a_reason_where_vllm_reports_no_time_or_no_transfer():
    untimed = [interval(float(t), {"tier_read_bytes@2:p2p": 800.0, "tier_write_bytes@2:p2p": 100.0})
               for t in range(SECONDS)]  # vLLM's p2p tier returns no transfer_time: no _time series
    tiers = flows([timed(float(t)) for t in range(SECONDS)] + untimed, critical=(12.0, 6000.0))
    p2p = tiers["2:p2p"]
    assert p2p.read_bandwidth_bytes_per_second is None and p2p.write_bandwidth_bytes_per_second is None
    assert p2p.read_seconds_per_second is None
    assert "reports no read time" in p2p.transfer_time_reason and "reports no write time" in p2p.transfer_time_reason
    assert p2p.critical_cached_to_prefill is None and "no measured read bandwidth" in p2p.critical_reason
    primary = tiers["0:primary"]  # lookups only: no reads, no bandwidth (never a zero)
    assert primary.read_bandwidth_bytes_per_second is None and "no reads" in primary.transfer_time_reason
    fs = flows([timed(float(t)) for t in range(SECONDS)])["1:fs"]
    assert fs.critical_cached_to_prefill is None and "config.json" in fs.critical_reason


def test_a_window_without_reads_has_no_read_bandwidth_but_a_busy_share_of_zero():
    ivs = [timed(float(t), **{"tier_read_bytes@1:fs": 0.0, "tier_read_seconds@1:fs": 0.0}) for t in range(SECONDS)]
    fs = flows(ivs, critical=(12.0, 6000.0))["1:fs"]
    assert fs.read_bandwidth_bytes_per_second is None and fs.read_seconds_per_second == 0.0
    assert fs.write_bandwidth_bytes_per_second == pytest.approx(500.0)
    assert "no timed reads" in fs.critical_reason


def test_the_adapter_reads_vllms_time_counters_by_tier():
    text = "\n".join([
        "# TYPE vllm:kv_offload_tiering_read_time counter",
        'vllm:kv_offload_tiering_read_time_total{engine="0",model_name="m",tier="1:fs"} 1.5',
        "# TYPE vllm:kv_offload_tiering_write_time counter",
        'vllm:kv_offload_tiering_write_time_total{engine="0",model_name="m",tier="1:fs"} 4.25',
        'vllm:kv_offload_tiering_write_time_total{engine="1",model_name="m",tier="1:fs"} 0.75',
        "# TYPE vllm:generation_tokens counter",
        'vllm:generation_tokens_total{engine="0",model_name="m"} 10',
    ])
    counters = extract(parse(text)).counters
    assert counters["tier_read_seconds@1:fs"] == 1.5
    assert counters["tier_write_seconds@1:fs"] == 5.0  # summed over engines


def test_lookup_delays_are_the_histograms_means_over_the_window():
    """Each second 1:fs resolves 4 lookups blocking 0.0002 s in all, and 2 of them first waited 0.03 s in all on
    its asynchronous lookup: means 5e-5 s and 0.015 s."""
    lookups = {"tier_lookup_seconds_sum@1:fs": 0.0002, "tier_lookup_seconds_count@1:fs": 4.0,
               "tier_lookup_wait_seconds_sum@1:fs": 0.03, "tier_lookup_wait_seconds_count@1:fs": 2.0,
               "tier_lookup_seconds_sum@0:primary": 0.0004, "tier_lookup_seconds_count@0:primary": 4.0}
    tiers = flows([timed(float(t), **lookups) for t in range(SECONDS)])
    fs, primary = tiers["1:fs"], tiers["0:primary"]
    assert fs.lookup_seconds == pytest.approx(5e-5) and fs.lookup_wait_seconds == pytest.approx(0.015)
    assert fs.lookup_reason == ""
    # the CPU tier answers at once: no lookup waited on it (vLLM has no async series for it), unknown with why
    assert primary.lookup_seconds == pytest.approx(1e-4) and primary.lookup_wait_seconds is None
    assert "no lookup waited" in primary.lookup_reason


def test_the_adapter_reads_vllms_lookup_histograms_by_tier():
    text = "\n".join([
        "# TYPE vllm:kv_offload_tiering_lookup_async_delay_seconds histogram",
        'vllm:kv_offload_tiering_lookup_async_delay_seconds_bucket{engine="0",le="+Inf",model_name="m",tier="1:fs"} 3',
        'vllm:kv_offload_tiering_lookup_async_delay_seconds_count{engine="0",model_name="m",tier="1:fs"} 3',
        'vllm:kv_offload_tiering_lookup_async_delay_seconds_sum{engine="0",model_name="m",tier="1:fs"} 0.12',
        "# TYPE vllm:generation_tokens counter",
        'vllm:generation_tokens_total{engine="0",model_name="m"} 10',
    ])
    counters = extract(parse(text)).counters
    assert counters["tier_lookup_wait_seconds_count@1:fs"] == 3.0
    assert counters["tier_lookup_wait_seconds_sum@1:fs"] == 0.12
