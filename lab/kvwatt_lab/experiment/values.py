"""Typed checks for plan values: each returns the value or raises ConfigError naming the key."""

from __future__ import annotations

import re
from typing import Any

from exporter.config import ConfigError, finite_number, parse_duration, shown, unknown_key

BUILTINS = ("port", "condition", "run", "repeat", "run_dir", "plan_dir")  # placeholders every template has


def join_key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def known_keys(data: dict, allowed: tuple[str, ...], prefix: str) -> None:
    for k in data:
        if k not in allowed:
            raise unknown_key(join_key(prefix, str(k)), k, allowed)


def mapping(value: Any, key: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a mapping, got {shown(value)}")
    return value


def _no_nul(text: str, key: str) -> str:
    """Plan strings end up in argv, the environment and paths, none of which can hold a NUL."""
    if "\0" in text:
        raise ConfigError(f"{key}: contains a NUL character, got {shown(text)}")
    return text


def string(value: Any, key: str) -> str:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a string, got {value!r} (YAML reads on/off/yes/no as booleans: "
                          "quote it)")
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: expected a non-empty string, got {shown(value)}")
    return _no_nul(value, key)


def integer(value: Any, key: str, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}: expected an integer, got {shown(value)}")
    if value < minimum:
        raise ConfigError(f"{key}: must be >= {minimum}, got {shown(value)}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{key}: must be <= {maximum} (the limit), got {shown(value)}")
    return value


def number(value: Any, key: str, minimum: float, open_below: bool, maximum: float | None = None) -> float:
    v = finite_number(value, key)
    if v < minimum or (open_below and v == minimum):
        raise ConfigError(f"{key}: must be {'>' if open_below else '>='} {minimum:g}, got {shown(value)}")
    if maximum is not None and v > maximum:
        raise ConfigError(f"{key}: must be <= {maximum:.15g} (the limit), got {shown(value)}")
    return v


def ratio(value: Any, key: str) -> float:
    v = number(value, key, 0.0, True)
    if v > 1.0:
        raise ConfigError(f"{key}: must be <= 1, got {shown(value)}")
    return v


def duration(value: Any, key: str, zero_ok: bool = False) -> float:
    return parse_duration(value, key, zero_ok)


def _scalar(v: Any, key: str) -> str:
    """A string or a number, as the string a template substitutes."""
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise ConfigError(f"{key}: expected a string or a number, got {shown(v)}")
    return _no_nul(str(v), key)


def placeholder_vars(value: Any, key: str) -> dict[str, str]:
    out = {}
    for name, v in mapping(value, key).items():
        k = f"{key}.{name}"
        if not isinstance(name, str) or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
            raise ConfigError(f"{k}: placeholder names are letters, digits and '_'")
        if name in BUILTINS:
            raise ConfigError(f"{k}: reserved placeholder name (built in: {', '.join(BUILTINS)})")
        out[name] = _scalar(v, k)
    return out


def env_map(value: Any, key: str) -> dict[str, str]:
    """Environment variables for the server; values are templates like every other plan string."""
    out = {}
    for name, v in mapping(value, key).items():
        out[_env_name(name, key)] = _scalar(v, f"{key}.{name}")
    return out


def _env_name(name: Any, key: str) -> str:
    """Non-empty, without '=' or NUL: the OS could not pass anything else on (Popen raises ValueError)."""
    text = "" if isinstance(name, bool) or not isinstance(name, (str, int)) else str(name)
    if not text or "=" in text or "\0" in text:
        raise ConfigError(f"{key}: {shown(name)} is not an environment variable name (non-empty, without '=' "
                          "or NUL)")
    return text


def argv(value: Any, key: str, allow_empty: bool) -> tuple[str, ...]:
    if isinstance(value, str):
        raise ConfigError(f"{key}: expected a list of argv strings (run without a shell), got a string")
    if not isinstance(value, list) or (not value and not allow_empty):
        raise ConfigError(f"{key}: expected a non-empty list of argv strings, got {shown(value)}")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, (str, int, float)) or item == "":
            raise ConfigError(f"{key}[{i}]: expected a non-empty string, got {shown(item)}")
        out.append(_no_nul(str(item), f"{key}[{i}]"))
    return tuple(out)


def choice(value: Any, key: str, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ConfigError(f"{key}: expected one of {', '.join(allowed)}, got {shown(value)}")
    return value
