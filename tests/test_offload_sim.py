"""The offload-ON test doubles: tests/support/vllm_sim.py (expositions) and tests/support/loopback.py (HTTP)."""

from __future__ import annotations

import math

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from exporter.sources.expfmt import parse
from exporter.sources.vllm import extract
from exporter.sources.vllm_names import WIRE_SERIES
from tests.conftest import FIXTURES
from tests.support import vllm_sim as sim
from tests.support.fake_gpus import FakeGpus
from tests.support.loopback import FakeVllm

VERSIONS = ("0.33", "0.32", "0.26", "0.24", "0.17", "0.16", "0.15")


def _fixture_names() -> set[str]:
    """Series names a real vLLM 0.32 engine put on the wire (tests/data/vllm-0.32-cpu)."""
    names = set()
    for f in FIXTURES.rglob("*.prom"):
        names |= {ln.split("{")[0].split(" ")[0] for ln in f.read_text().splitlines() if ln.startswith("vllm:")}
    return names


def _render(builder, version, seconds=30.0):
    eng = sim.SimEngine(builder(version=version))
    eng.advance(seconds)
    return eng, eng.render()


@pytest.mark.parametrize("version", VERSIONS)
def test_exposition_is_valid_and_names_are_real(version):
    _, text = _render(sim.undersized_buffer_on, version)
    fams = list(text_string_to_metric_families(text))  # prometheus_client's own parser accepts it
    assert fams
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("vllm:")}
    unknown = {n for n in names if n not in WIRE_SERIES and n not in _fixture_names()}
    assert not unknown, f"series vLLM never exports: {sorted(unknown)}"


def test_version_gates_follow_the_metric_history():
    _, t33 = _render(sim.undersized_buffer_on, "0.33")
    _, t24 = _render(sim.undersized_buffer_on, "0.24")
    _, t16 = _render(sim.undersized_buffer_on, "0.16")
    _, t15 = _render(sim.undersized_buffer_on, "0.15")
    for series in ("vllm:kv_offload_store_bytes_total", 'vllm:kv_offload_total_bytes_total{engine="0",model_name',
                   "vllm:kv_offload_allocation_failure_total", "vllm:kv_offload_config_info",
                   "vllm:kv_offload_stores_skipped_total"):
        assert series.split("{")[0] in t33
    assert 'transfer_type="GPU_to_CPU"' in t33 and 'transfer_type="CPU_to_GPU"' in t33
    assert "vllm:kv_offload_store_bytes_total" in t24 and "allocation_failure" not in t24
    assert "kv_offload_config_info" not in t24
    assert "vllm:kv_offload_total_bytes_total" in t16 and "kv_offload_store_bytes" not in t16
    assert "prompt_tokens_by_source" in t16 and "prompt_tokens_by_source" not in t15
    assert "vllm:kv_offload" not in t15 and "vllm:prefix_cache_hits_total" in t15


def test_both_offload_spellings_give_the_same_counters():
    eng = sim.SimEngine(sim.undersized_buffer_on())
    eng.advance(20)
    flat = extract(parse(eng.render("0.33"))).counters
    old = extract(parse(eng.render("0.17"))).counters
    assert flat["offload_store_bytes"] == old["offload_store_bytes"] == eng.totals()["offload_store_bytes"]
    assert flat["offload_load_bytes"] == old["offload_load_bytes"] > 0


def test_cache_config_info_says_whether_offloading_is_on():
    on = extract(parse(_render(sim.stable_high_pressure_on, "0.24")[1])).info
    off = extract(parse(_render(sim.low_pressure_off, "0.33")[1])).info
    assert on.offload_enabled is True and on.offload_buffer_bytes == 64 * 2 ** 30
    assert off.offload_enabled is False
    _, text = _render(sim.low_pressure_off, "0.33")
    assert 'kv_offloading_size="None"' in text and 'kv_offloading_backend="native"' in text
    assert 'kv_offloading_size="64.0"' in _render(sim.stable_high_pressure_on, "0.33")[1]


def test_counters_are_monotonic_with_created_and_histograms():
    eng = sim.SimEngine(sim.recovering_on(steady_seconds=20, collapse_seconds=20))
    prev = None
    for _ in range(60):
        eng.advance(1.0)
        tot = eng.totals()
        if prev:
            assert all(tot[k] >= prev[k] for k in tot)
        prev = tot
    text = eng.render()
    assert "vllm:generation_tokens_created" in text
    assert 'vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf"' in text
    assert "vllm:inter_token_latency_seconds_count" in text


