"""`kvwatt run`: the flags and the web settings; the service itself (state directory, model, web server, the
daemon's loop) is exporter/service.py."""

from __future__ import annotations

import argparse
import asyncio
import logging

from exporter import logsetup
from exporter.build import VersionAction
from exporter.config import (Config, ConfigError, parse_currency, parse_duration, parse_log_format,
                             parse_log_level, parse_price, parse_telemetry_path, resolve)
from exporter.serve import connections, webconfig
from exporter.serve.web import WebLimits
from exporter.service import CannotListen, serve

log = logging.getLogger("kvwatt")


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
    p.add_argument("--electricity-price-per-kwh", dest="electricity_price", metavar="PRICE|URL",
                   help="electricity price per kWh: a number, or a Prometheus .../api/v1/query?query=... URL, or a "
                        "/metrics URL with #series (also electricity_price_per_kwh, "
                        "$KVWATT_ELECTRICITY_PRICE_PER_KWH; needs --electricity-currency)")
    p.add_argument("--electricity-currency", dest="electricity_currency", metavar="CODE",
                   help="ISO 4217 code of that price, e.g. EUR (also electricity_currency, "
                        "$KVWATT_ELECTRICITY_CURRENCY)")
    p.add_argument("--carbon-intensity-g-per-kwh", dest="carbon_intensity", metavar="GRAMS|URL",
                   help="grid carbon intensity in g CO2e per kWh: a number or a URL as for the price (also "
                        "carbon_intensity_g_per_kwh, $KVWATT_CARBON_INTENSITY_G_PER_KWH)")
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
                   powercap_root=args.powercap_root, state_dir=args.state_dir, log_level=level, log_format=fmt,
                   **price_flags(args))


def price_flags(args: argparse.Namespace) -> dict:
    """The money-and-carbon flags, parsed (ConfigError on a bad one); those not given are None."""
    def parsed(name: str, flag: str, parse):
        value = getattr(args, name, None)
        return None if value is None else parse(value, flag)
    return {"electricity_price": parsed("electricity_price", "--electricity-price-per-kwh", parse_price),
            "electricity_currency": parsed("electricity_currency", "--electricity-currency", parse_currency),
            "carbon_intensity": parsed("carbon_intensity", "--carbon-intensity-g-per-kwh",
                                       lambda v, k: parse_price(v, k, "carbon_intensity"))}


def web_settings(args: argparse.Namespace, cfg: Config):
    """The web limits and configuration from the flags (ConfigError on bad input); raises the fd limit."""
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
