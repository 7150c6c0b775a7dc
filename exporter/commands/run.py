"""`kvwatt run`: the flags and the web settings; the service itself (state directory, model, web server, the
daemon's loop) is exporter/runtime/service.py."""

from __future__ import annotations

import argparse
import asyncio
import logging

from exporter.config import (
    Config,
    ConfigError,
    add_flags,
    flag_overrides,
    parse_duration,
    parse_telemetry_path,
    resolve,
)
from exporter.runtime import logsetup
from exporter.runtime.build import VersionAction
from exporter.runtime.service import CannotListen, serve
from exporter.serve import connections, webconfig
from exporter.serve.web import WebLimits

log = logging.getLogger("kvwatt")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p)  # every flag is a row of the settings table (exporter/config/settings.py)
    p.add_argument("--version", action=VersionAction)


def config_from_args(args: argparse.Namespace) -> Config:
    overrides = flag_overrides(args)  # parsed first: a bad flag is reported before the file is read
    return resolve(args.config, servers=args.server, listen=args.listen, interval=args.interval, **overrides)


def web_settings(args: argparse.Namespace, cfg: Config):
    """The web limits and configuration from the flags (ConfigError on bad input); raises the fd limit. Returns
    what changed as lines to log once kvwatt listens: bad input found later (a model config, a recorded profile)
    is then still one line alone."""
    if args.web_max_connections <= 0:
        raise ConfigError(f"--web.max-connections: expected a positive integer, got {args.web_max_connections}")
    read_timeout = parse_duration(args.web_read_timeout, "--web.read-timeout")
    path = args.web_config_file or cfg.web_config_path
    web_config = webconfig.load(path) if path else None
    before, soft = connections.raise_fd_limit()
    notes = [f"open-file limit raised from {before} to {soft}"] if soft != before else []
    max_connections = connections.fit_max_connections(args.web_max_connections, soft)
    if max_connections < args.web_max_connections:
        notes.append(f"--web.max-connections lowered from {args.web_max_connections} to {max_connections} to fit "
                     f"the open-file limit {soft}")
    return WebLimits(max_connections, read_timeout), web_config, tuple(notes)


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    telemetry_path = parse_telemetry_path(args.telemetry_path, "--web.telemetry-path")
    logsetup.setup(cfg.log_level, cfg.log_format)
    limits, web_config, notes = web_settings(args, cfg)
    try:
        asyncio.run(serve(cfg, limits, web_config, telemetry_path, notes=notes))
    except CannotListen as e:  # e.g. the port is taken
        log.error("cannot serve on %s: %s", cfg.listen, e)
        return 2
    return 0
