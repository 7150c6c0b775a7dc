"""Drive the NVML test double (tests/support/fake_nvml/pynvml.py) from a test.

    gpus = FakeGpus(tmp_path / "gpus.json")           # writes the state file
    gpus.add(uuid="GPU-aaaa", energy_mj=1_000_000, power_mw=300_000)
    gpus.add(uuid="GPU-bbbb", has_energy_counter=False, power_mw=250_000)
    nvml = load_fake_nvml(gpus.path)                  # sets KVWATT_FAKE_NVML_STATE, returns the module
    source = NvmlSource(module=nvml)
    gpus.update("GPU-aaaa", lost=True)                # takes effect at the next NVML call

For a daemon subprocess: ``gpus.env()`` gives PYTHONPATH (double first) and KVWATT_FAKE_NVML_STATE.
Every change rewrites the file atomically, so a reader in another process never sees half of it.

Reads cost what they cost on an H100 by default (an energy-counter read ~3 ms median, up to 18 ms; see the
double's docstring). ``FakeGpus(path, energy_read_latency=0)`` makes them free, ``energy_read_latency=50``
makes every energy read take 50 ms (a GPU that misses a deadline).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

FAKE_DIR = Path(__file__).resolve().parent / "fake_nvml"
STATE_ENV = "KVWATT_FAKE_NVML_STATE"


def load_fake_nvml(state_path: str | os.PathLike | None = None):
    """Import the double under the module name ``fake_pynvml`` (never shadowing the real ``pynvml`` in this
    process) and point it at ``state_path``."""
    if state_path is not None:
        os.environ[STATE_ENV] = str(state_path)
    name = "fake_pynvml"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, FAKE_DIR / "pynvml.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class FakeGpus:
    """The state file's contents, rewritten on every change."""

    def __init__(self, path: str | os.PathLike, **top: object) -> None:
        """``top``: top-level state fields, e.g. ``energy_read_latency`` ("h100", 0, or milliseconds)."""
        self.path = str(path)
        self.state: dict = {"library_found": True, "driver_loaded": True, "gpus": [], **top}
        self.write()

    def add(self, uuid: str, **fields: object) -> dict:
        gpu = {"uuid": uuid, "energy_mj": 0, "power_mw": 100_000, "temperature_c": 40,
               "has_energy_counter": True, **fields}
        self.state["gpus"].append(gpu)
        self.write()
        return gpu

    def gpu(self, uuid: str) -> dict:
        return next(g for g in self.state["gpus"] if g["uuid"] == uuid)

    def update(self, uuid: str | None = None, **fields: object) -> None:
        """Change one GPU's fields, or top-level fields (driver_loaded, library_found) when uuid is None."""
        (self.gpu(uuid) if uuid else self.state).update(fields)
        self.write()

    def write(self) -> None:
        # a unique temporary name per write: two writers (e.g. two FakeVllm driving GPUs) never share one
        fd, tmp = tempfile.mkstemp(prefix=".gpus-", dir=os.path.dirname(os.path.abspath(self.path)))
        with os.fdopen(fd, "w") as f:
            json.dump(self.state, f)
        os.replace(tmp, self.path)

    def env(self) -> dict[str, str]:
        path = os.pathsep.join([str(FAKE_DIR), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        return {"PYTHONPATH": path, STATE_ENV: self.path}


def sine_profile(base_w: float, amplitude_w: float, period_s: float, t0: float | None = None) -> dict:
    """A power_profile entry (watts in, milliwatts stored) starting at ``t0`` (default: now, monotonic)."""
    return {"base_mw": base_w * 1000, "amplitude_mw": amplitude_w * 1000, "period_s": period_s,
            "t0": time.monotonic() if t0 is None else t0}
