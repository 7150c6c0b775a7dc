"""`kvwatt baseline record --server NAME --duration D --out FILE`: record an OFF-condition profile.

Samples one vLLM server (offloading OFF) and its GPUs' energy every ``interval`` for ``duration``, with the
daemon's own Sampler and Model, cuts the samples into non-overlapping
``window`` windows and writes J/token and tokens/s per KV-pressure band (exporter/recording/profile.py).
The daemon then compares a live ON server to it (``servers[].recorded_baseline``, the `recorded` dE kind).

J/token is marginal (idle-subtracted) when every GPU of the server has an idle baseline (`kvwatt baseline
idle`, or idle_power_watts in the config), else total, and the profile says which; without GPU energy the
profile holds tokens/s only. Exit 0 written, 1 nothing usable recorded (no loaded window), 2 bad input
(including a server that offloads: an OFF profile must come from an OFF server).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import replace

from exporter.config import (
    Config,
    ConfigError,
    ServerConfig,
    check_writable,
    format_window,
    parse_duration,
    parse_server_flag,
    resolve,
)
from exporter.config.settings import add_shared_flags
from exporter.recording import profile as profile_mod
from exporter.runtime.progress import Progress
from exporter.runtime.recorder import record_intervals


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", required=True, metavar="NAME[=URL]",
                   help="the OFF server to record (a configured name, or NAME=URL)")
    p.add_argument("--duration", required=True, metavar="DURATION", help="how long to record (e.g. 30m)")
    p.add_argument("--out", required=True, metavar="FILE", help="profile file to write (JSON, atomic)")
    p.add_argument("--window", default="60s", metavar="DURATION",
                   help="repeat window (default 60s; >= 30s for energy figures)")
    add_shared_flags(p)  # --config, --state-dir, --powercap-root, --interval: the settings table's rows


def _config(args: argparse.Namespace) -> tuple[Config, ServerConfig]:
    flag = [args.server] if "=" in args.server else None
    cfg = resolve(args.config, servers=flag, interval=args.interval, state_dir=args.state_dir,
                  powercap_root=args.powercap_root)
    if flag:
        return cfg, parse_server_flag(args.server)
    try:
        return cfg, cfg.server(args.server)
    except KeyError:
        known = ", ".join(s.name for s in cfg.servers)
        raise ConfigError(f"--server: no configured server named {args.server!r} (known: {known})") from None


def main(args: argparse.Namespace) -> int:
    cfg, server = _config(args)
    duration = parse_duration(args.duration, "--duration")
    window = parse_duration(args.window, "--window")
    if window > duration:
        raise ConfigError(f"--window: {args.window} is longer than --duration {args.duration}")
    check_writable(args.out, "--out")  # now, not after recording for --duration
    cfg = replace(cfg, servers=(server,))
    progress = Progress(sys.stderr, duration, f"recording {server.name}")
    intervals, info, status = asyncio.run(record_intervals(cfg, server, duration, progress=progress))
    prof = profile_mod.build_profile(intervals, info, server, duration, window)
    if prof.windows == 0:
        why = f"vLLM {status.reason}" if status is not None and not status.up else "no window carried load"
        print(f"kvwatt: nothing recorded for {server.name} ({why}); {args.out} not written", file=sys.stderr)
        return 1
    try:
        profile_mod.write(args.out, prof)
    except OSError as e:  # e.g. the disk filled up while recording
        raise ConfigError(f"--out: cannot write {args.out} ({e.strerror or e})") from None
    has_energy = any(b.joules_per_token is not None for b in prof.bands)
    print(f"recorded {prof.windows} windows of {format_window(window)} from {server.name} "
          f"({prof.energy} GPU J/token{'' if has_energy else ': none, no GPU energy'}) -> {args.out}")
    for b in prof.bands:
        if b.windows:
            jpt = "-" if b.joules_per_token is None else f"{b.joules_per_token:.4f} J/token"
            print(f"  KV p95 {b.label}: {b.windows} windows, {b.tokens_per_second:.1f} tokens/s, {jpt}")
    return 0
