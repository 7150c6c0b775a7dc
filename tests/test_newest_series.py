"""Issue 14, "vLLM, newest series": cached prompt tokens by tier, preemptions per request, admission
rejections, vLLM's tiering (per secondary tier) and the SimpleCPU connector, from expositions built from
vLLM 0.32.0's own metric definitions (tests/data/vllm-0.32-definitions/README.md) and from the real CPU
engine's captures; hand-computed figures, then the same through a real `kvwatt run` on loopback."""

from __future__ import annotations

from pathlib import Path

import pytest

from exporter.derive import offload, preemption, pressure, recompute
from exporter.samples import Interval
from exporter.sources.vllm import VllmAdapter
from exporter.store import ServerHistory
from tests.conftest import FIXTURES
from tests.support.aggregates import aggregate_of
from tests.support.daemon import KvwattDaemon
from tests.support.loopback import MetricsServer

DEFS = Path(__file__).resolve().parent / "data" / "vllm-0.32-definitions"
MIB = 2 ** 20


def window(prefix: str, seconds: float = 10.0):
    """The window over two captures read ``seconds`` apart, through the adapter and the store (its aggregate)."""
    hist = ServerHistory(600)
    for i, t in enumerate((0.0, seconds)):
        hist.add_reading(t, VllmAdapter().read((DEFS / f"{prefix}-00{i}.prom").read_text()))
    return hist.aggregate(seconds)


# --- cached prompt tokens by tier -----------------------------------------------------------------------------
def test_cached_tokens_by_tier_tell_host_from_disk():
    shares = recompute.cached_tier_shares(window("tiering"))
    assert shares == pytest.approx({"device": 0.6, "host": 0.3, "disk": 0.1, "p2p": 0.0, "external": 0.0})


def test_cached_tokens_by_tier_on_the_real_engine():
    """The real 0.32 CPU engine: every cached token came from the device (no offload tier here)."""
    hist = ServerHistory(600)
    for t, name in enumerate(("000", "005")):
        hist.add_reading(float(t), VllmAdapter().read((FIXTURES / "low-pressure" / f"{name}.prom").read_text()))
    assert recompute.cached_tier_shares(hist.aggregate(600))["device"] == 1.0


def test_no_cached_tokens_no_shares():
    iv = Interval(t0=0, t1=1, deltas={"prompt_cached_device": 0.0, "prompt_cached_host": 0.0}, gauges={},
                  energy_joules={}, idle_joules={})
    assert recompute.cached_tier_shares(aggregate_of([iv])) is None
    assert recompute.cached_tier_shares(aggregate_of([Interval(t0=0, t1=1, deltas={"generation_tokens": 5.0}, gauges={},
                                                               energy_joules={}, idle_joules={})])) is None


# --- preemptions per request ----------------------------------------------------------------------------------
def hist_interval(n, s, cum, bounds=(1, 2, 3, 4, 5, 10, 20)):
    deltas = {"preemption_hist_count": n, "preemption_hist_sum": s}
    deltas.update({f"preemption_hist_le@{float(b)}": c for b, c in zip(bounds, cum)})
    deltas["preemption_hist_le@+Inf"] = n
    return aggregate_of([Interval(t0=0, t1=1, deltas=deltas, gauges={}, energy_joules={}, idle_joules={})])


def test_preemptions_per_request_hand_computed():
    # 16 never, 2 once, 1 twice, 1 three times: the unit-wide buckets 2 and 3 pin the tail's 5 preemptions,
    # so the once-preempted are 7 - 5 = 2 and the share is exactly 4/20
    h = preemption.histogram(window("tiering"))
    assert h == (20.0, 7.0, [(1.0, 18.0), (2.0, 19.0), (3.0, 20.0), (4.0, 20.0), (5.0, 20.0), (10.0, 20.0),
                             (20.0, 20.0)])
    assert preemption.preempted_share(h) == pytest.approx({"lower": 0.2, "upper": 0.2})
    assert preemption.quantiles(h) == {"p50": 0.0, "p99": 3.0}  # at most 20 % preempted: the median is 0


