"""Daemon footprint: CPU per watched server (% of one core) and RSS of a real `kvwatt run`,
8 servers x 8 H100-cost fake GPUs at 1 s (target < 0.5 % per server, RSS < 60 MB).

    .venv/bin/python bench/bench_daemon.py [--seconds 30] [--servers 8] [--nvml-latency h100]

Each server serves a real vLLM 0.32 exposition over loopback (bench/fixture_servers.py, a child process);
each owns one GPU of the NVML test double (tests/support/fake_nvml, its energy reads cost what an H100's do
unless --nvml-latency says otherwise); Prometheus' scrape every 15 s is played. CPU is read from
/proc/<pid>/stat of the kvwatt process only, after a 5 s warm-up; RSS from /proc/<pid>/status at the end
(VmHWM, the peak, too).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import requests  # noqa: E402
from _support import FixtureServers, cpu_seconds, daemon_servers, fake_gpus, fake_nvml_latency_in_effect, rss_mib, table  # noqa: E402

from tests.support.daemon import KvwattDaemon  # noqa: E402

TARGET_CPU_PERCENT_PER_SERVER = 0.5
TARGET_RSS_MB = 60.0


def hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--servers", type=int, default=8)
    ap.add_argument("--nvml-latency", default="h100", help="the double's energy_read_latency: h100, 0 or ms")
    args = ap.parse_args(argv)
    latency = args.nvml_latency if args.nvml_latency == "h100" else float(args.nvml_latency)
    with tempfile.TemporaryDirectory(prefix="kvwatt-bench-") as tmp, FixtureServers(args.servers) as servers:
        gpus = fake_gpus(tmp, args.servers, latency)
        with KvwattDaemon(servers=daemon_servers(servers.urls), env=gpus.env(), interval="1s") as d:
            pid = d.proc.pid
            time.sleep(5)  # warm-up: imports, NVML init, first windows
            c0, t0, r0 = cpu_seconds(pid), time.monotonic(), sum(servers.counts())
            next_scrape = t0
            while time.monotonic() - t0 < args.seconds:
                if time.monotonic() >= next_scrape:
                    requests.get(d.url + "/metrics", timeout=5)
                    next_scrape += 15
                time.sleep(0.2)
            c1, t1, r1 = cpu_seconds(pid), time.monotonic(), sum(servers.counts())
            rss, hwm = rss_mib(pid), hwm_mib(pid)
            gpu_series = sum(1 for (n, _lab) in d.metrics() if n == "kvwatt_gpu_energy_joules_total")
    wall, samples = t1 - t0, r1 - r0
    cpu_pct = 100 * (c1 - c0) / wall
    result = {"servers": args.servers, "gpus": args.servers, "gpu_series": gpu_series, "interval_s": 1.0,
              "nvml_energy_read_latency": fake_nvml_latency_in_effect() if latency == "h100" else f"{latency} ms",
              "wall_s": round(wall, 1), "samples": samples, "cpu_s": round(c1 - c0, 3),
              "cpu_percent_of_one_core": round(cpu_pct, 2),
              "cpu_percent_per_server": round(cpu_pct / args.servers, 3),
              "cpu_ms_per_sample": round(1e3 * (c1 - c0) / max(samples, 1), 3),
              "rss_mib": round(rss, 1), "rss_peak_mib": round(hwm, 1)}
    print(f"{args.servers} servers x {args.servers} fake GPUs ({gpu_series} exported), interval 1s, scraped every "
          f"15 s; NVML energy read: {result['nvml_energy_read_latency']}")
    print(table([[result["wall_s"], samples, result["cpu_percent_of_one_core"], result["cpu_percent_per_server"],
                  result["cpu_ms_per_sample"], result["rss_mib"], result["rss_peak_mib"]]],
                ["wall s", "samples", "CPU % of a core", "CPU % per server", "CPU ms/sample", "RSS MiB",
                 "peak RSS MiB"]))
    print(f"target: < {TARGET_CPU_PERCENT_PER_SERVER} % of a core per server, RSS < {TARGET_RSS_MB:.0f} MB")
    result["pass"] = {"cpu": result["cpu_percent_per_server"] < TARGET_CPU_PERCENT_PER_SERVER,
                      "rss": rss * 1.048576 < TARGET_RSS_MB}
    return result


if __name__ == "__main__":
    main()
