"""File < environment < flags: each layer overrides the one before (resolve)."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from exporter.config.files import load_file
from exporter.config.schema import Config, ServerConfig, check_prices, parse_server, parse_servers
from exporter.config.settings import CONFIG_ENV, ENVIRONMENT
from exporter.config.values import DEFAULT_SERVER_URL, ConfigError, parse_interval, parse_listen, shown


def parse_server_flag(text: str, key: str = "--server") -> ServerConfig:
    name, sep, url = text.partition("=")
    if not sep or not name:
        raise ConfigError(f"{key}: expected NAME=URL, got {shown(text)}")
    return parse_server({"name": name, "url": url}, f"{key} {name}")


def keep_settings(configured: tuple[ServerConfig, ...], given: tuple[ServerConfig, ...]) -> tuple[ServerConfig, ...]:
    """Servers given as NAME=URL (--server, KVWATT_SERVERS) keep the per-server settings (gpus, reference
    share, model, pairing ...) the configuration file has for the same NAME; only the URL is replaced."""
    by_name = {s.name: s for s in configured}
    return tuple(replace(by_name[s.name], url=s.url) if s.name in by_name else s for s in given)


def apply_environment(cfg: Config, env: dict[str, str] | None = None) -> Config:
    """Every variable of the settings table (settings.ENVIRONMENT: KVWATT_LISTEN, KVWATT_INTERVAL, KVWATT_SERVERS
    as "a=URL,b=URL", KVWATT_STATE_DIR, the log and the money-and-carbon ones ...) that is set and not empty,
    parsed as its key is. KVWATT_CONFIG names the file (resolve)."""
    env = os.environ if env is None else env
    kw: dict[str, Any] = {}
    for s in ENVIRONMENT:
        text = env.get(s.env)
        if not text or s.attribute is None:
            continue
        if s.attribute == "servers":  # NAME=URL pairs keep the file's per-server settings
            kw["servers"] = keep_settings(cfg.servers, parse_servers(
                [{"name": n, "url": u} for n, u in (p.partition("=")[::2] for p in text.split(","))], s.env))
        else:
            kw[s.attribute] = s.parse(text, s.env)
    return replace(cfg, **kw)


def resolve(config_path: str | None, servers: list[str] | None = None, listen: str | None = None,
            interval: str | None = None, env: dict[str, str] | None = None, **overrides: Any) -> Config:
    """File < environment < flags. With no server anywhere, watch DEFAULT_SERVER_URL as 'default'."""
    env = os.environ if env is None else env
    path = config_path or env.get(CONFIG_ENV)
    cfg = load_file(path) if path else Config()
    from_file = cfg.servers
    cfg = apply_environment(cfg, env)
    kw: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
    if servers:
        kw["servers"] = keep_settings(from_file, parse_servers(
            [{"name": s.name, "url": s.url} for s in map(parse_server_flag, servers)], "--server"))
    if listen:
        kw["listen"] = parse_listen(listen, "--listen")
    if interval:
        kw["interval_seconds"] = parse_interval(interval, "--interval")
    cfg = check_prices(replace(cfg, **kw))
    if not cfg.servers:
        cfg = replace(cfg, servers=(ServerConfig(name="default", url=DEFAULT_SERVER_URL),))
    return cfg
