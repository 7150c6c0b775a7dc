"""Cost of each form of /metrics per tick: the text format (rendered with every tick), OpenMetrics and gzip (on
the first scrape that asks, then kept with the tick), a cached scrape's lookup, a ``name[]`` subset; 8 and
32 servers after 10 minutes of 1 s ticks.

    .venv/bin/python bench/bench_exposition.py [--seconds 600] [--measure 30] [--servers 8,32]

In-process, no I/O, the synthetic workload of bench_derive.py. Per tick: the families collected once
(exporter.serve.collector: the catalog's and the process' process_*/python_*), then exporter.serve.exposition.Exposition
(the text format), then each other form once, as a Prometheus scraping every tick would cost (it asks for
OpenMetrics, gzipped). Thread CPU time, medians over --measure ticks.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _support import percentile, table  # noqa: E402
from bench_derive import CLOCK, SHORT, Case  # noqa: E402

from exporter.serve.collector import families, runtime_families  # noqa: E402
from exporter.serve.exposition import Exposition  # noqa: E402

PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
                     "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")  # what Prometheus 2.42 sends


def measure_tick(case: Case) -> dict[str, float]:
    case.step()
    snap, t = case.snap, [CLOCK()]

    def lap() -> None:
        t.append(CLOCK())
    fams = families(snap) + runtime_families()
    lap()
    e = Exposition(fams)
    lap()
    e.serve(PROMETHEUS_ACCEPT, None, None)
    lap()
    e.serve(PROMETHEUS_ACCEPT, "gzip", None)
    lap()
    for _ in range(100):
        assert e.cached(PROMETHEUS_ACCEPT, "gzip", None) is not None
    lap()
    e.serve(None, None, {"kvwatt_source_up", "process_cpu_seconds_total"})
    lap()
    ms = [(b - a) * 1e3 for a, b in zip(t, t[1:])]
    return {"collect_ms": ms[0], "text_ms": ms[1], "openmetrics_ms": ms[2], "gzip_ms": ms[3],
            "cached_us": ms[4] * 10, "name_filter_ms": ms[5], "text_bytes": len(e.text),
            "om_gzip_bytes": len(e.cached(PROMETHEUS_ACCEPT, "gzip", None).body)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=int, default=600, help="history to fill before measuring (1 s ticks)")
    ap.add_argument("--measure", type=int, default=30, help="ticks timed after the fill")
    ap.add_argument("--servers", default="8,32")
    args = ap.parse_args(argv)
    results, rows = {}, []
    with tempfile.TemporaryDirectory(prefix="kvwatt-bench-") as tmp:
        for n in (int(x) for x in args.servers.split(",")):
            case = Case(n, SHORT, tmp)
            case.fill(args.seconds)
            ticks = [measure_tick(case) for _ in range(args.measure)]
            med = {k: round(percentile([x[k] for x in ticks], 50), 3) for k in ticks[0]}
            results[n] = med
            rows.append([n, *med.values()])
    print(f"thread CPU, medians over {args.measure} ticks ({args.seconds} s of history, windows 1m,5m)")
    print(table(rows, ["servers", "collect ms", "text ms", "OpenMetrics ms", "gzip ms", "cached lookup us",
                       "name[] ms", "text bytes", "OM gzip bytes"]))
    return results


if __name__ == "__main__":
    main()
