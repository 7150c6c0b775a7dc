"""Parse + extract speed on real vLLM expositions: kvwatt's fast path vs prometheus_client's parser.

    .venv/bin/python bench/bench_parse.py

- kvwatt fast: ``VllmAdapter().read(text)`` -- parse only the families the adapter needs (one regex scan in
  C) and extract the reading, process start time included. This is what the daemon runs (in a worker thread).
- kvwatt general: ``extract(parse(text))`` -- the general parser, a Python loop over every line.
- prometheus_client: ``list(text_string_to_metric_families(text))`` -- parsing only, no extraction.
- detect: ``combine.pick(text)`` -- which engine and add-ons an exposition holds, the cost the daemon adds to
  the fast path before reading (sources/combine.py); engines: ``combine.read_exposition`` on each other
  engine's sample frames (tests/data/<engine>/, SGLang, TensorRT-LLM, vLLM + LMCache, Dynamo + KVBM).

Real expositions: every ``*.prom`` under tests/data/vllm-0.32-cpu and ../shared/fixtures (vLLM 0.32). MB/s is
total bytes over total time. The synthetic exposition repeats the real one's ``vllm:`` lines over
data-parallel engines up to 50k series (a big multi-engine server).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from exporter.sources import combine  # noqa: E402
from exporter.sources.expfmt import parse, process_start_time  # noqa: E402
from exporter.sources.vllm import VllmAdapter, extract  # noqa: E402

FIXTURE_DIRS = [REPO / "tests" / "data" / "vllm-0.32-cpu", REPO.parent / "shared" / "fixtures"]
ADAPTER = VllmAdapter()


def fast(text: str):
    return ADAPTER.read(text)


def general(text: str):
    return extract(parse(text), process_start_time(text))


def prometheus_client(text: str):
    return list(text_string_to_metric_families(text))


def per_call_seconds(fn, text: str, min_seconds: float = 0.3, min_calls: int = 3) -> float:
    fn(text)  # warm (regex compilation, caches)
    n, start = 0, time.perf_counter()
    while n < min_calls or time.perf_counter() - start < min_seconds:
        fn(text)
        n += 1
    return (time.perf_counter() - start) / n


def synthetic_exposition(series: int) -> str:
    real = (REPO / "tests" / "data" / "vllm-0.32-cpu" / "low-pressure" / "005.prom").read_text()
    base = [ln for ln in real.split("\n") if ln.startswith("vllm:")]
    out, engine = ["process_start_time_seconds 1.7e9"], 0
    while len(out) < series:
        out += [ln.replace('engine="0"', f'engine="{engine}"') for ln in base]
        engine += 1
    return "\n".join(out[:series]) + "\n"


def engines() -> dict[str, float]:
    """ms per read of each other engine's frames (main exposition and sidecar joined, as the source does)."""
    out = {}
    for engine in ("sglang", "trtllm", "lmcache", "dynamo"):
        frames = sorted((REPO / "tests" / "data" / engine).glob("*/*[0-9].prom"))
        texts = [f.read_text() + (f.with_suffix(".sidecar.prom").read_text()
                                  if f.with_suffix(".sidecar.prom").exists() else "") for f in frames]
        out[engine] = round(sum(per_call_seconds(combine.read_exposition, t, min_seconds=0.1) for t in texts)
                            / len(texts) * 1e3, 3)
    return out


def main() -> dict:
    texts = [p.read_text() for d in FIXTURE_DIRS for p in sorted(d.glob("**/*.prom"))]
    mb = sum(len(t.encode()) for t in texts) / 1e6
    totals = {name: sum(per_call_seconds(fn, t) for t in texts)
              for name, fn in (("fast", fast), ("general", general), ("prometheus_client", prometheus_client))}
    big = synthetic_exposition(50_000)
    big_mb = len(big.encode()) / 1e6
    big_s = {name: per_call_seconds(fn, big, min_seconds=1.0)
             for name, fn in (("fast", fast), ("general", general), ("prometheus_client", prometheus_client))}
    result = {
        "real_expositions": len(texts), "real_mb": round(mb, 3),
        "real_mb_per_s": {k: round(mb / v, 1) for k, v in totals.items()},
        "real_ms_per_exposition": {k: round(v / len(texts) * 1e3, 3) for k, v in totals.items()},
        "fast_vs_prometheus_client": round(totals["prometheus_client"] / totals["fast"], 1),
        "general_vs_prometheus_client": round(totals["prometheus_client"] / totals["general"], 1),
        "synthetic_50k_series_mb": round(big_mb, 2),
        "synthetic_50k_ms": {k: round(v * 1e3, 2) for k, v in big_s.items()},
        "synthetic_50k_detect_ms": round(per_call_seconds(combine.pick, big, min_seconds=1.0) * 1e3, 2),
        "engines_ms_per_exposition": engines(),
    }
    print(f"{'':22}{'fast':>12}{'general':>12}{'prom_client':>14}")
    print(f"{'real MB/s':22}" + "".join(f"{result['real_mb_per_s'][k]:>{w}}" for k, w in
                                       (("fast", 12), ("general", 12), ("prometheus_client", 14))))
    print(f"{'real ms/exposition':22}" + "".join(f"{result['real_ms_per_exposition'][k]:>{w}}" for k, w in
                                                (("fast", 12), ("general", 12), ("prometheus_client", 14))))
    print(f"{'50k series ms':22}" + "".join(f"{result['synthetic_50k_ms'][k]:>{w}}" for k, w in
                                           (("fast", 12), ("general", 12), ("prometheus_client", 14))))
    print(f"50k series: detecting the engine and add-ons {result['synthetic_50k_detect_ms']} ms; other engines, "
          f"ms per read: {result['engines_ms_per_exposition']}")
    print(f"fast path vs prometheus_client: {result['fast_vs_prometheus_client']}x "
          f"({len(texts)} real expositions, {mb:.2f} MB)")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
