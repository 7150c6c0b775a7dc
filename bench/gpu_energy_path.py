"""kvwatt's NVML energy path on a real GPU: what the daemon's own source reads, what one read costs, and the
energy counter against the instant power integrated over the same idle and loaded seconds.

    python bench/gpu_energy_path.py [--idle-seconds 8] [--load-seconds 15]   # a GPU machine: torch + pynvml
    python bench/gpu_energy_path.py --dry-run                                # anywhere: the NVML test double

1. Reads: 100 calls of exporter.sources.nvml.NvmlSource.read (the daemon's source, one reader thread per GPU)
   on the idle GPU: the method it chose (counter, or power integration on GPUs without the counter), the wall
   time per read p50 / p99 / max (the tests' NVML double costs what an H100 read was measured to cost: ~3 ms).
2. Energy: idle, then bf16 matrix products, then idle again, NvmlSource.read every 0.1 s: per phase, the
   counter's joules (DeviceReading.joules_total) against the trapezoid of the same reads' instant watts, and
   the mean power. The counter is what kvwatt's J/token rests on; the integral is an independent reading of
   the same hardware, so the ratio says whether the two agree (NVML's power is a ~1 s average on recent parts:
   the integral lags at the phase edges; over seconds they should agree within a few per cent).

Prints one JSON document. Exit 2: no GPU, NVML or torch (one line). --dry-run: the tests' NVML double
(tests/support/fake_nvml) with a sleeping load: proves the harness, not a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from exporter.sources.nvml import NvmlSource  # noqa: E402


class Fail(Exception):
    """Bad input or missing hardware: one line, exit 2."""


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def read_costs(src: NvmlSource, n: int = 100) -> dict:
    walls, methods = [], set()
    for _ in range(n):
        t = time.monotonic()
        _, readings = src.read(t)
        walls.append((time.monotonic() - t) * 1e3)
        methods |= {r.method for r in readings}
        time.sleep(0.01)
    return {"reads": n, "gpus": len(readings), "methods": sorted(methods),
            "wall_ms": {"p50": round(percentile(walls, 50), 3), "p99": round(percentile(walls, 99), 3),
                        "max": round(max(walls), 3)}}


def phase(src: NvmlSource, seconds: float, gpu: str) -> dict:
    """NvmlSource.read every 0.1 s for ``seconds``: the counter's joules and the power integral."""
    samples = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.monotonic()
        r = next((x for x in src.read(t)[1] if x.device == gpu), None)
        if r is not None and r.joules_total is not None and r.power_watts is not None:
            samples.append((t, r.joules_total, r.power_watts))
        time.sleep(max(0.0, 0.1 - (time.monotonic() - t)))
    if len(samples) < 2:
        raise Fail(f"fewer than two readings of {gpu} in {seconds:g} s")
    dt = samples[-1][0] - samples[0][0]
    counter = samples[-1][1] - samples[0][1]
    integral = sum((b[0] - a[0]) * (a[2] + b[2]) / 2 for a, b in zip(samples, samples[1:]))
    return {"seconds": round(dt, 3), "reads": len(samples), "counter_joules": round(counter, 2),
            "power_integral_joules": round(integral, 2), "mean_watts": round(counter / dt, 1),
            "counter_over_integral": round(counter / integral, 4) if integral > 0 else None}


class Load:
    """bf16 matrix products on the GPU in a thread until stopped (torch releases the GIL in CUDA calls)."""

    def __init__(self, torch, dry: bool) -> None:
        self.torch, self.dry = torch, dry
        self.stop = threading.Event()
        self.products = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        if self.dry:
            while not self.stop.wait(0.01):
                self.products += 1
            return
        torch = self.torch
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        while not self.stop.is_set():
            for _ in range(20):
                a @ b
            torch.cuda.synchronize()
            self.products += 20

    def __enter__(self) -> "Load":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def source(dry: bool, tmp: str):
    if not dry:
        try:
            import torch
        except ImportError as e:
            raise Fail(f"torch is not installed: {e}")
        if not torch.cuda.is_available():
            raise Fail("no CUDA device (use --dry-run to check the harness)")
        return NvmlSource(), torch
    from tests.support.fake_gpus import FakeGpus, load_fake_nvml
    gpus = FakeGpus(Path(tmp) / "nvml.json", energy_read_latency="h100")
    gpus.add("GPU-dry-run-0")
    return NvmlSource(module=load_fake_nvml(gpus.path)), None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--idle-seconds", type=float, default=8.0)
    p.add_argument("--load-seconds", type=float, default=15.0)
    p.add_argument("--dry-run", action="store_true", help="the tests' NVML double, no GPU")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvwatt-gpu-path-") as tmp:
        try:
            if a.idle_seconds <= 0 or a.load_seconds <= 0:
                raise Fail("--idle-seconds and --load-seconds must be positive")
            src, torch = source(a.dry_run, tmp)
            status, first = src.read(time.monotonic())
            if not first:
                raise Fail(f"NvmlSource read no GPU: {status.reason}")
            gpu = first[0].device
            report = {"gpu": gpu, "labels": first[0].labels, "method": first[0].method}
            if torch is not None:
                torch.ones(1, device="cuda")  # the CUDA context, off the clock
                report["device"] = torch.cuda.get_device_name(0)
            report["read_costs"] = read_costs(src)
            report["idle_before"] = phase(src, a.idle_seconds, gpu)
            with Load(torch, a.dry_run) as load:
                time.sleep(1.0)  # the clocks ramp up: the loaded phase starts on a busy GPU
                report["loaded"] = phase(src, a.load_seconds, gpu)
            report["loaded"]["matrix_products"] = load.products
            report["idle_after"] = phase(src, a.idle_seconds, gpu)
        except Fail as e:
            print(f"gpu_energy_path: {e}", file=sys.stderr)
            return 2
    if a.dry_run:
        report["note"] = "the tests' NVML double: proves the harness, not a GPU"
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
