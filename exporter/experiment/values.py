"""Typed checks for plan values: each returns the value or raises ConfigError naming the key."""

from __future__ import annotations

import re
from typing import Any

from exporter.config import ConfigError, parse_duration

BUILTINS = ("port", "condition", "run", "repeat", "run_dir", "plan_dir")  # placeholders every template has


def join_key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def known_keys(data: dict, allowed: tuple[str, ...], prefix: str) -> None:
    for k in data:
        if k not in allowed:
            raise ConfigError(f"{join_key(prefix, str(k))}: unknown key (known: {', '.join(allowed)})")


def mapping(value: Any, key: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a mapping, got {value!r}")
    return value


def string(value: Any, key: str) -> str:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a string, got {value!r} (YAML reads on/off/yes/no as booleans: "
                          "quote it)")
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: expected a non-empty string, got {value!r}")
    return value


def integer(value: Any, key: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{key}: must be >= {minimum}, got {value}")
    return value


def number(value: Any, key: str, minimum: float, open_below: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if value < minimum or (open_below and value == minimum):
        raise ConfigError(f"{key}: must be {'>' if open_below else '>='} {minimum:g}, got {value!r}")
    return float(value)


def ratio(value: Any, key: str) -> float:
    v = number(value, key, 0.0, True)
    if v > 1.0:
        raise ConfigError(f"{key}: must be <= 1, got {value!r}")
    return v


def duration(value: Any, key: str, zero_ok: bool = False) -> float:
    if zero_ok and not isinstance(value, bool) and (value == 0 or str(value).strip() in ("0", "0s")):
        return 0.0
    return parse_duration(value, key)


def placeholder_vars(value: Any, key: str) -> dict[str, str]:
    out = {}
    for name, v in mapping(value, key).items():
        k = f"{key}.{name}"
        if not isinstance(name, str) or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
            raise ConfigError(f"{k}: placeholder names are letters, digits and '_'")
        if name in BUILTINS:
            raise ConfigError(f"{k}: reserved placeholder name (built in: {', '.join(BUILTINS)})")
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise ConfigError(f"{k}: expected a string or a number, got {v!r}")
        out[name] = str(v)
    return out


def string_map(value: Any, key: str) -> dict[str, str]:
    out = {}
    for name, v in mapping(value, key).items():
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise ConfigError(f"{key}.{name}: expected a string or a number, got {v!r}")
        out[str(name)] = str(v)
    return out


def argv(value: Any, key: str, allow_empty: bool) -> tuple[str, ...]:
    if isinstance(value, str):
        raise ConfigError(f"{key}: expected a list of argv strings (run without a shell), got a string")
    if not isinstance(value, list) or (not value and not allow_empty):
        raise ConfigError(f"{key}: expected a non-empty list of argv strings, got {value!r}")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, (str, int, float)) or item == "":
            raise ConfigError(f"{key}[{i}]: expected a non-empty string, got {item!r}")
        out.append(str(item))
    return tuple(out)


def choice(value: Any, key: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ConfigError(f"{key}: expected one of {', '.join(allowed)}, got {value!r}")
    return value
