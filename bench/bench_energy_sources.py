"""Per-read cost of the energy sources, and the instant-power integration's accuracy.

    .venv/bin/python bench/bench_energy_sources.py

- RAPL: one RaplSource.read over a two-socket Intel tree (4 zones: package + dram per socket) written in the
  kernel's layout. On real sysfs each energy_uj read is an MSR read in the kernel (a few us), so expect a
  little more than this tmpfs figure.
- NVML, kvwatt's own overhead: one NvmlSource.read for 1 and 8 counter GPUs through the test double with its
  latency model off (``energy_read_latency: 0``). The double re-reads its JSON state file on every call, so
  this is an upper bound of kvwatt's overhead plus the double's, not a measurement of libnvidia-ml.
- NVML, realistic: 8 counter GPUs through the double costing what an H100 costs (energy read lognormal,
  3.0 ms median, 6.5 ms p90, <= 18 ms; power/temperature ~5 us; tests/support/fake_nvml/pynvml.py). The wall
  time of one NvmlSource.read, p50/p99 over many reads, one GPU after another (``max_workers=1``) vs
  concurrent (one reader thread per GPU, the default).
- Integration: a GPU without the counter, a sine power profile, sampled at 10 and 20 Hz; the integral
  against the exact one over 5 s.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from exporter.sources.nvml import NvmlSource  # noqa: E402
from exporter.sources.rapl import RaplSource  # noqa: E402
from tests.support.fake_gpus import FakeGpus, load_fake_nvml, sine_profile  # noqa: E402
from tests.support.powercap import intel_two_socket  # noqa: E402


def per_call_us(fn, min_seconds: float = 1.0) -> float:
    n = 0
    start = time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        n += 1
        fn(n)
    return (time.perf_counter() - start) / n * 1e6


def rapl_read_us(base: str) -> float:
    tree = intel_two_socket(base)
    src = RaplSource(tree.root, rescan_seconds=1e9)
    src.read(0.0)
    return per_call_us(lambda n: src.read(float(n)))


def nvml_read_us(base: str, count: int) -> float:
    gpus = FakeGpus(Path(base) / f"gpus{count}.json", energy_read_latency=0)
    for i in range(count):
        gpus.add(f"GPU-{i:04d}", energy_mj=1000 * i, power_mw=300_000)
    src = NvmlSource(module=load_fake_nvml(gpus.path))
    src.read(0.0)
    us = per_call_us(lambda n: src.read(float(n)))
    src.close()
    return us


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)]


def nvml_h100_read_ms(base: str, count: int, max_workers: int | None, reads: int = 300) -> dict:
    """Wall time of one NvmlSource.read with the double's H100 latency model: p50, p99, max (ms)."""
    gpus = FakeGpus(Path(base) / f"h100-{count}-{max_workers}.json", energy_read_latency="h100")
    for i in range(count):
        gpus.add(f"GPU-{i:04d}", energy_mj=1000 * i, power_mw=300_000)
    src = NvmlSource(module=load_fake_nvml(gpus.path), max_workers=max_workers)
    try:
        src.read(0.0)
        took = []
        for n in range(1, reads + 1):
            start = time.perf_counter()
            status, _ = src.read(float(n))
            took.append(time.perf_counter() - start)
            assert status.state == "ok", status
    finally:
        src.close()
    return {"p50": round(_quantile(took, 0.5) * 1e3, 2), "p99": round(_quantile(took, 0.99) * 1e3, 2),
            "max": round(max(took) * 1e3, 2)}


def integration_error_percent(base: str, hz: float, seconds: float = 5.0) -> float | None:
    """Reads every 0.25 s like the daemon; retried when a starved sampler broke the integral (a gap)."""
    gpus = FakeGpus(Path(base) / f"int{hz}.json")
    gpus.add("GPU-int", has_energy_counter=False, power_profile=sine_profile(300.0, 150.0, 1.0))
    nv = load_fake_nvml(gpus.path)
    src = NvmlSource(module=nv, sample_hz=hz)
    try:
        src.read(time.monotonic())
        time.sleep(0.3)
        for _ in range(3):
            t1 = time.monotonic()
            e1, ok = src.read(t1)[1][0].joules_total, True
            while time.monotonic() < t1 + seconds:
                time.sleep(0.25)
                ok = ok and src.read(time.monotonic())[1][0].continuous
            t2 = time.monotonic()
            r = src.read(t2)[1][0]
            if ok and r.continuous:
                exact = nv.energy_mj_between(gpus.gpu("GPU-int"), t1, t2) / 1000.0
                return (r.joules_total - e1 - exact) / exact * 100
        return None
    finally:
        src.close()


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def main() -> dict:
    with tempfile.TemporaryDirectory() as base:
        sequential = nvml_h100_read_ms(base, 8, max_workers=1)
        concurrent = nvml_h100_read_ms(base, 8, max_workers=None)
        result = {
            "rapl_read_us_4_zones": round(rapl_read_us(base), 1),
            "nvml_read_us_1_gpu_double_no_latency": round(nvml_read_us(base, 1), 1),
            "nvml_read_us_8_gpus_double_no_latency": round(nvml_read_us(base, 8), 1),
            "nvml_read_ms_8_gpus_h100_sequential": sequential,
            "nvml_read_ms_8_gpus_h100_concurrent": concurrent,
            "power_integration_error_percent_10hz": _round(integration_error_percent(base, 10.0)),
            "power_integration_error_percent_20hz": _round(integration_error_percent(base, 20.0)),
        }
    print("NvmlSource.read, 8 GPUs, H100 latency model (ms):   p50     p99     max")
    for name, r in (("one after another", sequential), ("concurrent", concurrent)):
        print(f"  {name:<46}{r['p50']:>6}  {r['p99']:>6}  {r['max']:>6}")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
