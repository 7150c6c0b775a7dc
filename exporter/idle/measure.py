"""Measuring P_idle per device now (`kvwatt baseline idle`): sample the energy sources with the daemon's
Sampler while checking, through each server's /metrics, that it stays idle with its model loaded (a baseline
without the CUDA context understates idle by 26-66 W: docs/energy-measurement.md, "Idle baseline"). The
arithmetic is IdleAccumulator's (exporter/idle/baseline.py)."""

from __future__ import annotations

import sys
import time
from dataclasses import replace

from exporter.config import Config, ServerConfig, redacted_url
from exporter.idle.baseline import IdleAccumulator, IdleEstimate
from exporter.model.attribution import assign_gpus
from exporter.runtime.progress import Progress
from exporter.runtime.sampler import Sampler, missed_deadline
from exporter.samples import DeviceReading, SourceStatus, Tick
from exporter.sources.endpoint import metrics_url
from exporter.store import DeviceTracker


class Busy(Exception):
    """The server is not idle (or not answering): the measurement is void."""


class IdleCheck:
    """The checked servers must stay idle: no running or waiting requests, no new tokens, answering."""

    def __init__(self, servers: list[ServerConfig]) -> None:
        self.servers = {s.name: s for s in servers}
        self.start: dict[str, dict] = {}
        self.seen: set[str] = set()

    def check(self, tick: Tick) -> None:
        for name, read in tick.servers.items():
            if name not in self.servers:
                continue
            if read.reading is None:
                url = metrics_url(redacted_url(self.servers[name].url))
                raise Busy(f"server {name} ({url}) is not answering: {read.status.reason}; start vLLM with the "
                           "model loaded (a baseline without it understates idle by 26-66 W), or pass "
                           "--no-server-check")
            g, c = read.reading.gauges, read.reading.counters
            if g.get("running") != 0 or g.get("waiting") != 0:
                raise Busy(f"server {name} is not idle: running={g.get('running')}, waiting={g.get('waiting')}")
            before = self.start.setdefault(name, {k: c.get(k) for k in ("generation_tokens", "prompt_tokens")})
            if any(before[k] is not None and c.get(k) != before[k] for k in before):
                raise Busy(f"server {name} served tokens during the measurement")
            self.seen.add(name)

    @property
    def all_seen(self) -> bool:
        return self.seen >= set(self.servers)


def measured_devices(readings: list[DeviceReading], cfg: Config, checked: list[ServerConfig],
                     everything: bool) -> set[str]:
    """Devices whose idleness the checks vouch for: the checked servers' GPUs; the shared host zones and
    unassigned GPUs only when every configured server is checked (or no check at all)."""
    if everything:
        return {r.device for r in readings}
    assignment = assign_gpus(cfg.servers, readings)
    devices = {d for s in checked for d in assignment.by_server.get(s.name, ())}
    if {s.name for s in checked} >= {s.name for s in cfg.servers}:
        devices |= {r.device for r in readings if r.kind == "host"} | set(assignment.unassigned)
    return devices


async def measure(cfg: Config, checked: list[ServerConfig], duration: float, settle: float, interval: float,
                  nvml=None, rapl=None, out=sys.stdout,
                  err=sys.stderr) -> tuple[list[IdleEstimate], dict[str, str]]:
    """Sample the energy sources for ``duration`` after ``settle`` with the daemon's Sampler; (estimates,
    device -> why not measured). The arithmetic is IdleAccumulator's: each device's joules over the seconds
    between its own readings, the clock starting at the first sample (NVML init is not measured)."""
    cfg = replace(cfg, interval_seconds=interval)
    check, tracker, acc = IdleCheck(checked), DeviceTracker(), IdleAccumulator()
    down: dict[str, str] = {}
    reasons: list[str] = []
    async with Sampler(cfg, checked, nvml=nvml, rapl=rapl) as sampler:
        ticks = sampler.ticks(interval)
        async for tick in ticks:  # the servers must answer, idle, before anything is measured
            check.check(tick)
            if check.all_seen:
                break
        if nothing_to_measure(tick):  # say it now, not after --settle and --duration
            await ticks.aclose()
            return [], {f"({s.source})": s.reason for s in tick.energy_statuses}
        if settle > 0:
            print(f"idle; waiting {settle:g}s for clocks to settle (--settle 0 to skip)", file=out)
            await _watch(ticks, check, time.monotonic() + settle)
        print(f"measuring for {duration:g}s ...", file=out)
        devices, t_end = None, None
        progress = Progress(err, duration, "measuring idle power")
        async for tick in ticks:
            check.check(tick)
            readings = list(tick.energy)
            down = {f"({s.source})": s.reason for s in tick.energy_statuses if not s.up}
            reasons = [f"{s.source}: {s.reason}" for s in tick.energy_statuses if s.reason]
            if devices is None and any(missed_deadline(s) for s in tick.energy_statuses):
                continue  # a source still starting (NVML init can take seconds): open once all have answered
            spans = tracker.spans(readings)
            if devices is None:  # the first reading only opens the intervals
                devices = measured_devices(readings, cfg, checked, not checked)
                t_end = time.monotonic() + duration  # from the first sample: NVML init is not measured
            else:
                for r in readings:
                    if r.device in devices:
                        acc.add(r.device, spans.get(r.device), r.temperature_celsius)
            progress.update(duration - max(0.0, t_end - time.monotonic()), f"{len(devices)} devices")
            if time.monotonic() >= t_end:
                progress.finish(duration, f"{len(devices)} devices")
                break
        await _watch(ticks, check, time.monotonic())  # one more look: still idle at the end
        await ticks.aclose()
    estimates = acc.estimates()
    missing = {d: "no sample for part of the measurement" for d in acc.missing}
    missing.update(down)  # a whole source unavailable: say why (permission, absent, ...)
    if not estimates and not missing:
        missing["(none)"] = "; ".join(reasons) or "no energy device found"
    return estimates, missing


def nothing_to_measure(tick: Tick) -> bool:
    """Every energy source is known absent or refused (not merely still starting, as a slow nvmlInit is):
    waiting --settle and --duration could measure nothing."""
    statuses: tuple[SourceStatus, ...] = tick.energy_statuses
    return (not tick.energy and bool(statuses)
            and all(not s.up and not missed_deadline(s) for s in statuses))


async def _watch(ticks, check: IdleCheck, until: float) -> None:
    """Keep checking the servers until monotonic time ``until`` (at least one more tick)."""
    async for tick in ticks:
        check.check(tick)
        if time.monotonic() >= until:
            return