def test_preempted_share_bounds_when_the_tail_is_coarse():
    # 10 requests: 6 in le=1, 4 in (5, 10]; sum 30. The tail holds 4 x 6 .. 4 x 10 = 24 .. 40 preemptions,
    # so the once-preempted are 0 .. 6 -> share in [0.4, 1.0]
    h = preemption.histogram(hist_interval(10, 30, [6, 6, 6, 6, 6, 10, 10]))
    assert preemption.preempted_share(h) == pytest.approx({"lower": 0.4, "upper": 1.0})
    assert preemption.quantiles(h) == {"p50": 1.0, "p99": 10.0}  # upper bucket edges, never 0.5 preemptions


def test_a_zero_bucket_gives_the_share_exactly():
    h = preemption.histogram(hist_interval(10, 9, [7, 9, 10, 10], bounds=(0, 1, 2, 3)))
    assert preemption.preempted_share(h) == {"lower": 0.3, "upper": 0.3}


def test_beyond_the_largest_bucket_the_quantile_is_unknown():
    h = preemption.histogram(hist_interval(10, 300, [0, 0, 0, 0, 0, 0, 0]))  # every request > 20 times
    assert preemption.quantiles(h) is None
    assert preemption.preempted_share(h) == {"lower": 1.0, "upper": 1.0}


def test_no_finished_request_no_histogram():
    assert preemption.histogram(hist_interval(0, 0, [0] * 7)) is None
    # deltas that are no histogram (a family re-based apart from the others): nothing, never a share < 0
    assert preemption.histogram(hist_interval(2, 0, [5, 5, 5, 5, 5, 5, 5])) is None
    assert preemption.histogram(hist_interval(5, 0, [3, 2, 5, 5, 5, 5, 5])) is None
    assert preemption.quantiles(None) is None and preemption.preempted_share(None) is None


# --- admission rejections, preemptions by reason -------------------------------------------------------------
def test_admission_rejections_per_minute():
    per_minute = pressure.labelled_per_minute(window("tiering"), "admission_rejections")
    assert per_minute == {"max_num_queued_reqs": 30.0, "max_num_queued_tokens": 0.0}


def test_preemptions_by_reason_per_minute():
    per_minute = pressure.labelled_per_minute(window("tiering"), "preemptions_by_reason")
    assert per_minute == {"kv_full": 30.0, "priority": 12.0, "prefix_cache_reset": 0.0}
    assert pressure.labelled_per_minute(window("simple-cpu"), "preemptions_by_reason") is None  # not exported


# --- tiering: per secondary tier --------------------------------------------------------------------------------
def test_tier_flows_hand_computed():
    fs, obj = offload.tier_flows(window("tiering"))
    assert fs.tier == "1:fs" and obj.tier == "2:obj"
    assert fs.write_bytes_per_second == 1.0 * MIB and fs.read_bytes_per_second == 0.2 * MIB
    assert fs.chunk_hit_ratio == 0.75 and fs.job_failures == 2 and fs.undersized is True
    assert obj.write_bytes_per_second == 0.1 * MIB and obj.read_bytes_per_second == 0.0
    assert obj.chunk_hit_ratio is None  # no lookup in the window: no ratio, not 0
    assert obj.job_failures == 0 and obj.undersized is False


def test_tier_residency_from_the_configured_capacity():
    # 1:fs: 60 MiB / (1 MiB/s) = 60 s >= 20 s, but a cascade job failed: undersized all the same;
    # 2:obj: 1 MiB / (0.1 MiB/s) = 10 s < 20 s: undersized by residency alone
    fs, obj = offload.tier_flows(window("tiering"), {"1:fs": 60 * MIB, "2:obj": 1 * MIB}, 20.0)
    assert fs.residency_seconds == 60.0 and fs.undersized is True
    assert obj.residency_seconds == 10.0 and obj.undersized is True
    fs, obj = offload.tier_flows(window("tiering"), {"2:obj": 4 * MIB}, 20.0)
    assert fs.residency_seconds is None and obj.residency_seconds == 40.0 and obj.undersized is False


def test_cpu_cache_usage_is_never_buffer_fullness():
    """vllm:kv_offload_cpu_cache_usage_perc is the share pinned by in-flight transfers (vLLM #45737), not
    occupancy: at 1.0 it must change nothing kvwatt reads."""
    text = (DEFS / "tiering-001.prom").read_text()
    pinned_line = 'vllm:kv_offload_cpu_cache_usage_perc{engine="0",model_name="m"} 1.0'
    assert pinned_line in text
    with_series = VllmAdapter().read(text)
    without = VllmAdapter().read(text.replace(pinned_line + "\n", ""))
    assert with_series == without
    assert not any("usage" in k for k in with_series.gauges if k != "kv_usage")


