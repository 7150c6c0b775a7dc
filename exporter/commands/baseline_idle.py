"""`kvwatt baseline idle`: measure P_idle per device now, persist it, print it.

The vLLM server must be up with its model loaded and idle (no running or waiting requests, no tokens) for
the whole measurement: a baseline without the CUDA context understates idle by 26-66 W
(docs/energy-measurement.md, "Idle baseline"). The command checks that through the server's /metrics before,
during and after; if the server gets busy it stops and saves nothing. Exit 0 when at least one device was
measured and saved, 1 when nothing could be measured (busy server, no energy source) or saved, 2 for bad input
(a state directory that cannot be written included).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import replace

from exporter.config import (ConfigError, Config, ServerConfig, check_writable, parse_duration, parse_interval,
                             parse_server_flag, redacted_url, resolve)
from exporter.energy.attribution import assign_gpus
from exporter.energy.baseline import BaselineBook, IdleAccumulator, IdleEstimate
from exporter.samples import DeviceReading, Tick
from exporter.sampler import Sampler, missed_deadline
from exporter.statedir import resolve_dir
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
    state_dir, why = resolve_dir(cfg.state_dir)  # the daemon's directory, per-user fallback included
    if why:  # say it now, not after the measurement
        raise ConfigError(f"state_dir: cannot write {state_dir} ({why})")
    cfg = replace(cfg, state_dir=state_dir)
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
                url = redacted_url(self.servers[name].url.rstrip("/")) + "/metrics"
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
        if settle > 0:
            print(f"idle; waiting {settle:g}s for clocks to settle (--settle 0 to skip)", file=out)
            await _watch(ticks, check, time.monotonic() + settle)
        print(f"measuring for {duration:g}s ...", file=out)
        devices, t_end = None, None
        async for tick in ticks:
            check.check(tick)
            readings = list(tick.energy)
            down = {f"({s.source})": s.reason for s in tick.energy_statuses if not s.up}
            reasons = [f"{s.source}: {s.reason}" for s in tick.energy_statuses if s.reason]
            if devices is None and any(missed_deadline(s) for s in tick.energy_statuses):
                continue  # a source still starting (NVML init can take seconds): open once all have answered
            spans = tracker.spans(readings)
            if devices is None:  # the first reading only opens the intervals
                devices = _measure_devices(readings, cfg, checked, not checked)
                t_end = time.monotonic() + duration  # from the first sample: NVML init is not measured
            else:
                for r in readings:
                    if r.device in devices:
                        acc.add(r.device, spans.get(r.device), r.temperature_celsius)
            if time.monotonic() >= t_end:
                break
        await _watch(ticks, check, time.monotonic())  # one more look: still idle at the end
        await ticks.aclose()
    estimates = acc.estimates()
    missing = {d: "no sample for part of the measurement" for d in acc.missing}
    missing.update(down)  # a whole source unavailable: say why (permission, absent, ...)
    if not estimates and not missing:
        missing["(none)"] = "; ".join(reasons) or "no energy device found"
    return estimates, missing


async def _watch(ticks, check: IdleCheck, until: float) -> None:
    """Keep checking the servers until monotonic time ``until`` (at least one more tick)."""
    async for tick in ticks:
        check.check(tick)
        if time.monotonic() >= until:
            return


def main(args: argparse.Namespace) -> int:
    cfg, checked = _config(args)
    duration = parse_duration(args.duration, "--duration")
    settle = cfg.idle_settle_seconds if args.settle is None else parse_duration(args.settle, "--settle", zero_ok=True)
    interval = parse_interval(args.interval, "--interval")
    check_writable(cfg.state_dir, "--state-dir" if args.state_dir else "state_dir", directory=True)
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
    if book.write_error:
        print(f"kvwatt: baseline {book.write_error}", file=sys.stderr)
        return 1
    print(f"saved to {book.path}")
    return 0
