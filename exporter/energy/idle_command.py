"""`kvwatt baseline idle`: measure P_idle per device now, persist it, print it.

The vLLM server must be up with its model loaded and idle (no running or waiting requests, no tokens) for
the whole measurement: a baseline without the CUDA context understates idle by 26-66 W
(docs/energy-measurement.md, "Idle baseline"). The command checks that through the server's /metrics before,
during and after; if the server gets busy it stops and saves nothing. Exit 0 when at least one device was
measured and saved, 1 when nothing could be measured (busy server, no energy source), 2 for bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import aiohttp

from exporter.config import ConfigError, Config, ServerConfig, parse_duration, parse_server_flag, resolve
from exporter.energy.attribution import assign_gpus
from exporter.energy.baseline import BaselineBook, IdleEstimate
from exporter.samples import DeviceReading
from exporter.store import DeviceTracker


class Busy(Exception):
    """The server is not idle (or not answering): the measurement is void."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", default="30s", metavar="DURATION", help="how long to measure (default 30s)")
    p.add_argument("--settle", metavar="DURATION",
                   help="wait this long, idle, before measuring (default: idle_settle from the config, 30s)")
    p.add_argument("--config", metavar="FILE", help="YAML configuration file (also $KVWATT_CONFIG)")
    p.add_argument("--server", metavar="NAME[=URL]",
                   help="the server whose GPUs to measure (a configured name, or NAME=URL); default: all")
    p.add_argument("--no-server-check", action="store_true",
                   help="measure without checking a vLLM server (understates idle without a loaded model)")
    p.add_argument("--state-dir", metavar="DIR", help="where the baseline is persisted (default /var/lib/kvwatt)")
    p.add_argument("--powercap-root", metavar="DIR", help="powercap tree for RAPL (default /sys/class/powercap)")
    p.add_argument("--interval", default="1s", metavar="DURATION", help="sampling interval (default 1s)")


def _config(args: argparse.Namespace) -> tuple[Config, list[ServerConfig]]:
    flag = [args.server] if args.server and "=" in args.server else None
    cfg = resolve(args.config, servers=flag, state_dir=args.state_dir, powercap_root=args.powercap_root)
    if args.no_server_check:
        return cfg, []
    if args.server and "=" not in args.server:
        try:
            return cfg, [cfg.server(args.server)]
        except KeyError:
            known = ", ".join(s.name for s in cfg.servers)
            raise ConfigError(f"--server: no configured server named {args.server!r} (known: {known})") from None
    if flag:
        return cfg, [parse_server_flag(args.server)]
    return cfg, list(cfg.servers)


async def _check_idle(session: aiohttp.ClientSession, sources: list, start: dict) -> None:
    for src in sources:
        status, reading = await src.read(session)
        if reading is None:
            raise Busy(f"server {src.name} ({src.metrics_url}) is not answering: {status.reason}; start vLLM "
                       "with the model loaded (a baseline without it understates idle by 26-66 W), or pass "
                       "--no-server-check")
        g, c = reading.gauges, reading.counters
        if g.get("running") != 0 or g.get("waiting") != 0:
            raise Busy(f"server {src.name} is not idle: running={g.get('running')}, waiting={g.get('waiting')}")
        before = start.setdefault(src.name, {k: c.get(k) for k in ("generation_tokens", "prompt_tokens")})
        if any(before[k] is not None and c.get(k) != before[k] for k in before):
            raise Busy(f"server {src.name} served tokens during the measurement")


