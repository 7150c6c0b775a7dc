"""File < environment < flags: each layer overrides the one before (resolve)."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from exporter.config.values import (
    DEFAULT_SERVER_URL, ConfigError, shown, parse_interval, parse_listen, parse_log_level, parse_log_format)
from exporter.config.schema import ServerConfig, Config, check_prices, _server, _servers
from exporter.config.settings import PRICE_ENVIRONMENT
from exporter.config.files import load_file


def parse_server_flag(text: str, key: str = "--server") -> ServerConfig:
    name, sep, url = text.partition("=")
    if not sep or not name:
        raise ConfigError(f"{key}: expected NAME=URL, got {shown(text)}")
    return _server({"name": name, "url": url}, f"{key} {name}")


def keep_settings(configured: tuple[ServerConfig, ...], given: tuple[ServerConfig, ...]) -> tuple[ServerConfig, ...]:
    """Servers given as NAME=URL (--server, KVWATT_SERVERS) keep the per-server settings (gpus, reference
    share, model, pairing ...) the configuration file has for the same NAME; only the URL is replaced."""
    by_name = {s.name: s for s in configured}
    return tuple(replace(by_name[s.name], url=s.url) if s.name in by_name else s for s in given)


def apply_environment(cfg: Config, env: dict[str, str] | None = None) -> Config:
    """KVWATT_LISTEN, KVWATT_INTERVAL, KVWATT_SERVERS ("a=URL,b=URL"), KVWATT_STATE_DIR, KVWATT_POWERCAP_ROOT,
    KVWATT_LOG_LEVEL, KVWATT_LOG_FORMAT, and PRICE_ENVIRONMENT's (money and carbon)."""
    env = os.environ if env is None else env
    kw: dict[str, Any] = {}
    if env.get("KVWATT_LISTEN"):
        kw["listen"] = parse_listen(env["KVWATT_LISTEN"], "KVWATT_LISTEN")
    if env.get("KVWATT_INTERVAL"):
        kw["interval_seconds"] = parse_interval(env["KVWATT_INTERVAL"], "KVWATT_INTERVAL")
    if env.get("KVWATT_SERVERS"):
        kw["servers"] = keep_settings(cfg.servers, _servers(
            [{"name": n, "url": u} for n, u in (p.partition("=")[::2] for p in env["KVWATT_SERVERS"].split(","))],
            "KVWATT_SERVERS"))
    if env.get("KVWATT_STATE_DIR"):
        kw["state_dir"] = env["KVWATT_STATE_DIR"]
    if env.get("KVWATT_POWERCAP_ROOT"):
        kw["powercap_root"] = env["KVWATT_POWERCAP_ROOT"]
    if env.get("KVWATT_LOG_LEVEL"):
        kw["log_level"] = parse_log_level(env["KVWATT_LOG_LEVEL"], "KVWATT_LOG_LEVEL")
    if env.get("KVWATT_LOG_FORMAT"):
        kw["log_format"] = parse_log_format(env["KVWATT_LOG_FORMAT"], "KVWATT_LOG_FORMAT")
    for var, attribute, parse in PRICE_ENVIRONMENT:
        if env.get(var):
            kw[attribute] = parse(env[var], var)
    return replace(cfg, **kw)


def resolve(config_path: str | None, servers: list[str] | None = None, listen: str | None = None,
            interval: str | None = None, env: dict[str, str] | None = None, **overrides: Any) -> Config:
    """File < environment < flags. With no server anywhere, watch DEFAULT_SERVER_URL as 'default'."""
    env = os.environ if env is None else env
    path = config_path or env.get("KVWATT_CONFIG")
    cfg = load_file(path) if path else Config()
    from_file = cfg.servers
    cfg = apply_environment(cfg, env)
    kw: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
    if servers:
        kw["servers"] = keep_settings(from_file, _servers(
            [{"name": s.name, "url": s.url} for s in map(parse_server_flag, servers)], "--server"))
    if listen:
        kw["listen"] = parse_listen(listen, "--listen")
    if interval:
        kw["interval_seconds"] = parse_interval(interval, "--interval")
    cfg = check_prices(replace(cfg, **kw))
    if not cfg.servers:
        cfg = replace(cfg, servers=(ServerConfig(name="default", url=DEFAULT_SERVER_URL),))
    return cfg
