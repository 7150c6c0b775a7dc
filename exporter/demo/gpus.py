"""The demo's GPU energy: a SIMULATION that speaks the pynvml calls kvwatt's NVML source makes (the real
NvmlSource reads it). One simulated GPU per demo server, its UUID and name saying so; its energy counter follows
the server's current frame: P_idle x t + J per generated token x generated tokens + J per computed prompt token x
computed prompt tokens + J per reloaded token x reloaded tokens (the per-token costs are illustrative, of the
order an H100 shows on a 8B model; docs/demo.md)."""

from __future__ import annotations

import time
from typing import Callable

IDLE_WATTS = 70.0
JOULES_PER_GENERATED_TOKEN = 0.3
JOULES_PER_COMPUTED_PROMPT_TOKEN = 0.05
JOULES_PER_RELOADED_TOKEN = 0.005
NVML_TEMPERATURE_GPU = 0


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801 (pynvml's name)
    pass


class SimulatedNvml:
    """``gpus``: per GPU, a function returning (generated, computed prompt, reloaded) token counts now."""

    def __init__(self, gpus: list[tuple[str, Callable[[], tuple[float, float, float]]]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.gpus, self.clock = gpus, clock
        self.t0 = clock()
        self.NVMLError, self.NVML_TEMPERATURE_GPU = NVMLError, NVML_TEMPERATURE_GPU

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

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:
        """Millijoules since the demo started (an H100's counter starts at its boot; kvwatt uses differences)."""
        generated, computed, reloaded = self.gpus[handle][1]()
        joules = (IDLE_WATTS * (self.clock() - self.t0) + JOULES_PER_GENERATED_TOKEN * generated
                  + JOULES_PER_COMPUTED_PROMPT_TOKEN * computed + JOULES_PER_RELOADED_TOKEN * reloaded)
        return int(joules * 1000)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return int(IDLE_WATTS * 1000)  # the instant power is not what kvwatt's energy figures read

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        return 45

    def nvmlDeviceGetFieldValues(self, handle: int, field_ids):
        raise NVMLError_NotSupported("field values are not simulated")
