"""The one table of settings: each key's YAML name, Config attribute, parser, environment variable and flag."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from exporter import rules
from exporter.config.values import (
    ConfigError, parse_duration, _duration_at_most, parse_interval, unknown_key, _float_range, _int_pos,
    _bool, THRESHOLD_SOURCES, _choice, _str, parse_listen, parse_log_level, parse_log_format, _opt_in,
    _windows, _watts_map, parse_price, parse_currency)
from exporter.config.schema import Config, _servers


def _from_rule(rule: rules.Rule, parse: Any) -> dict[str, tuple[str, Any]]:
    """A KEYS entry for a shared rule: its YAML key and Config attribute come from exporter/rules.py."""
    return {rule.key: (rule.attribute, parse)}


KEYS: dict[str, tuple[str, Any]] = {
    "listen": ("listen", parse_listen),
    **_from_rule(rules.INTERVAL, parse_interval),
    **_from_rule(rules.WINDOWS, _windows),
    **_from_rule(rules.KV_PRESSURE_THRESHOLD, _float_range(0.0, 1.0, lo_open=True)),
    "kv_pressure_threshold_source": ("kv_pressure_threshold_source", lambda v, k: _choice(v, k, THRESHOLD_SOURCES)),
    **_from_rule(rules.THRESHOLD_WINDOW, parse_duration),
    **_from_rule(rules.THRESHOLD_HISTORY, parse_duration),
    **_from_rule(rules.THRESHOLD_MIN_WINDOWS, _int_pos),
    **_from_rule(rules.PREEMPTION_ONSET_PER_MINUTE, _float_range(0.0, lo_open=True)),
    "http_timeout": ("http_timeout_seconds", parse_duration),
    "max_body_bytes": ("max_body_bytes", _int_pos),
    "state_dir": ("state_dir", _str),
    "powercap_root": ("powercap_root", _str),
    "nvml": ("nvml_enabled", _bool),
    **_from_rule(rules.IDLE_SETTLE, parse_duration),
    **_from_rule(rules.IDLE_MIN_DURATION, parse_duration),
    **_from_rule(rules.MIN_LOAD_DURATION, parse_duration),
    "idle_power_watts": ("idle_power_watts", _watts_map),
    **_from_rule(rules.P99_TOOL_LATENCY, parse_duration),
    **_from_rule(rules.BUFFER_HEADROOM, _float_range(1.0)),
    **_from_rule(rules.COLLAPSE_THROUGHPUT_DROP_RATIO, _float_range(0.0, 1.0, lo_open=True)),
    **_from_rule(rules.COLLAPSE_POWER_NEAR_IDLE_RATIO, _float_range(1.0)),
    **_from_rule(rules.COLLAPSE_REFERENCE_WINDOW, parse_duration),
    **_from_rule(rules.LOAD_TO_COMPUTE_COST_RATIO, _float_range(0.0)),
    "electricity_price_per_kwh": ("electricity_price", lambda v, k: parse_price(v, k)),
    "electricity_currency": ("electricity_currency", lambda v, k: parse_currency(v, k)),
    "carbon_intensity_g_per_kwh": ("carbon_intensity", lambda v, k: parse_price(v, k, "carbon_intensity")),
    **_from_rule(rules.PRICE_REFRESH, parse_duration),
    **_from_rule(rules.PRICE_MAX_AGE, parse_duration),
    **_from_rule(rules.PHASE_MIN_WINDOWS, _int_pos),
    **_from_rule(rules.PHASE_MAX_CONDITION, _float_range(1.0)),
    **_from_rule(rules.PHASE_HISTORY, _duration_at_most(rules.PHASE_HISTORY.most, "168h (a week)")),
    "metrics_opt_in": ("metrics_opt_in", _opt_in),
    "web_config_file": ("web_config_path", _str),
    "log_level": ("log_level", parse_log_level),
    "log_format": ("log_format", parse_log_format),
    "servers": ("servers", None),  # parsed by _servers
}


def from_mapping(data: Any, base: Config | None = None) -> Config:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"(top level): expected a mapping of keys, got {type(data).__name__}")
    kw: dict[str, Any] = {}
    for key, value in data.items():
        if key not in KEYS:
            raise unknown_key(str(key), key, KEYS)
        field_name, parser = KEYS[key]
        kw[field_name] = _servers(value) if key == "servers" else parser(value, key)
    return replace(base or Config(), **kw)


# money and carbon from the environment: (variable, Config attribute, parser)
PRICE_ENVIRONMENT = (
    ("KVWATT_ELECTRICITY_PRICE_PER_KWH", "electricity_price", parse_price),
    ("KVWATT_ELECTRICITY_CURRENCY", "electricity_currency", parse_currency),
    ("KVWATT_CARBON_INTENSITY_G_PER_KWH", "carbon_intensity", lambda v, k: parse_price(v, k, "carbon_intensity")),
)
