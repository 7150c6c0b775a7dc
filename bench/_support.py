"""Shared helpers for the daemon benchmarks (not a benchmark itself: run_all only runs bench_*.py).

- ``FixtureServers``: N loopback vLLM servers (tests/support/loopback.MetricsServer serving the vLLM 0.32
  fixture) plus optional blackholed ones, in a child process (bench/fixture_servers.py) so they never share
  a GIL with the process being measured; ``counts()`` gives each server's request count.
- ``fake_gpus``: the NVML test double's state with N GPUs whose energy reads cost what an H100's do.
- ``scrape``: the external load/probe (bench/scraper.py, also a child process).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

FIXTURE = REPO / "tests" / "data" / "vllm-0.32-cpu" / "low-pressure" / "005.prom"


def percentile(xs, q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]; nan for no data."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = max(0, min(len(xs) - 1, math.ceil(q / 100 * len(xs)) - 1))
    return xs[k]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pss_mib(pid: int) -> float:
    """Proportional set size: the process' private pages plus its share of the pages it shares (the shared
    libraries' code, mapped by every process): summed over processes, what they take of the node's memory
    without counting a shared page twice, as the RSS' sum does."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class FixtureServers:
    """``count`` healthy servers + ``blackholes`` TCP listeners that accept and never answer, in a child."""

    def __init__(self, count: int, blackholes: int = 0, fixture: Path = FIXTURE) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HERE / "fixture_servers.py"), "--count", str(count),
                                      "--blackholes", str(blackholes), "--fixture", str(fixture)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        hello = json.loads(self.proc.stdout.readline())
        self.urls: list[str] = hello["urls"]
        self.blackhole_urls: list[str] = hello["blackholes"]
        self.pid = self.proc.pid

    def counts(self) -> list[int]:
        """Requests each healthy server has answered so far (the daemon only ever asks for /metrics)."""
        self.proc.stdin.write("counts\n")
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "FixtureServers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fake_gpus(directory: str, count: int, latency: object = "h100"):
    """FakeGpus state with ``count`` counter GPUs (index i goes to server s<i>); ``latency`` is the double's
    ``energy_read_latency`` ("h100" = realistic, the default; 0 = free; or milliseconds)."""
    from tests.support.fake_gpus import FakeGpus

    gpus = FakeGpus(Path(directory) / "gpus.json", energy_read_latency=latency)
    t0 = time.monotonic()
    for i in range(count):
        gpus.add(f"GPU-{i:08d}-bench", energy_mj=1_000_000 * (i + 1), power_mw=300_000,
                 counter_follows_power=True, t0=t0)
    return gpus


def fake_nvml_latency_in_effect() -> str:
    """Which energy-read cost the NVML double applies (it may predate the latency knob)."""
    from tests.support.fake_gpus import load_fake_nvml

    mod = load_fake_nvml()
    if not hasattr(mod, "energy_read_latency_seconds"):
        return "none (this version of the double has no energy_read_latency knob: reads are free)"
    return (f"h100 (lognormal, median {mod.H100_ENERGY_MEDIAN_SECONDS * 1e3:.1f} ms, "
            f"p90 {mod.H100_ENERGY_P90_SECONDS * 1e3:.1f} ms, max {mod.H100_ENERGY_MAX_SECONDS * 1e3:.0f} ms)")


def daemon_servers(urls: list[str], blackhole_urls: list[str] = ()) -> dict[str, dict]:
    """KvwattDaemon ``servers``: s<i> owns GPU i; blackholed servers (b<i>) own none."""
    out = {f"s{i}": {"url": u, "gpus": [i]} for i, u in enumerate(urls)}
    out.update({f"b{i}": {"url": u, "gpus": []} for i, u in enumerate(blackhole_urls)})
    return out


def scrape(base_url: str, seconds: float, metrics_hz: float = 10.0, healthz_hz: float = 20.0) -> dict:
    """Run bench/scraper.py in a child process; returns its latencies (ms) per path."""
    out = subprocess.run([sys.executable, str(HERE / "scraper.py"), base_url, str(seconds), str(metrics_hz),
                          str(healthz_hz)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def start_scrape(base_url: str, seconds: float, metrics_hz: float = 10.0,
                 healthz_hz: float = 20.0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE / "scraper.py"), base_url, str(seconds), str(metrics_hz),
                             str(healthz_hz)], stdout=subprocess.PIPE, text=True)


def start_canary(seconds: float) -> subprocess.Popen:
    """bench/canary.py in a child: ``json.loads(p.communicate()[0])`` gives its sleep overshoots (ms)."""
    return subprocess.Popen([sys.executable, str(HERE / "canary.py"), str(seconds)], stdout=subprocess.PIPE,
                            text=True)


def summary(ms: list[float]) -> dict:
    return {"n": len(ms), "p50_ms": round(percentile(ms, 50), 3), "p99_ms": round(percentile(ms, 99), 3),
            "max_ms": round(max(ms), 3) if ms else float("nan")}


def table(rows: list[list[object]], header: list[str]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
