"""Daemon footprint: CPU per sample per server and resident memory of a real `kvwatt run` watching
8 servers at 1 s, each serving a real vLLM 0.32 exposition over loopback, scraped every 15 s.

    .venv/bin/python bench/bench_daemon.py [--seconds 60] [--servers 8]

CPU is read from /proc/<pid>/stat of the kvwatt process only (the fake servers run in this process).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import requests  # noqa: E402

from tests.support.daemon import KvwattDaemon  # noqa: E402
from tests.support.httpserver import MetricsServer  # noqa: E402

FIXTURE = REPO / "tests" / "data" / "vllm-0.32-cpu" / "low-pressure" / "005.prom"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--servers", type=int, default=8)
    args = ap.parse_args(argv)
    text = FIXTURE.read_text()
    servers = [MetricsServer(lambda: text) for _ in range(args.servers)]
    for s in servers:
        s.__enter__()
    try:
        with KvwattDaemon(servers={f"s{i}": s.url for i, s in enumerate(servers)}, interval="1s") as d:
            pid = d.proc.pid
            time.sleep(5)  # warm-up: imports, first windows
            c0, t0, r0 = cpu_seconds(pid), time.monotonic(), sum(s.requests for s in servers)
            next_scrape = t0
            while time.monotonic() - t0 < args.seconds:
                if time.monotonic() >= next_scrape:
                    requests.get(d.url + "/metrics", timeout=5)
                    next_scrape += 15
                time.sleep(0.2)
            c1, t1, r1 = cpu_seconds(pid), time.monotonic(), sum(s.requests for s in servers)
            rss = rss_mib(pid)
    finally:
        for s in servers:
            s.__exit__(None, None, None)
    wall, samples = t1 - t0, r1 - r0
    result = {"servers": args.servers, "interval_s": 1.0, "wall_s": round(wall, 1), "samples": samples,
              "cpu_s": round(c1 - c0, 3), "cpu_percent_of_one_core": round(100 * (c1 - c0) / wall, 2),
              "cpu_percent_per_server": round(100 * (c1 - c0) / wall / args.servers, 3),
              "cpu_ms_per_sample": round(1e3 * (c1 - c0) / max(samples, 1), 3), "rss_mib": round(rss, 1)}
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
