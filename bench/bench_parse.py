"""Parse time per real vLLM exposition: kvwatt's parser + extraction vs prometheus_client's parser.

    .venv/bin/python bench/bench_parse.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from exporter.expfmt import parse  # noqa: E402
from exporter.sources.vllm import extract  # noqa: E402

FIXTURE = REPO / "tests" / "data" / "vllm-0.32-cpu" / "low-pressure" / "005.prom"


def per_call_seconds(fn, text: str, min_seconds: float = 1.0) -> float:
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        fn(text)
        n += 1
    return (time.perf_counter() - start) / n


def main() -> dict:
    text = FIXTURE.read_text()
    mb = len(text.encode()) / 1e6
    ours = per_call_seconds(lambda t: extract(parse(t)), text)
    theirs = per_call_seconds(lambda t: list(text_string_to_metric_families(t)), text)
    result = {"exposition_bytes": len(text.encode()), "exposition_lines": text.count("\n"),
              "kvwatt_parse_extract_ms": round(ours * 1e3, 3), "kvwatt_mb_per_s": round(mb / ours, 1),
              "prometheus_client_parse_ms": round(theirs * 1e3, 3),
              "prometheus_client_mb_per_s": round(mb / theirs, 1), "speedup": round(theirs / ours, 1)}
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
