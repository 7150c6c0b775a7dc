"""`kvwatt run`: the flags, the state directory, the web server and the daemon's loop (exporter.daemon)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from exporter import logsetup
from exporter.build import VersionAction, build_info
from exporter.config import (Config, ConfigError, parse_duration, parse_log_format, parse_log_level,
                             parse_telemetry_path, resolve, shown_server)
from exporter.daemon import Daemon
from exporter.energy.baseline import BaselineBook
from exporter.model import Model
from exporter.model.reference_book import ReferenceBook
from exporter.statedir import open_state_dir

if TYPE_CHECKING:  # imported when serving: other commands import this module for its parser only
    from exporter.serve.web import WebLimits
    from exporter.serve.webconfig import WebConfig

log = logging.getLogger("kvwatt")


class CannotListen(Exception):
    """Binding the HTTP address failed (port taken, address not local): the one start failure that exits."""


async def serve(cfg: Config, limits: "WebLimits | None" = None, web_config: "WebConfig | None" = None,
                telemetry_path: str = "/metrics") -> None:
    from exporter.serve.web import WebLimits, start_web

    state = open_state_dir(cfg.state_dir)  # locked for the daemon's life; never fatal (exporter.statedir)
    try:
        cfg = replace(cfg, state_dir=state.path)
        book = BaselineBook(state.path, cfg.idle_power_watts, read_only_reason=state.reason)
        refs = ReferenceBook(state.path, time.time, read_only_reason=state.reason)
        daemon = Daemon(cfg, model=Model(cfg, book=book, references=refs))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, daemon.stop)
        try:
            runner = await start_web(daemon, cfg.host, cfg.port, limits or WebLimits(), web_config,
                                     telemetry_path)
        except OSError as e:  # only here: an OSError elsewhere (e.g. the state dir) is not about serving
            raise CannotListen(e.strerror or str(e)) from e
        log.info("%s listening on %s%s (%s), watching %s", build_info().line(), cfg.listen, telemetry_path,
                 web_config.describe() if web_config else "http, no auth",
                 ", ".join(shown_server(s) for s in cfg.servers))
        try:
            await daemon.run_loop()
        finally:
            await runner.cleanup()
    finally:
        state.close()
    log.info("kvwatt stopped")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML configuration file (also $KVWATT_CONFIG)")
    p.add_argument("--server", action="append", metavar="NAME=URL",
                   help="a vLLM server root URL to watch (repeatable; replaces the file's server list)")
    p.add_argument("--web.listen-address", "--listen", dest="listen", metavar="HOST:PORT",
                   help="address to serve /metrics on (default 0.0.0.0:8492; also the key listen, $KVWATT_LISTEN)")
    p.add_argument("--web.telemetry-path", dest="telemetry_path", metavar="PATH", default="/metrics",
                   help="path of the exposition (default /metrics)")
    p.add_argument("--interval", metavar="DURATION",
                   help="sampling interval: 500ms, 2s, or bare seconds (default 1s; 50ms to 60s)")
    p.add_argument("--powercap-root", metavar="DIR", help="powercap tree for RAPL (default /sys/class/powercap)")
    p.add_argument("--state-dir", metavar="DIR", help="where baselines are persisted (default /var/lib/kvwatt, "
                   "or ~/.local/state/kvwatt when that is not writable)")
    p.add_argument("--log.level", "--log-level", dest="log_level", metavar="LEVEL",
                   help="debug, info, warn or error (default info; also the key log_level, $KVWATT_LOG_LEVEL)")
    p.add_argument("--log.format", dest="log_format", metavar="FORMAT",
                   help="logfmt or json, one line per record (default logfmt; also log_format, $KVWATT_LOG_FORMAT)")
    p.add_argument("--version", action=VersionAction)
    p.add_argument("--web.config.file", dest="web_config_file", metavar="FILE",
                   help="TLS and basic auth of every endpoint, Prometheus exporter-toolkit format "
                        "(also the config key web_config_file; docs/deployment.md)")
    p.add_argument("--web.max-connections", dest="web_max_connections", metavar="N", type=int, default=512,
                   help="connections open at once; a new one beyond closes the least recently active "
                        "(default 512, lowered to fit the open-file limit)")
    p.add_argument("--web.read-timeout", dest="web_read_timeout", metavar="DURATION", default="30s",
                   help="an idle connection, one trickling its request headers or its TLS handshake is "
                        "closed after this (default 30s)")


def config_from_args(args: argparse.Namespace) -> Config:
    level = parse_log_level(args.log_level, "--log.level") if args.log_level is not None else None
    fmt = parse_log_format(args.log_format, "--log.format") if args.log_format is not None else None
    return resolve(args.config, servers=args.server, listen=args.listen, interval=args.interval,
                   powercap_root=args.powercap_root, state_dir=args.state_dir, log_level=level, log_format=fmt)


def web_settings(args: argparse.Namespace, cfg: Config):
    """The web limits and configuration from the flags (ConfigError on bad input); raises the fd limit."""
    from exporter.serve import connections, webconfig
    from exporter.serve.web import WebLimits

    if args.web_max_connections <= 0:
        raise ConfigError(f"--web.max-connections: expected a positive integer, got {args.web_max_connections}")
    read_timeout = parse_duration(args.web_read_timeout, "--web.read-timeout")
    path = args.web_config_file or cfg.web_config_path
    web_config = webconfig.load(path) if path else None
    before, soft = connections.raise_fd_limit()
    if soft != before:
        log.info("open-file limit raised from %d to %d", before, soft)
    max_connections = connections.fit_max_connections(args.web_max_connections, soft)
    if max_connections < args.web_max_connections:
        log.info("--web.max-connections lowered from %d to %d to fit the open-file limit %d",
                 args.web_max_connections, max_connections, soft)
    return WebLimits(max_connections, read_timeout), web_config


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    telemetry_path = parse_telemetry_path(args.telemetry_path, "--web.telemetry-path")
    logsetup.setup(cfg.log_level, cfg.log_format)
    limits, web_config = web_settings(args, cfg)
    try:
        asyncio.run(serve(cfg, limits, web_config, telemetry_path))
    except CannotListen as e:  # e.g. the port is taken
        log.error("cannot serve on %s: %s", cfg.listen, e)
        return 2
    return 0
