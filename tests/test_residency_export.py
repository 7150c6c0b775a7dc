"""KV-block residency beyond the derivation (methods.md s11): the per-server sample share in the
configuration, the buffer's residency target (the measured reuse-gap p99 replaces the configured p99 tool-call
latency, and says so), and the figures through ServerModel into /api/status and /metrics."""

from __future__ import annotations

import pytest

from exporter.config import Config, ConfigError, from_mapping
from exporter.figures import ServerFigures, Snapshot, WindowFigures
from exporter.model import offload as offload_figures
from exporter.model.server import ServerModel
from exporter.samples import SourceStatus
from exporter.serve.collector import families
from exporter.serve.web import _window_json
from exporter.sources.vllm import VllmAdapter
from tests.test_residency import DATA

GIB = 2 ** 30


def server(extra: dict | None = None):
    return from_mapping({"servers": [{"name": "a", "url": "http://127.0.0.1:9", **(extra or {})}]}).servers[0]


def test_sample_share_defaults_to_vllms_and_is_checked():
    assert server().kv_cache_metrics_sample == 0.01
    assert server({"kv_cache_metrics_sample": 1.0}).kv_cache_metrics_sample == 1.0
    for bad in (0, 1.5, -0.1, "x"):
        with pytest.raises(ConfigError, match=r"^servers\[0\]\.kv_cache_metrics_sample: "):
            server({"kv_cache_metrics_sample": bad})


def window(seconds, reuse=None, write=1.0 * GIB, residency=10.0):
    return WindowFigures(f"{seconds:g}s", seconds, seconds, offload_write_bytes_per_second=write,
                         offload_buffer_residency_seconds=residency, kv_reuse_gap_seconds=reuse)


def test_buffer_outlasts_the_measured_reuse_gap_p99():
    cfg = Config(p99_tool_latency_seconds=20.0, buffer_headroom=1.5)
    # without residency histograms: the configured p99 tool-call latency (10 s residency < 20 s: undersized)
    b = offload_figures.buffer([window(60), window(300)], 0.0, cfg)
    assert (b.residency_target_seconds, b.residency_target_source) == (20.0, "p99_tool_latency")
    assert b.undersized is True and b.recommended_bytes == pytest.approx(1.0 * GIB * 20.0 * 1.5)
    # the engine measured reuse gaps: the longest window's p99 (5 s) replaces it, and the buffer suffices
    b = offload_figures.buffer([window(60, {"p50": 2.0, "p99": 10.0}), window(300, {"p50": 1.0, "p99": 5.0})],
                               0.0, cfg)
    assert (b.residency_target_seconds, b.residency_target_source) == (5.0, "reuse_gap_p99")
    assert b.undersized is False and b.recommended_bytes == pytest.approx(1.0 * GIB * 5.0 * 1.5)
    assert b.p99_tool_latency_seconds == 20.0  # still the configured value, shown beside it
    b = offload_figures.buffer([window(60, {"p50": 60.0, "p99": 120.0})], 0.0, cfg)
    assert b.undersized is True and "reuse-gap p99 120 s" in offload_figures.recommendations(None, b, cfg)[0]


def model_after_small_cache(sample: float) -> ServerModel:
    cfg = from_mapping({"servers": [{"name": "a", "url": "http://127.0.0.1:9", "kv_cache_metrics_sample": sample}],
                        "windows": ["1m"], "state_dir": "/nonexistent-kvwatt-state", "nvml": False})
    m = ServerModel(cfg.servers[0], cfg)
    ok = SourceStatus(source="vllm", server="a", up=True, reason="", duration_seconds=0.01, state="ok")
    for t, name in ((1.0, "small-cache-000"), (31.0, "small-cache-end")):
        m.read(t, ok, VllmAdapter().read((DATA / f"{name}.prom").read_text()))
    m.learn(31.0)
    return m


def test_server_figures_carry_the_evidence():
    w = model_after_small_cache(1.0).window(31.0, 60.0, {})
    assert w.kv_evictions_per_prompt_block == pytest.approx(270 / (10260 / 32))
    assert w.kv_evicted_blocks_per_second == pytest.approx(270 / 30)
    assert w.residency_evidence == "pressure" and w.kv_before_reuse_yardstick == "p99_tool_latency"
    js = _window_json(w)
    assert js["residency_evidence"] == "pressure" and js["kv_before_reuse_yardstick_seconds"] == 20.0
    assert js["kv_idle_before_evict_seconds"] == {"p50": 1.0, "p99": 2.0}
    # at vLLM's default 1 % the same counts stand for 100 times the evictions, but too few prompt blocks
    w = model_after_small_cache(0.01).window(31.0, 60.0, {})
    assert w.kv_evicted_blocks_per_second == pytest.approx(270 / 30 / 0.01)
    assert w.residency_evidence is None and "too few prompt blocks" in w.residency_evidence_reason


def test_metrics_families_filled():
    w = model_after_small_cache(1.0).window(31.0, 60.0, {})
    snap = Snapshot(0.0, 0.0, (ServerFigures("a", "u", SourceStatus(source="vllm", server="a", up=True, reason="",
                                                                    duration_seconds=0.0, state="ok"), None, 0.9,
                                             None, "none", (w,)),))
    got = {f.name: [(s.labels, s.value) for s in f.samples] for f in families(snap)}
    assert got["kvwatt_kv_block_residency_pressure_evidence"] == [({"server": "a", "window": "1m"}, 1.0)]
    assert got["kvwatt_kv_block_evicted_before_reuse_ratio"] == [
        ({"server": "a", "yardstick": "p99_tool_latency", "window": "1m"}, 1.0)]
    idle = got["kvwatt_kv_block_idle_before_evict_seconds"]
    assert ({"server": "a", "percentile": "p50", "window": "1m"}, 1.0) in idle


def test_page_says_which_residency_the_buffer_must_outlast():
    from exporter.serve.page import _buffer
    b = {"undersized": False, "write_bytes_per_second": GIB, "p99_tool_latency_seconds": 20.0,
         "residency_seconds": 40.0, "store_failures": 0, "recommended_gib": 8, "headroom": 1.5,
         "residency_target_seconds": 5.0, "residency_target_source": "reuse_gap_p99"}
    html = _buffer({"offload_buffer": b, "offload_enabled": True, "offload_buffer_bytes": 32 * GIB})
    assert "reuse-gap p99 it must outlast is 5.0 s" in html and "× KV-block reuse-gap p99 ×" in html
    html = _buffer({"offload_buffer": {**b, "residency_target_seconds": 20.0,
                                       "residency_target_source": "p99_tool_latency"},
                    "offload_enabled": True, "offload_buffer_bytes": 32 * GIB})
    assert "the p99 tool-call latency it must outlast is 20 s" in html and "reuse-gap" not in html
