"""Recording one server for `kvwatt baseline record`: the daemon's own Sampler and Model, every interval kept,
for a fixed duration. The profile is then built from the intervals (exporter/recording/profile.py)."""

from __future__ import annotations

import time

from exporter.config import Config, ConfigError, ServerConfig
from exporter.model import Model
from exporter.runtime.progress import Progress
from exporter.runtime.sampler import Sampler


async def record_intervals(cfg: Config, server: ServerConfig, duration_seconds: float, energy: bool = True,
                           nvml=None, rapl=None, progress: Progress | None = None):
    """Read the server (and energy) every cfg.interval_seconds for duration_seconds with the daemon's own
    Sampler and Model (one server, every interval kept, no idle learning: P_idle must not change halfway).
    Returns (intervals, last EngineInfo or None, last vLLM status); ``progress`` hears each tick. ConfigError when the
    server offloads: an
    OFF profile must come from an OFF server."""
    model = Model(cfg, keep_seconds=duration_seconds + 3600.0, learn_idle=False)
    sm = model.servers[server.name]
    start = time.monotonic()
    async with Sampler(cfg, (server,), nvml=nvml, rapl=rapl, energy=energy) as sampler:
        async for tick in sampler.ticks(cfg.interval_seconds, until=start + duration_seconds):
            read = tick.servers.get(server.name)
            if read is not None and read.reading is not None and read.reading.info.offload_enabled:
                raise ConfigError(f"--server {server.name}: the server offloads KV "
                                  "(kv_offloading_size is set); record the OFF twin")
            model.ingest(tick)
            if progress is not None:
                progress.update(time.monotonic() - start, _progress_detail(sm))
    if progress is not None:
        progress.finish(min(duration_seconds, time.monotonic() - start), _progress_detail(sm))
    return list(sm.history.intervals), sm.info, sm.status


def _progress_detail(sm) -> str:
    """What a person watching wants to know: is the server answering, and how much has been recorded."""
    if sm.status is not None and not sm.status.up:
        return f"server down: {sm.status.reason}"
    return f"{len(sm.history.intervals)} intervals"