def test_rates_and_shares_match_the_phase():
    eng = sim.SimEngine(sim.high_pressure_off())
    eng.advance(300)
    t = eng.totals()
    assert t["generation_tokens"] == pytest.approx(1900 * 300, rel=0.02)
    assert t["preemptions"] == 55  # 11/min over 5 min: the study's 55 per window
    assert t["prompt_local_compute"] / t["prompt_tokens"] == pytest.approx(0.213, abs=0.001)
    assert t["prompt_external_kv_transfer"] == 0  # OFF: nothing is loaded from an offload tier


def test_stable_high_pressure_kv_p95_is_about_093():
    ivs = sim.simulate_intervals(sim.stable_high_pressure_on(), 300)
    from exporter.derive.pressure import kv_usage_quantile
    from exporter.store import aggregate_of
    assert kv_usage_quantile(aggregate_of(ivs), 0.95) == pytest.approx(0.93, abs=0.01)


def test_collapse_phase_power_and_truth():
    scn = sim.collapsing_on(steady_seconds=10)
    eng = sim.SimEngine(scn)
    eng.advance(5)
    assert eng.gpu_power_watts > 400 and not eng.phase.collapsed
    eng.advance(20)
    assert eng.phase.collapsed and abs(eng.gpu_power_watts - 180) <= 2
    assert scn.collapsed_spans() == [(10.0, math.inf, "collapse")]


def test_restart_zeroes_counters_and_moves_created():
    eng = sim.SimEngine(sim.stable_high_pressure_on())
    eng.advance(10)
    created = eng.created
    eng.restart()
    assert eng.totals()["generation_tokens"] == 0 and eng.created > created


def test_multi_engine_split_sums_back():
    from dataclasses import replace
    scn = replace(sim.stable_high_pressure_on(), engines=2)
    eng = sim.SimEngine(scn)
    eng.advance(10)
    reading = extract(parse(eng.render()))
    assert abs(reading.counters["generation_tokens"] - eng.totals()["generation_tokens"]) <= 2
    assert 'engine="1"' in eng.render()


# --- the loopback server --------------------------------------------------------------------------------
def test_fakevllm_serves_metrics_health_and_version():
    with FakeVllm(sim.stable_high_pressure_on(), auto=False) as fv:
        fv.step(5)
        r = requests.get(fv.url + "/metrics", timeout=5)
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        assert extract(parse(r.text)).counters["generation_tokens"] == fv.totals()["generation_tokens"]
        assert requests.get(fv.url + "/health", timeout=5).status_code == 200
        assert requests.get(fv.url + "/version", timeout=5).json()["version"] == "0.33.0"
        assert fv.scrapes == 1


def test_fakevllm_down_modes_and_restart():
    with FakeVllm(sim.stable_high_pressure_on(), auto=False) as fv:
        fv.step(5)
        fv.set_down("500")
        assert requests.get(fv.url + "/metrics", timeout=5).status_code == 500
        fv.set_down("refuse")
        with pytest.raises(requests.ConnectionError):
            requests.get(fv.url + "/metrics", timeout=2)
        fv.set_down(None)
        fv.restart()
        fv.step(1)
        text = requests.get(fv.url + "/metrics", timeout=5).text
        assert extract(parse(text)).counters["generation_tokens"] < 2400 * 2


def test_fakevllm_auto_clock_timeline_and_phase_switch():
    with FakeVllm(sim.restarting_on(steady_seconds=1.0, down_seconds=1.0, quiet_seconds=100), time_scale=2.0) as fv:
        import time
        deadline = time.monotonic() + 5
        while fv.phase != "restarted" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fv.phase == "restarted"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the listener comes back after the down phase
            try:
                r = requests.get(fv.url + "/metrics", timeout=1)
                break
            except requests.ConnectionError:
                time.sleep(0.05)
        assert extract(parse(r.text)).counters["generation_tokens"] == 0  # restarted, idle
        fv.set_phase("steady")
        assert fv.gpu_power_watts() > 400


def test_fakevllm_drives_the_nvml_double(tmp_path):
    gpus = FakeGpus(tmp_path / "gpus.json")
    with FakeVllm(sim.collapsing_on(steady_seconds=10), auto=False) as fv:
        fv.attach_gpu(gpus, "GPU-a")
        fv.step(10)
        import json
        state = json.loads((tmp_path / "gpus.json").read_text())["gpus"][0]
        assert state["energy_mj"] == 1_000_000 + int(fv.gpu_energy_joules() * 1000)
        fv.step(5)
        state = json.loads((tmp_path / "gpus.json").read_text())["gpus"][0]
        assert abs(state["power_mw"] / 1000 - 180) <= 2
        assert fv.gpu_energy_millijoules() == int(fv.gpu_energy_joules() * 1000)
