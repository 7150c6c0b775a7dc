"""The demo's GPU energy: a SIMULATION that speaks the pynvml calls kvwatt's NVML source makes (the real
NvmlSource reads it). One simulated GPU per demo server, its UUID and name saying so; its energy counter follows
the server's current frame: P_idle x t + J per generated token x generated tokens + J per computed prompt token x
computed prompt tokens + J per reloaded token x reloaded tokens (the per-token costs are illustrative, of the
order an H100 shows on a 8B model; docs/demo.md), held to an H100 SXM's enforced power limit as a real GPU is:
the counter never rises faster than POWER_LIMIT_WATTS, work beyond it is paid later at the limit (a GPU at its cap
slows down), and the power reading is the counter's own 1 s trailing average."""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

IDLE_WATTS = 70.0
POWER_LIMIT_WATTS = 700.0  # an H100 SXM's enforced power limit (its TDP): nvmlDeviceGetEnforcedPowerLimit
# Illustrative costs, scaled so the captures' busiest 10 s (at --speed 1: 48k computed prompt tokens/s and 160
# generated tokens/s for 1 s bursts of prefill, scripts/capture-demo.py's CPU engine) draw 685 W, within the limit;
# the first demo's costs (4x these) asked up to 2.5 kW. The prefill bursts' 1 s peaks still reach the limit.
JOULES_PER_GENERATED_TOKEN = 0.075
JOULES_PER_COMPUTED_PROMPT_TOKEN = 0.0125
JOULES_PER_RELOADED_TOKEN = 0.00125
POWER_AVERAGE_SECONDS = 1.0  # nvmlDeviceGetPowerUsage: a 1 s trailing average on an H100
NVML_TEMPERATURE_GPU = 0


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801 (pynvml's name)
    pass


class SimulatedNvml:
    """``gpus``: per GPU, a function returning (generated, computed prompt, reloaded) token counts now.
    ``cost_scale``: the per-token costs' factor (1 / the demo's --speed: a story played X times faster draws the
    power it drew at speed 1)."""

    def __init__(self, gpus: list[tuple[str, Callable[[], tuple[float, float, float]]]],
                 clock: Callable[[], float] = time.monotonic, cost_scale: float = 1.0) -> None:
        self.gpus, self.clock, self.cost_scale = gpus, clock, cost_scale
        self.t0 = clock()
        self.NVMLError, self.NVML_TEMPERATURE_GPU = NVMLError, NVML_TEMPERATURE_GPU
        # per GPU: (time, joules delivered) of the recent reads, for the power limit and the trailing average
        self._delivered: list[deque[tuple[float, float]]] = [deque([(self.t0, 0.0)]) for _ in gpus]

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        return [u for u, _ in self.gpus].index(uuid)

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return self.gpus[handle][0]

    def _demanded_joules(self, handle: int, now: float) -> float:
        """What the GPU's work so far asks: idle power over the time since the demo started and each token's cost."""
        generated, computed, reloaded = self.gpus[handle][1]()
        return IDLE_WATTS * (now - self.t0) + self.cost_scale * (
            JOULES_PER_GENERATED_TOKEN * generated + JOULES_PER_COMPUTED_PROMPT_TOKEN * computed
            + JOULES_PER_RELOADED_TOKEN * reloaded)

    def _advance(self, handle: int) -> tuple[float, float]:
        """(now, joules delivered): the demand, but never above the power limit since the last read."""
        now, seen = self.clock(), self._delivered[handle]
        last_t, last_j = seen[-1]
        if now > last_t:
            joules = max(last_j, min(self._demanded_joules(handle, now), last_j + POWER_LIMIT_WATTS * (now - last_t)))
            seen.append((now, joules))
            while len(seen) > 2 and seen[1][0] <= now - POWER_AVERAGE_SECONDS:
                seen.popleft()
        return seen[-1]

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:
        """Millijoules since the demo started (an H100's counter starts at its boot; kvwatt uses differences)."""
        return int(self._advance(handle)[1] * 1000)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        """Milliwatts: the energy counter's trailing average over ~1 s (idle before the first second)."""
        now, joules = self._advance(handle)
        t, j = self._delivered[handle][0]
        return int((joules - j) / (now - t) * 1000) if now > t else int(IDLE_WATTS * 1000)

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: int) -> int:
        return int(POWER_LIMIT_WATTS * 1000)

    def nvmlDeviceGetPowerManagementLimit(self, handle: int) -> int:
        return int(POWER_LIMIT_WATTS * 1000)

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        return 45

    def nvmlDeviceGetFieldValues(self, handle: int, field_ids):
        raise NVMLError_NotSupported("field values are not simulated")
