"""Samples per second of each healthy server while one extra server is blackholed (accepts, never answers),
8 servers x 8 fake GPUs at 1 s (target 1.0/s each).

    .venv/bin/python bench/bench_blackhole.py [--seconds 30] [--servers 8] [--no-control]

A real `kvwatt run` watches the 8 fixture servers plus one TCP listener that accepts connections and never
answers (http_timeout 2 s, the default); the servers (bench/fixture_servers.py, a child process) count the
requests they answer, so a server's rate is its answered requests over the measured span. A control run
without the blackhole (--seconds/3) is done first, so the two can be compared. The daemon's own view (its
kvwatt_source_up and kvwatt_sample_duration_seconds) is read at the end.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _support import FixtureServers, daemon_servers, fake_gpus, fake_nvml_latency_in_effect, table  # noqa: E402

from tests.support.daemon import KvwattDaemon  # noqa: E402


def run(tmp: str, count: int, blackholes: int, seconds: float) -> dict:
    gpus = fake_gpus(tmp, count)
    with FixtureServers(count, blackholes) as servers, \
            KvwattDaemon(servers=daemon_servers(servers.urls, servers.blackhole_urls), env=gpus.env(),
                         interval="1s") as d:
        time.sleep(4)  # warm-up (and the blackholed read is in flight by now)
        c0, t0 = servers.counts(), time.monotonic()
        time.sleep(seconds)
        c1, t1 = servers.counts(), time.monotonic()
        m = d.metrics()
    span = t1 - t0
    rates = [(b - a) / span for a, b in zip(c0, c1)]

    def val(name, server, source="vllm"):
        for (n, lab), v in m.items():
            if n == name and ("server", server) in lab and ("source", source) in lab:
                return v
        return None

    return {"span_s": round(span, 2), "rates": [round(r, 3) for r in rates], "min_rate": round(min(rates), 3),
            "mean_rate": round(sum(rates) / len(rates), 3),
            "sample_duration_ms": {f"s{i}": round(1e3 * (val("kvwatt_sample_duration_seconds", f"s{i}") or 0), 2)
                                   for i in range(count)},
            "blackholed": {f"b{i}": {"up": val("kvwatt_source_up", f"b{i}"),
                                     "sample_duration_s": val("kvwatt_sample_duration_seconds", f"b{i}")}
                           for i in range(blackholes)}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--servers", type=int, default=8)
    ap.add_argument("--no-control", action="store_true", help="skip the run without a blackhole")
    args = ap.parse_args(argv)
    result: dict = {"servers": args.servers, "interval_s": 1.0, "http_timeout_s": 2.0,
                    "nvml_energy_read_latency": fake_nvml_latency_in_effect()}
    with tempfile.TemporaryDirectory(prefix="kvwatt-bench-") as tmp:
        if not args.no_control:
            result["control"] = run(tmp, args.servers, 0, args.seconds / 3)
        result["blackholed"] = run(tmp, args.servers, 1, args.seconds)
    rows = []
    for key in ("control", "blackholed"):
        if key in result:
            r = result[key]
            rows.append([key, r["span_s"], r["min_rate"], r["mean_rate"], max(r["rates"]),
                         max(r["sample_duration_ms"].values())])
    print(f"{args.servers} healthy servers x {args.servers} fake GPUs at 1s; NVML energy read: "
          f"{result['nvml_energy_read_latency']}")
    print(table(rows, ["run", "span s", "min samples/s", "mean samples/s", "max samples/s",
                       "max last read ms"]))
    print("per server (blackholed run):", result["blackholed"]["rates"])
    print("blackholed server as the daemon sees it:", result["blackholed"]["blackholed"])
    print("target: 1.0 samples/s per healthy server")
    result["pass"] = result["blackholed"]["min_rate"] >= 0.95
    return result


if __name__ == "__main__":
    main()