def _measure_devices(readings: list[DeviceReading], cfg: Config, checked: list[ServerConfig],
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
                  nvml=None, rapl=None, out=sys.stdout) -> tuple[list[IdleEstimate], dict[str, str]]:
    """Sample the energy sources for ``duration`` after ``settle``; (estimates, device -> why not measured)."""
    from exporter.sources.nvml import NvmlSource
    from exporter.sources.rapl import RaplSource
    from exporter.sources.vllm import VllmSource

    nvml = nvml or NvmlSource(cfg.nvml_enabled)
    rapl = rapl or RaplSource(cfg.powercap_root)
    vsources = [VllmSource(s.name, s.url, cfg.http_timeout_seconds, cfg.max_body_bytes) for s in checked]
    tracker, joules, seconds, temps, missing = DeviceTracker(), {}, {}, {}, {}
    start: dict = {}
    try:
        async with aiohttp.ClientSession() as session:
            await _check_idle(session, vsources, start)
            if settle > 0:
                print(f"idle; waiting {settle:g}s for clocks to settle (--settle 0 to skip)", file=out)
                await _idle_sleep(session, vsources, start, settle, interval)
            print(f"measuring for {duration:g}s ...", file=out)
            devices, reasons, down, t_end = None, [], {}, None
            while True:
                t = time.monotonic()
                statuses, readings = _read(nvml, rapl, t)
                down = {f"({s.source})": s.reason for s in statuses if not s.up}
                reasons = [f"{s.source}: {s.reason}" for s in statuses if s.reason]
                spans = tracker.spans(readings)  # joules over each device's own seconds between reads
                if devices is None:  # the first reading only opens the intervals
                    devices = _measure_devices(readings, cfg, checked, not checked)
                    t_end = time.monotonic() + duration  # from the first sample: NVML init is not measured
                else:
                    _accumulate(spans, devices, joules, seconds, missing)
                for r in readings:
                    if r.device in devices and r.temperature_celsius is not None:
                        temps.setdefault(r.device, []).append(r.temperature_celsius)
                if t >= t_end:
                    break
                await _idle_sleep(session, vsources, start, min(interval, max(t_end - time.monotonic(), 0)),
                                  interval)
            await _check_idle(session, vsources, start)
    finally:
        nvml.close()
    estimates = [IdleEstimate(d, joules[d] / seconds[d], seconds[d],
                              sum(temps[d]) / len(temps[d]) if temps.get(d) else None)
                 for d in sorted(joules) if d not in missing and seconds[d] > 0]
    missing.update(down)  # a whole source unavailable: say why (permission, absent, ...)
    if not estimates and not missing:
        missing["(none)"] = "; ".join(reasons) or "no energy device found"
    return estimates, missing


def _accumulate(spans: dict, devices: set[str], joules: dict, seconds: dict, missing: dict) -> None:
    for device, span in spans.items():
        if device not in devices:
            continue
        if span is None:
            missing[device] = "no sample for part of the measurement"
        else:
            joules[device] = joules.get(device, 0.0) + span[0]
            seconds[device] = seconds.get(device, 0.0) + span[1]


def _read(nvml, rapl, t: float):
    nv_status, gpus = nvml.read(t)
    host_status, zones = rapl.read(t)
    return [nv_status, host_status], gpus + zones


async def _idle_sleep(session, vsources, start, seconds: float, interval: float) -> None:
    end = time.monotonic() + seconds
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return
        await asyncio.sleep(min(left, interval))
        await _check_idle(session, vsources, start)


def main(args: argparse.Namespace) -> int:
    cfg, checked = _config(args)
    duration = parse_duration(args.duration, "--duration")
    settle = cfg.idle_settle_seconds if args.settle is None else _duration_or_zero(args.settle, "--settle")
    interval = parse_duration(args.interval, "--interval")
    if not checked:
        print("warning: no vLLM server checked; with no model loaded the baseline understates idle power",
              file=sys.stderr)
    try:
        estimates, missing = asyncio.run(measure(cfg, checked, duration, settle, interval))
    except Busy as e:
        print(f"kvwatt: baseline not measured: {e}", file=sys.stderr)
        return 1
    for device, why in sorted(missing.items()):
        print(f"{device}: not measured ({why})", file=sys.stderr)
    if not estimates:
        return 1
    book = BaselineBook(cfg.state_dir, cfg.idle_power_watts)
    book.load()
    for b in book.record(estimates, "measured"):
        temp = "" if b.temperature_celsius is None else f", {b.temperature_celsius:.0f} C"
        print(f"{b.device}  {b.watts:.2f} W  ({b.duration_seconds:.1f} s{temp}, measured)")
        if book.get(b.device).method == "configured":
            print("  note: idle_power_watts in the configuration overrides this value", file=sys.stderr)
    print(f"saved to {book.path}")
    return 0


def _duration_or_zero(value: str, key: str) -> float:
    return 0.0 if str(value).strip() in ("0", "0s") else parse_duration(value, key)

