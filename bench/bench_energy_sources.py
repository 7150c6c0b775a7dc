"""Per-read cost of the energy sources, and the instant-power integration's accuracy.

    .venv/bin/python bench/bench_energy_sources.py

- RAPL: one RaplSource.read over a two-socket Intel tree (4 zones: package + dram per socket) written in the
  kernel's layout. On real sysfs each energy_uj read is an MSR read in the kernel (a few us), so expect a
  little more than this tmpfs figure.
- NVML: one NvmlSource.read for 1 and 8 counter GPUs through the test double. The double re-reads its JSON
  state file on every call, so this is an upper bound of kvwatt's own overhead plus the double's, not a
  measurement of libnvidia-ml (no GPU here).
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
    gpus = FakeGpus(Path(base) / f"gpus{count}.json")
    for i in range(count):
        gpus.add(f"GPU-{i:04d}", energy_mj=1000 * i, power_mw=300_000)
    src = NvmlSource(module=load_fake_nvml(gpus.path))
    src.read(0.0)
    us = per_call_us(lambda n: src.read(float(n)))
    src.close()
    return us


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
        result = {
            "rapl_read_us_4_zones": round(rapl_read_us(base), 1),
            "nvml_read_us_1_gpu_double": round(nvml_read_us(base, 1), 1),
            "nvml_read_us_8_gpus_double": round(nvml_read_us(base, 8), 1),
            "power_integration_error_percent_10hz": _round(integration_error_percent(base, 10.0)),
            "power_integration_error_percent_20hz": _round(integration_error_percent(base, 20.0)),
        }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
