"""One engine with ``--kv-cache-metrics`` at a 100 % sample, a real `kvwatt run` started before an agentic load,
and what both said (issue "verdicts an operator can trust", check (b)): tests/test_verdict_before_load_engine.py
and bench/verdict_before_load.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from exporter.sources.expfmt import parse
from exporter.sources.vllm import extract
from tests.support.daemon import KvwattDaemon
from tests.support.engine import KV_CACHE_METRICS, VllmEngine

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "tests" / "data" / "office_work_8k.sample.jsonl"
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
FLAGS = KV_CACHE_METRICS
MAX_MODEL_LEN = 2048
TOLERANCE = 0.05  # the issue's acceptance: tax within +-0.05 of the engines' share difference


def counters(engine: VllmEngine) -> dict[str, float]:
    return extract(parse(engine.metrics_text())).counters


def share_of(before: dict[str, float], after: dict[str, float]) -> float | None:
    """local_compute share of the prompt tokens between two counter readings (methods.md s4)."""
    delta = {s: after.get(f"prompt_{s}", 0.0) - before.get(f"prompt_{s}", 0.0) for s in SOURCES}
    total = sum(delta.values())
    return delta["local_compute"] / total if total > 0 else None


def replay(engine: VllmEngine, concurrency: int, seconds: int, out: Path, label: str) -> subprocess.Popen:
    """The same workload for both engines: same trace, seed, scales and duration."""
    cmd = [sys.executable, "-m", "exporter", "replay", str(TRACE), "--url", engine.url,
           "--concurrency", str(concurrency), "--duration", f"{seconds}s", "--seed", str(concurrency),
           "--length-scale", "0.05", "--latency-scale", "0.1", "--max-context", str(MAX_MODEL_LEN - 48),
           "--no-progress", "--summary", str(out / f"summary-{label}.json")]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(out / f"replay-{label}.log", "w"))


def row(t: float, s: dict) -> dict:
    w1, w5 = s["windows"].get("1m") or {}, s["windows"].get("5m") or {}
    return {"t": round(t, 1), "residency_evidence": w1.get("residency_evidence"),
            "evictions_per_prompt_block": w1.get("kv_evictions_per_prompt_block"), "kv_p95": w1.get("kv_usage_p95"),
            "preemptions_per_minute": w1.get("preemptions_per_minute"),
            "share_1m": (w1.get("prompt_token_shares") or {}).get("local_compute"),
            "tax_1m": w1.get("recompute_tax"), "tax_5m": w5.get("recompute_tax"),
            "share_5m": (w5.get("prompt_token_shares") or {}).get("local_compute"),
            "reference": s["reference_local_compute_share"], "reference_state": s["reference_state"],
            "reference_windows": s["reference_windows"], "tax_state": s["tax_state"], "tax_reason": s["tax_reason"],
            "regime": s["regime"], "regime_reason": s["regime_reason"], "evidence": s["evidence"]}


def phase(model_dir: str, label: str, blocks: int, concurrency: int, load_seconds: int, out: Path,
          threshold_window: str, reference: float | None = None, engine: VllmEngine | None = None) -> dict:
    """One engine (``engine``, a shared one already running with ``FLAGS`` and ``blocks``, or else one started
    here), one kvwatt started before the load, the load, and what both said."""
    t0 = time.monotonic()
    if engine is not None:
        return _watch(engine, label, concurrency, load_seconds, out, threshold_window, reference, t0, blocks)
    with VllmEngine(model_dir, num_gpu_blocks=blocks, max_model_len=MAX_MODEL_LEN, extra_args=FLAGS,
                    log_path=out / f"engine-{label}.log") as engine:
        return _watch(engine, label, concurrency, load_seconds, out, threshold_window, reference, t0, blocks)


def _watch(engine: VllmEngine, label: str, concurrency: int, load_seconds: int, out: Path, threshold_window: str,
           reference: float | None, t0: float, blocks: int) -> dict:
    started = time.monotonic() - t0
    server = {"url": engine.url, "kv_cache_metrics_sample": 1.0}
    if reference is not None:
        server["reference_local_compute_share"] = reference
    config = {"windows": ["1m", "5m"], "threshold_window": threshold_window}
    with KvwattDaemon(servers={label: server}, interval="250ms", config=config) as d:
        d.wait_for(lambda d: d.value("kvwatt_window_covered_seconds", server=label, window="1m"),
                   what="first interval")
        before = counters(engine)
        load_start = time.monotonic()
        proc = replay(engine, concurrency, load_seconds, out, label)
        rows = []
        with open(out / f"status-{label}.jsonl", "w") as timeline:
            while proc.poll() is None:
                rows.append(row(time.monotonic() - load_start, d.status()["servers"][0]))
                timeline.write(json.dumps(rows[-1]) + "\n")
                time.sleep(2.0)
            time.sleep(1.0)  # the last scrape of the load's counters
            final = row(time.monotonic() - load_start, d.status()["servers"][0])
            timeline.write(json.dumps(final) + "\n")
        after = counters(engine)
        shutil.copy(d.log_path, out / f"kvwatt-{label}.log")
    first_ref = next((r["t"] for r in rows if r["reference"] is not None), None)
    first_pressure = next((r["t"] for r in rows if r["residency_evidence"] == "pressure"), None)
    kinds = sorted({str(r["residency_evidence"]) for r in rows})
    return {"label": label, "blocks": blocks, "engine_start_seconds": round(started, 1),
            "load_seconds": round(final["t"], 1), "replay_exit": proc.returncode,
            "engine_local_compute_share": share_of(before, after),
            "engine_prompt_tokens": sum(after.get(f"prompt_{s}", 0.0) - before.get(f"prompt_{s}", 0.0)
                                        for s in SOURCES),
            "engine_preemptions": after.get("preemptions", 0.0) - before.get("preemptions", 0.0),
            "residency_evidence_seen": kinds, "first_reference_after_seconds": first_ref,
            "first_pressure_evidence_after_seconds": first_pressure, "final": final,
            "elapsed_seconds": round(time.monotonic() - t0, 1)}
