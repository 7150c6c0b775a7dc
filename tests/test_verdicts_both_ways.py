"""Verdicts on positive evidence both ways (methods.md s10, docs/pressure.md): a healthy server reaches "below
(known)" and "Nothing to do" without a located threshold; an engine restarted with another KV cache leaves no
rolling window mixing the two engines; a server that is down has unknown verdicts on every screen (/api/status,
/metrics, the page), not the last known ones.

The engine is tests/test_threshold_live.py's scripted EngineReading stream (kvwatt's own keys, as the vLLM adapter
produces them from a real 0.32 exposition, waiting-for-capacity gauge included): the behaviours under test need
pressure levels and outages chosen per second, which no engine can be steered to exactly. The real engine's runs
of the same cases are in the lead's notes (`kvwatt replay`, docs/replay.md)."""

from __future__ import annotations

import re

import pytest

from exporter.samples import EngineInfo, ServerRead, SourceStatus, Tick
from exporter.serve import page
from exporter.serve.collector import render
from exporter.serve.web import status_json
from tests.test_evidence import InfoEngine
from tests.test_page_words import visible_text
from tests.test_threshold_live import WALL, Run, model

DOWN = SourceStatus(source="vllm", server="s", up=False, reason="unreachable: connection refused", duration_seconds=0.0,
                    state="down")


def off_engine(blocks: float = 192.0, started: float = WALL - 3600) -> InfoEngine:
    e = InfoEngine(blocks=blocks)
    e.info = EngineInfo(model_name="m", offload_enabled=False, num_gpu_blocks=blocks, block_size=16.0,
                        process_start_time_seconds=started)
    return e


def down_for(run: Run, seconds: int) -> None:
    for _ in range(seconds):
        run.t += 1.0
        run.m.ingest(Tick(run.t, {"s": ServerRead("s", DOWN, None)}, (), ()))


def metric(text: str, name: str, **labels) -> list[float]:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(name + "{") and all(w in line for w in want)]


def test_a_healthy_server_is_below_known_and_nothing_to_do_without_a_located_threshold(tmp_path):
    # 1-4 sessions on a 192-block cache: KV max ~0.3, nobody waits for KV, no preemption, 7 % recomputed
    run = Run(model(tmp_path), off_engine())
    states = []
    run.seconds(5 * 60, lambda: 0.1 + 0.2 * run.engine.rng.random(), 0.07,
                each=lambda f: states.append((f.regime, f.regime_state)))
    f = run.fig()
    assert f.located is None and f.threshold_source == "configured"  # no pressure seen: nothing to locate
    assert f.regime == "below" and f.regime_state == "known"
    assert f.regime_reason.startswith("below: no preemption, no request waiting for KV capacity, a recompute tax of")
    assert "low pressure for the last" in f.regime_reason and f.evidence.quiet_streak >= 3
    assert f.tax_state == "known" and [a.kind for a in f.advice] == ["nothing_to_do"]
    assert "above" not in {r for r, _ in states}  # never the other answer on the way
    first_known = next(i for i, (r, s) in enumerate(states) if s == "known")
    assert 3 * 60 - 1 <= first_known < 4 * 60  # known as the third clean evidence window closes (t = 180 s)
    st = status_json(run.m.snapshot())["servers"][0]
    assert st["regime"] == "below" and st["regime_state"] == "known"
    assert "Nothing to do" in visible_text(status_json(run.m.snapshot()))
    text = render(run.m.snapshot()).decode()
    assert metric(text, "kvwatt_verdict_state", verdict="regime", state="known") == [1.0]
    assert metric(text, "kvwatt_kv_pressure_regime_state", window="1m", state="known") == [1.0]


def test_busy_at_start_never_says_below_and_keeps_no_clean_window(tmp_path):
    # 128 blocks, 8 sessions, kvwatt started into the load: 3-6 requests wait for KV capacity in every sample,
    # 97 % recomputed, p95 0.76-0.84 under the configured 0.90, a preemption now and then
    run = Run(model(tmp_path), off_engine(128.0))
    run.engine.waiting_capacity = 4.0
    seen = []
    run.seconds(8 * 60, lambda: 0.76 + 0.08 * run.engine.rng.random(), 0.97, preemptions_per_minute=0.4,
                each=lambda f: seen.append(f.regime))
    f = run.fig()
    assert "below" not in seen and f.regime == "above" and f.regime_state == "known"
    assert f.evidence.clean == 0 and f.evidence.pressured == f.evidence.windows == 8
    st = status_json(run.m.snapshot())["servers"][0]
    assert st["windows"]["1m"]["requests_waiting_for_kv_capacity"] == pytest.approx(4.0)
    assert st["windows"]["1m"]["requests_waiting_for_kv_capacity_share"] == 1.0
    words = visible_text(status_json(run.m.snapshot()))
    assert "Requests waiting for KV capacity: 4 on average, in 100.0 % of samples" in words
    assert "under the threshold in use 0.900" in words  # why "above" while the p95 is under 90 %
    assert "KV pressure over the last 1m: requests waiting for KV capacity" in words  # what it rests on, where


