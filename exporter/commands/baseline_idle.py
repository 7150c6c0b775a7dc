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
from dataclasses import replace

from exporter.config import (
    Config,
    ConfigError,
    ServerConfig,
    check_writable,
    parse_duration,
    parse_server_flag,
    resolve,
)
from exporter.config.settings import add_shared_flags
from exporter.idle.baseline import BaselineBook
from exporter.idle.measure import Busy, measure
from exporter.runtime.statedir import resolve_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", default="30s", metavar="DURATION", help="how long to measure (default 30s)")
    p.add_argument("--settle", metavar="DURATION",
                   help="wait this long, idle, before measuring (default: idle_settle from the config, 30s)")
    # a selector, not run's repeatable list: the one server (configured, or NAME=URL) whose GPUs to measure
    p.add_argument("--server", metavar="NAME[=URL]",
                   help="the server whose GPUs to measure (a configured name, or NAME=URL); default: all")
    p.add_argument("--no-server-check", action="store_true",
                   help="measure without checking a vLLM server (understates idle without a loaded model)")
    add_shared_flags(p)  # --config, --state-dir, --powercap-root, --interval: the settings table's rows


def _config(args: argparse.Namespace) -> tuple[Config, list[ServerConfig]]:
    flag = [args.server] if args.server and "=" in args.server else None
    cfg = resolve(args.config, servers=flag, interval=args.interval, state_dir=args.state_dir,
                  powercap_root=args.powercap_root)
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


def main(args: argparse.Namespace) -> int:
    cfg, checked = _config(args)
    duration = parse_duration(args.duration, "--duration")
    settle = cfg.idle_settle_seconds if args.settle is None else parse_duration(args.settle, "--settle", zero_ok=True)
    interval = cfg.interval_seconds  # the table's --interval over the file's and the environment's
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