def test_simple_cpu_connector_dropped_stores_make_the_buffer_undersized():
    ivs = window("simple-cpu")
    assert offload.store_failures(ivs) == 6
    assert offload.undersized(None, None, offload.store_failures(ivs), 20.0) is True
    reading = VllmAdapter().read((DEFS / "simple-cpu-001.prom").read_text())
    assert "offload_failures" in reading.capabilities and "offload_buffer" not in reading.capabilities


def test_requests_waiting_for_kv_by_stage():
    gauges = VllmAdapter().read((DEFS / "tiering-001.prom").read_text()).gauges
    assert {k: v for k, v in gauges.items() if k.startswith("kv_fetch@")} == {
        "kv_fetch@waiting_to_start": 0.0, "kv_fetch@in_progress": 3.0, "kv_fetch@completed_waiting": 0.0}


def test_capabilities_of_the_newest_series():
    caps = VllmAdapter().read((DEFS / "tiering-001.prom").read_text()).capabilities
    assert {"offload_tiers", "cached_by_tier", "preemptions_per_request", "engine_steps"} <= caps


# --- the same through a real daemon on loopback -------------------------------------------------------------
def test_figures_through_a_daemon():
    texts = [(DEFS / f"tiering-00{i}.prom").read_text() for i in (0, 1)]
    state = {"i": 0}
    with MetricsServer(lambda: texts[state["i"]]) as srv:
        # reads opt-in families
        with KvwattDaemon(servers={"t": srv.url}, interval="250ms",
                          config={"windows": ["1m"], "metrics_opt_in": ["all"]}) as d:
            d.wait_for(lambda d: d.value("kvwatt_window_covered_seconds", server="t", window="1m"),
                       what="a first interval")
            state["i"] = 1
            d.wait_for(lambda d: d.value("kvwatt_offload_tier_job_failures", server="t", tier="1:fs",
                                         window="1m") == 2, what="the second capture")
            m = d.metrics()

            def v(name, **labels):  # from the one scrape ``m``: the window slides between scrapes
                want = {("server", "t"), ("window", "1m"), *labels.items()}
                (value,) = [x for (n, lab), x in m.items() if n == name and want <= lab]
                return value
            covered = v("kvwatt_window_covered_seconds")
            assert v("kvwatt_cached_prompt_token_share_ratio", tier="host") == pytest.approx(0.3)
            assert v("kvwatt_cached_prompt_token_share_ratio", tier="disk") == pytest.approx(0.1)
            assert v("kvwatt_preemptions_per_request", percentile="p99") == 3.0
            assert v("kvwatt_preempted_requests_ratio", bound="lower") == pytest.approx(0.2)
            assert v("kvwatt_offload_tier_undersized", tier="1:fs") == 1
            assert v("kvwatt_offload_tier_undersized", tier="2:obj") == 0
            assert v("kvwatt_offload_tier_chunk_hit_ratio", tier="1:fs") == 0.75
            # the 10 MiB landed within the covered seconds (every interval carries the counter)
            assert v("kvwatt_offload_tier_write_bytes_per_second", tier="1:fs") == pytest.approx(10 * MIB / covered,
                                                                                                  rel=1e-6)
            assert not [k for k in m if k[0] == "kvwatt_offload_tier_chunk_hit_ratio" and
                        ("tier", "2:obj") in k[1]]  # unknown, absent
            assert d.value("kvwatt_requests_in_kv_fetch", server="t", stage="in_progress") == 3
            status = next(s for s in d.status()["servers"] if s["server"] == "t")
            w = status["windows"]["1m"]
            assert w["offload_tiers"]["1:fs"]["job_failures"] == 2
            assert w["preempted_requests_share"] == pytest.approx({"lower": 0.2, "upper": 0.2})


@pytest.mark.parametrize("value, words", [({"1:fs": -1}, "must be > 0"), ([1], "mapping of tier label"),
                                          ({"1:fs": "big"}, "1:fs")])
def test_bad_tier_capacity_is_refused_with_its_key(value, words):
    from exporter.config import ConfigError, from_mapping
    with pytest.raises(ConfigError) as e:
        from_mapping({"servers": [{"name": "a", "url": "http://127.0.0.1:1", "offload_tier_bytes": value}]})
    assert "servers[0].offload_tier_bytes" in str(e.value) and words in str(e.value)