def test_an_engine_restarted_with_another_cache_leaves_no_mixed_window(tmp_path):
    run = Run(model(tmp_path, windows=["1m", "5m"]), off_engine(192.0))
    run.engine.waiting_capacity = 3.0
    run.seconds(5 * 60, 0.8, 0.93, preemptions_per_minute=1.0)  # the small cache: 93 % recomputed
    assert run.fig().regime == "above"
    down_for(run, 60)  # the engine restarts: 60 s without /metrics
    f = run.fig()
    assert f.regime == "unknown" and f.regime_state == "unknown" and f.tax_state == "unknown"
    big = off_engine(512.0, started=WALL - 10)
    big.c = dict(run.engine.c)  # counters start again on the new process: re-based, never negative
    run.engine = big
    run.seconds(30, 0.2, 0.06)
    f = run.fig()
    w5 = next(w for w in f.windows if w.window == "5m")
    assert w5.covered_seconds <= 30.0  # only the new engine's 30 s, not "300 of 300 s"
    assert w5.token_shares["local_compute"] == pytest.approx(0.06)  # not a mix with the old 93 %
    assert w5.requests_waiting_for_kv_capacity == 0.0 and not w5.preemptions_per_minute
    assert f.epoch_cause.startswith("engine changed: num_gpu_blocks 192.0 -> 512.0")
    assert f.regime != "above" and not [a for a in f.advice if a.kind == "kv_pressure"]


def test_a_down_server_has_unknown_verdicts_on_every_screen(tmp_path):
    run = Run(model(tmp_path), off_engine(128.0))
    run.engine.waiting_capacity = 5.0
    run.seconds(3 * 60, 0.85, 0.9, preemptions_per_minute=2.0)
    f = run.fig()
    assert f.regime == "above" and f.regime_state == "known"
    down_for(run, 5)
    snap = run.m.snapshot()
    f = snap.servers[0]
    assert f.regime == "unknown" and f.regime_state == "unknown" and f.tax_state == "unknown"
    assert f.regime_reason == "kvwatt cannot read the server (unreachable: connection refused)"
    assert all(w.recompute_tax is None and w.kv_usage_p95 is None and w.above_threshold is None for w in f.windows)
    assert f.collapse is None and [a.kind for a in f.advice] == ["server_down"]
    st = status_json(snap)["servers"][0]
    assert st["regime"] == "unknown" and st["regime_state"] == "unknown" and st["tax_state"] == "unknown"
    assert st["windows"]["1m"]["recompute_tax"] is None and st["windows"]["1m"]["above_threshold"] is None
    text = render(snap).decode()
    assert not metric(text, "kvwatt_kv_pressure_regime_above", server="s")
    assert not metric(text, "kvwatt_recompute_tax_ratio", server="s")
    assert metric(text, "kvwatt_verdict_state", verdict="regime", state="unknown") == [1.0]
    assert metric(text, "kvwatt_verdict_state", verdict="tax", state="unknown") == [1.0]
    words = visible_text(status_json(snap))
    assert "no figure of this server is known" in words and not re.search(r"[+-]\d+\.\d points", words)
    assert "KV pressure: unknown (kvwatt cannot read the server" in words
    assert "exports no step counter" not in words
    assert "Throughput collapse: unknown (kvwatt cannot read the server)" in words
    # a short miss (under the outage length) keeps the windows; the verdicts come back with the reads
    run.seconds(60, 0.85, 0.9, preemptions_per_minute=2.0)
    assert run.fig().regime == "above" and run.fig().windows[0].covered_seconds >= 59.0


def test_windows_restart_after_an_outage_and_coverage_says_so(tmp_path):
    run = Run(model(tmp_path, windows=["1m", "5m"]), off_engine())
    run.seconds(5 * 60, 0.3, 0.07)
    assert next(w for w in run.fig().windows if w.window == "5m").covered_seconds == pytest.approx(299.0)
    down_for(run, 60)
    run.seconds(20, 0.3, 0.07)
    w5 = next(w for w in run.fig().windows if w.window == "5m")
    assert w5.covered_seconds == pytest.approx(19.0)  # no interval spans the 60 s outage
    words = page.windows_table(status_json(run.m.snapshot())["servers"][0])
    assert "19 of 300 s" in words
