"""Configuration: YAML file, then environment, then flags (each overrides the one before).

Every key is validated; a bad one raises ConfigError whose message names the key and the problem, and the
CLI turns that into one line on stderr and exit status 2. The README's configuration reference lists every key
(generated from ``KEYS`` below by exporter/reference.py; tests/test_reference.py keeps it in step).
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import re
import reprlib
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlparse, urlsplit

import yaml

from exporter import optin, rules
from exporter.limits import MAX_FILE_BYTES

DEFAULT_SERVER_URL = "http://127.0.0.1:8000"
DEFAULT_LISTEN = "0.0.0.0:8492"
DEFAULT_STATE_DIR = "/var/lib/kvwatt"  # not writable: the per-user directory (exporter.statedir)


class ConfigError(ValueError):
    """Bad configuration or bad command-line input: one line, exit status 2."""


_DURATION_RE = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)?$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
# The shortest rolling window (`windows`): one sampling tick at the default interval. A shorter window holds at
# most one sample, no rate or p95 (and 1ms was labelled `0h`).
MIN_WINDOW_SECONDS = 1.0

# Values in error messages are shown abridged: a few hundred bytes of YAML with aliases can expand to
# billions of elements, and a YAML integer can have thousands of digits (str() refuses beyond 4300).
_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxlist, _SHOW.maxtuple, _SHOW.maxdict, _SHOW.maxset = 2, 6, 6, 6, 6
_SHOW.maxstring, _SHOW.maxother = 120, 120
_SHOWN_CHARS = 200


def shown(value: Any) -> str:
    """``repr(value)`` for an error message, bounded in length and in the work it takes."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = _SHOW.repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS - 3] + "..."


def is_finite(value: Any) -> bool:
    """A real number, not NaN or infinite, and within a float's range (YAML and JSON integers are not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer beyond 1.8e308
        return False


def finite_number(value: Any, key: str, expected: str = "a number") -> float:
    """A YAML/JSON/flag number as a finite float. Every number kvwatt reads from input passes here (or through
    is_finite), so .inf, .nan and integers too large for a float are refused the same way by every command."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}: expected {expected}, got {shown(value)}")
    if not is_finite(value):
        raise ConfigError(f"{key}: expected a finite number, got {shown(value)}")
    return float(value)


def parse_duration(value: Any, key: str, zero_ok: bool = False) -> float:
    """'500ms', '90s', '5m', '1.5h', '30' or 30 (bare: seconds) -> seconds, finite and > 0 (>= 0 with
    ``zero_ok``). The one duration parser of every command, flag, config key and environment variable.
    Raises ConfigError naming ``key``."""
    expected = "a duration like 30s or 5m (a bare number is seconds)"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = finite_number(value, key, expected)
    else:
        m = _DURATION_RE.match(value.strip()) if isinstance(value, str) else None
        if not m:
            raise ConfigError(f"{key}: expected {expected}, got {shown(value)}")
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
        if not math.isfinite(seconds):  # 400 digits overflow a float: refused like .inf
            raise ConfigError(f"{key}: expected a finite number, got {shown(value)}")
    if zero_ok and seconds == 0:
        return 0.0
    if not seconds > 0:
        raise ConfigError(f"{key}: must be {'zero or more' if zero_ok else 'greater than zero'}, got {shown(value)}")
    return seconds


def _duration_at_most(most: float, words: str):
    """parse_duration, at most ``most`` seconds (``words``: the bound as the error says it)."""
    def parse(value: Any, key: str) -> float:
        seconds = parse_duration(value, key)
        if seconds > most:
            raise ConfigError(f"{key}: must be at most {words}, got {shown(value)}")
        return seconds
    parse.duration = True  # exporter/reference.py writes its default as a duration
    return parse



def parse_interval(value: Any, key: str) -> float:
    """A sampling interval: a duration (parse_duration) from 50ms to 60s, the same for every command."""
    seconds = parse_duration(value, key)
    if seconds < 0.05 or seconds > 60:
        raise ConfigError(f"{key}: must be between 50ms and 60s, got {seconds:g}s")
    return seconds


def duration_arg(zero_ok: bool = False):
    """parse_duration as an argparse ``type=``: a bad value is argparse's one-line error, exit status 2."""
    def parse(text: str) -> float:
        try:
            return parse_duration(text, "", zero_ok)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(": ")) from None
    return parse


def unknown_key(where: str, name: Any, known) -> ConfigError:
    """The error for an unknown key ``name`` at ``where`` (its full path): the closest known key suggested
    (a typo is the usual cause), then every known one."""
    known = list(known)
    close = difflib.get_close_matches(str(name), known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ConfigError(f"{where}: unknown key ({hint}known: {', '.join(known)})")


def format_window(seconds: float) -> str:
    """Label value for a window, exact, in the largest unit that divides it: 3600 -> '1h', 300 -> '5m',
    90 -> '90s', 1.5 -> '1500ms', 0.001 -> '1ms' (it was rounded to whole seconds: 1ms read '0h', 1.5s '2s').
    Whole-second windows keep the labels they always had. Not a whole number of milliseconds: seconds as
    Python writes the float ('0.0001s')."""
    ms = round(seconds * 1000)
    if not math.isclose(ms, seconds * 1000, rel_tol=1e-12, abs_tol=1e-9) or ms <= 0:
        return f"{seconds!r}s"
    for unit, unit_ms in (("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms % unit_ms == 0:
            return f"{ms // unit_ms}{unit}"
    return f"{ms}ms"


@dataclass(frozen=True)
class ServerConfig:
    name: str
    url: str
    gpus: tuple[str, ...] = ()  # GPU indices or UUIDs; empty = all GPUs when this is the only server
    reference_local_compute_share: float | None = None
    model_config_path: str | None = None  # HF config.json for kappa_crit / break-even
    model: dict[str, float] = field(default_factory=dict)  # layers, kv_heads, head_dim, dtype_bytes, ...
    hardware: dict[str, float] = field(default_factory=dict)  # flops_per_second, host_device_bytes_per_second
    pair_off_server: str | None = None  # paired dE%: the OFF twin of this (ON) server
    recorded_baseline_path: str | None = None  # OFF profile from `kvwatt baseline record`
    # further /metrics of the same server (LMCache's or Dynamo KVBM's own port), merged into its reading
    sidecar_urls: tuple[str, ...] = ()
    offload_tier_bytes: dict[str, float] = field(default_factory=dict)  # vLLM tiering: tier label -> capacity
    # vLLM --kv-cache-metrics-sample: the share of KV blocks its residency histograms track (exported nowhere);
    # scales sampled evictions to blocks (derive/residency.py). vLLM's default 0.01.
    kv_cache_metrics_sample: float = 0.01


@dataclass(frozen=True)
class PriceSetting:
    """An electricity price (per kWh) or a carbon intensity (g CO2e per kWh): a configured number, or a URL
    read by exporter/sources/tariff.py -- a Prometheus HTTP API instant query (JSON, one sample), or any
    /metrics-style exposition with the series named after ``#`` (docs/energy.md, "Money and carbon")."""

    value: float | None = None
    url: str | None = None  # the URL read (without the #series fragment)
    series: str | None = None  # exposition form: the series name, optionally with {label="value",...}

    @property
    def shown(self) -> str:
        """The setting as it may be shown (password masked)."""
        if self.url is None:
            return f"{self.value:g}"
        return redacted_url(self.url) + (f"#{self.series}" if self.series else "")


@dataclass(frozen=True)
class Config:
    servers: tuple[ServerConfig, ...] = ()
    listen: str = DEFAULT_LISTEN
    interval_seconds: float = rules.INTERVAL.default
    windows_seconds: tuple[float, ...] = rules.WINDOWS.default
    kv_pressure_threshold_ratio: float = rules.KV_PRESSURE_THRESHOLD.default
    # regime threshold: "located" (from the server's own history once there is evidence, methods.md s10; the
    # configured one until then) or "configured" (always kv_pressure_threshold)
    kv_pressure_threshold_source: str = "located"
    # located-threshold evidence (methods.md s10): one point per completed threshold window, kept for the history
    threshold_window_seconds: float = rules.THRESHOLD_WINDOW.default
    threshold_history_seconds: float = rules.THRESHOLD_HISTORY.default
    threshold_min_windows: int = rules.THRESHOLD_MIN_WINDOWS.default
    preemption_onset_per_minute: float = rules.PREEMPTION_ONSET_PER_MINUTE.default
    http_timeout_seconds: float = 2.0
    max_body_bytes: int = 8 * 1024 * 1024
    state_dir: str = DEFAULT_STATE_DIR
    powercap_root: str = "/sys/class/powercap"
    nvml_enabled: bool = True
    idle_settle_seconds: float = rules.IDLE_SETTLE.default
    idle_min_seconds: float = rules.IDLE_MIN_DURATION.default
    min_load_seconds: float = rules.MIN_LOAD_DURATION.default
    idle_power_watts: dict[str, float] = field(default_factory=dict)  # device id -> W (override)
    p99_tool_latency_seconds: float = rules.P99_TOOL_LATENCY.default
    buffer_headroom: float = rules.BUFFER_HEADROOM.default
    collapse_throughput_drop_ratio: float = rules.COLLAPSE_THROUGHPUT_DROP_RATIO.default
    collapse_power_near_idle_ratio: float = rules.COLLAPSE_POWER_NEAR_IDLE_RATIO.default
    collapse_reference_seconds: float = rules.COLLAPSE_REFERENCE_WINDOW.default
    load_to_compute_cost_ratio: float = rules.LOAD_TO_COMPUTE_COST_RATIO.default
    # money and carbon (docs/energy.md): None = not configured, the figures are absent (no invented default)
    electricity_price: PriceSetting | None = None  # per kWh, in electricity_currency
    electricity_currency: str | None = None  # ISO 4217 code, required with a price (a label of the money series)
    carbon_intensity: PriceSetting | None = None  # g CO2e per kWh
    price_refresh_seconds: float = rules.PRICE_REFRESH.default
    price_max_age_seconds: float = rules.PRICE_MAX_AGE.default
    phase_min_windows: int = rules.PHASE_MIN_WINDOWS.default
    phase_max_condition: float = rules.PHASE_MAX_CONDITION.default
    phase_history_seconds: float = rules.PHASE_HISTORY.default
    # families exported only when named here (exporter/optin.py; "all": every one): docs/fleet.md "Series budget"
    metrics_opt_in: frozenset[str] = frozenset()
    web_config_path: str | None = None  # TLS / basic auth of the endpoints (exporter/serve/webconfig.py)
    log_level: str = "info"  # debug | info | warn | error (exporter/logsetup.py)
    log_format: str = "logfmt"  # logfmt | json
    # not a configuration key: a sentence every screen shows above the figures (`kvwatt demo` says it is one)
    notice: str = ""

    @property
    def host(self) -> str:
        return self.listen.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.listen.rsplit(":", 1)[1])

    def server(self, name: str) -> ServerConfig:
        for s in self.servers:
            if s.name == name:
                return s
        raise KeyError(name)


# key -> (field name, parser). Parsers take (value, key) and raise ConfigError.
def _float_range(lo: float, hi: float | None = None, lo_open: bool = False):
    def parse(value: Any, key: str) -> float:
        v = finite_number(value, key)
        if (v <= lo if lo_open else v < lo) or (hi is not None and v > hi):
            bound = f"> {lo}" if lo_open else f">= {lo}"
            rng = f"{bound}" + (f" and <= {hi}" if hi is not None else "")
            raise ConfigError(f"{key}: must be {rng}, got {shown(value)}")
        return v
    return parse


def _int_pos(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{key}: expected a positive integer, got {shown(value)}")
    return value


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {shown(value)}")
    return value


THRESHOLD_SOURCES = ("located", "configured")


def _choice(value: Any, key: str, choices: tuple[str, ...], given: Any = None) -> str:
    """``value`` when it is one of ``choices``; the error shows ``given`` (what the user wrote) if set."""
    if value not in choices:
        got = shown(value if given is None else given)
        raise ConfigError(f"{key}: expected one of {', '.join(choices)}, got {got}")
    return value


def _str(value: Any, key: str) -> str:
    if isinstance(value, bool):  # YAML 1.1, which PyYAML reads: a server named on, off, yes or no is a boolean
        raise ConfigError(f"{key}: expected a non-empty string, got {shown(value)} (YAML reads an unquoted on, "
                          f"off, yes, no, true or false as a boolean: quote it, e.g. \"on\")")
    if isinstance(value, (int, float)):
        raise ConfigError(f"{key}: expected a non-empty string, got the number {shown(value)} (quote it, "
                          f"e.g. \"{value}\")")
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: expected a non-empty string, got {shown(value)}")
    if "\0" in value:  # no path, URL or argument can hold one (the OS refuses it)
        raise ConfigError(f"{key}: contains a NUL character, got {shown(value)}")
    return value


_PORT_RE = re.compile(r"^[0-9]{1,5}$")


def valid_port(text: str) -> bool:
    """'1'..'65535' in ASCII digits (str.isdigit() also takes '²', which int() refuses)."""
    return bool(_PORT_RE.match(text)) and 0 < int(text) < 65536


def parse_listen(value: Any, key: str) -> str:
    text = _str(value, key)
    host, sep, port = text.rpartition(":")
    if not sep or not valid_port(port):
        raise ConfigError(f"{key}: expected HOST:PORT with a port in 1-65535, got {shown(value)}")
    return text


def listen_url(listen: str, scheme: str = "http") -> str:
    """The URL of a HOST:PORT listen address, an IPv6 host in brackets (http://[::1]:8492/, never
    http://::1:8492/, which no browser opens)."""
    host, _, port = listen.rpartition(":")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}/"


def url_problem(text: str, expected: str = "expected an http(s) URL of the vLLM server root") -> str | None:
    """Why ``text`` is not an http(s)://HOST[:PORT] URL with a port in 1-65535 (``expected`` when it is not
    such a URL at all), or None."""
    try:
        u = urlparse(text)  # ValueError: an unclosed '[' of an IPv6 address
    except ValueError:
        return expected
    if u.scheme not in ("http", "https") or not u.hostname:
        return expected
    try:
        port = u.port  # None when absent; ValueError when not a number or beyond 65535
    except ValueError:
        port = 0
    return "the port must be 1-65535" if port == 0 else None


def parse_url(value: Any, key: str) -> str:
    text = _str(value, key)
    problem = url_problem(text)
    if problem:  # the password never goes into a message
        raise ConfigError(f"{key}: {problem}, got {shown(redacted_url(text))}")
    return text.rstrip("/")


def is_unconfigured_default(s: "ServerConfig") -> bool:
    """The server kvwatt watches when none is configured anywhere (resolve: file, environment, flags)."""
    return s.name == "default" and s.url == DEFAULT_SERVER_URL


def shown_server(server: "ServerConfig") -> str:
    """``name=url``, with its sidecars' URLs after a ``+``, passwords masked: a server in a message."""
    urls = "+".join(redacted_url(u) for u in (server.url, *server.sidecar_urls))
    return f"{server.name}={urls}"


def redacted_url(url: str) -> str:
    """``url`` with its password replaced by ``xxxxx`` (as Go's url.Redacted): the only form in which a server
    URL is shown -- labels, /api/status, the landing page, logs, messages. The sampler alone uses the real one."""
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unclosed IPv6 bracket: show nothing of it rather than a password
        return "(unparsable URL)"
    if parts.password is None:
        return url
    userinfo, _, hostport = parts.netloc.rpartition("@")
    return parts._replace(netloc=f"{userinfo.partition(':')[0]}:xxxxx@{hostport}").geturl()


LOG_LEVELS = ("debug", "info", "warn", "error")
LOG_FORMATS = ("logfmt", "json")


def _lowered(value: Any) -> Any:
    return value.strip().lower() if isinstance(value, str) else value


def parse_log_level(value: Any, key: str) -> str:
    """debug, info, warn or error (Prometheus' spelling; 'warning' is taken for warn), any case."""
    text = _lowered(value)
    return _choice("warn" if text == "warning" else text, key, LOG_LEVELS, value)


def parse_log_format(value: Any, key: str) -> str:
    return _choice(_lowered(value), key, LOG_FORMATS, value)


RESERVED_PATHS = ("/", "/healthz", "/api/status", "/runbook")  # kvwatt's other endpoints (serve/web.py build_app)
_PATH_RE = re.compile(r"^/[A-Za-z0-9._~!$&'()*+,;=:@/-]*$")


def parse_telemetry_path(value: Any, key: str) -> str:
    """The path /metrics is served on: absolute, URL path characters only, not another endpoint's."""
    text = _str(value, key)
    if not _PATH_RE.match(text) or text in RESERVED_PATHS:
        raise ConfigError(f"{key}: expected a path like /metrics, not one of {', '.join(RESERVED_PATHS)}, "
                          f"got {shown(value)}")
    return text


def _opt_in(value: Any, key: str) -> frozenset[str]:
    """A list of optin.OPT_IN_FAMILIES names, or [all]."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key}: expected a list of family names (or [all]), got {shown(value)}")
    for i, v in enumerate(value):
        if v != optin.ALL and v not in optin.OPT_IN_FAMILIES:
            raise ConfigError(f"{key}[{i}]: {shown(v)} is not an opt-in family; expected all or one of "
                              f"{', '.join(sorted(optin.OPT_IN_FAMILIES))}")
    return frozenset(value)


def _windows(value: Any, key: str) -> tuple[float, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{key}: expected a list of durations like [1m, 5m], got {shown(value)}")
    out = tuple(parse_duration(v, f"{key}[{i}]") for i, v in enumerate(value))
    for i, w in enumerate(out):
        if w < MIN_WINDOW_SECONDS:
            raise ConfigError(f"{key}[{i}]: must be at least {format_window(MIN_WINDOW_SECONDS)} (one sampling "
                              f"tick at the default interval), got {shown(value[i])}")
    if len({format_window(w) for w in out}) != len(out):
        raise ConfigError(f"{key}: windows must be distinct, got {shown(value)}")
    return out


def _watts_map(value: Any, key: str) -> dict[str, float]:
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a mapping of device to watts, got {shown(value)}")
    return {str(k): _float_range(0.0)(v, f"{key}.{k}") for k, v in value.items()}


PROMETHEUS_QUERY_PATH = "/api/v1/query"
_SERIES_RE = re.compile(r'^[A-Za-z_:][A-Za-z0-9_:]*(\{([A-Za-z_][A-Za-z0-9_]*="[^"]*",?)*\})?$')
_NUMBER_RE = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")


# the most a price or an intensity may be, configured or read from a URL: far above any real one (an
# electricity price of 1e6 currency units per kWh covers every currency; the dirtiest grids emit ~1,200 g
# CO2e per kWh), and small enough that money and CO2 per day stay finite (1e308 gave +Inf per day)
PRICE_MAXIMA = {"electricity_price": 1e6, "carbon_intensity": 1e4}


def parse_price(value: Any, key: str, quantity: str = "electricity_price") -> PriceSetting:
    """A price or intensity (``quantity``): a number in [0, PRICE_MAXIMA[quantity]] (also as text, from a flag
    or the environment), or an http(s) URL: ``.../api/v1/query?query=...`` (Prometheus HTTP API, one sample)
    or ``.../metrics#series_name`` (an exposition, the series after '#', optionally with its labels:
    ``name{zone="DE"}``)."""
    expected = ("expected a number >= 0, or an http(s) URL (a Prometheus .../api/v1/query?query=... or a "
                "/metrics URL with #series_name)")
    if isinstance(value, str) and _NUMBER_RE.match(value.strip()):
        value = float(value.strip())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return PriceSetting(value=_float_range(0.0, PRICE_MAXIMA[quantity])(value, key))
    if not isinstance(value, str) or url_problem(value, expected):
        shown_value = redacted_url(value) if isinstance(value, str) else value
        raise ConfigError(f"{key}: {url_problem(value, expected) if isinstance(value, str) else expected}, "
                          f"got {shown(shown_value)}")
    url, _, series = _str(value, key).partition("#")
    if series:
        if not _SERIES_RE.match(series):
            raise ConfigError(f"{key}: expected a series name like name or name{{label=\"value\"}} after '#', "
                              f"got {shown(series)}")
        return PriceSetting(url=url, series=series)
    parts = urlsplit(url)
    if not parts.path.rstrip("/").endswith(PROMETHEUS_QUERY_PATH) or "query=" not in parts.query:
        raise ConfigError(f"{key}: a URL without #series must be a Prometheus {PROMETHEUS_QUERY_PATH}?query=... "
                          f"instant query, got {shown(redacted_url(url))}")
    return PriceSetting(url=url)


_CURRENCY_RE = re.compile(r"^[A-Z]{3}$")


def parse_currency(value: Any, key: str) -> str:
    """An ISO 4217 currency code (EUR, USD ...), any case; written upper case (the money series' label)."""
    text = value.strip().upper() if isinstance(value, str) else value
    if not isinstance(text, str) or not _CURRENCY_RE.match(text):
        raise ConfigError(f"{key}: expected an ISO 4217 currency code like EUR or USD, got {shown(value)}")
    return text


def check_prices(cfg: "Config") -> "Config":
    """A price needs its currency (no default currency is invented); a currency alone is harmless."""
    if cfg.electricity_price is not None and cfg.electricity_currency is None:
        raise ConfigError("electricity_currency: required with electricity_price_per_kwh (an ISO 4217 code like "
                          "EUR; flag --electricity-currency, $KVWATT_ELECTRICITY_CURRENCY)")
    return cfg


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

SERVER_KEYS = {
    "name": "name",
    "url": "url",
    "gpus": "gpus",
    "reference_local_compute_share": "reference_local_compute_share",
    "model_config": "model_config_path",
    "model": "model",
    "hardware": "hardware",
    "pair_off_server": "pair_off_server",
    "recorded_baseline": "recorded_baseline_path",
    "sidecar_urls": "sidecar_urls",
    "offload_tier_bytes": "offload_tier_bytes",
    "kv_cache_metrics_sample": "kv_cache_metrics_sample",
}

MODEL_KEYS = ("layers", "kv_heads", "head_dim", "dtype_bytes", "active_parameters", "hidden_size")
HARDWARE_KEYS = ("flops_per_second", "host_device_bytes_per_second", "gpu_model")


_NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]+$")


def _server(item: Any, key: str) -> ServerConfig:
    if not isinstance(item, dict):
        raise ConfigError(f"{key}: expected a mapping with name and url, got {shown(item)}")
    for k in item:
        if k not in SERVER_KEYS:
            raise unknown_key(f"{key}.{k}", k, SERVER_KEYS)
    for required in ("name", "url"):
        if required not in item:
            raise ConfigError(f"{key}.{required}: missing")
    name = _str(item["name"], f"{key}.name")
    if not _NAME_RE.match(name):
        raise ConfigError(f"{key}.name: use letters, digits, '_', '-', '.', ':' only, got {shown(name)}")
    kw: dict[str, Any] = {"name": name, "url": parse_url(item["url"], f"{key}.url")}
    if "gpus" in item:
        gpus = item["gpus"]
        if not isinstance(gpus, list) or not all(isinstance(g, (int, str)) and not isinstance(g, bool) for g in gpus):
            raise ConfigError(f"{key}.gpus: expected a list of GPU indices or UUIDs, got {shown(gpus)}")
        kw["gpus"] = tuple(str(g) for g in gpus)
    if "reference_local_compute_share" in item:
        kw["reference_local_compute_share"] = _float_range(0.0, 1.0)(
            item["reference_local_compute_share"], f"{key}.reference_local_compute_share")
    for k in ("model_config", "pair_off_server", "recorded_baseline"):
        if k in item:
            kw[SERVER_KEYS[k]] = _str(item[k], f"{key}.{k}")
    if "sidecar_urls" in item:
        kw["sidecar_urls"] = _sidecar_urls(item["sidecar_urls"], f"{key}.sidecar_urls")
    if "offload_tier_bytes" in item:
        kw["offload_tier_bytes"] = _tier_bytes(item["offload_tier_bytes"], f"{key}.offload_tier_bytes")
    if "kv_cache_metrics_sample" in item:  # vLLM asserts 0 < sample <= 1
        kw["kv_cache_metrics_sample"] = _float_range(0.0, 1.0, lo_open=True)(
            item["kv_cache_metrics_sample"], f"{key}.kv_cache_metrics_sample")
    kw["model"] = _numbers(item.get("model", {}), f"{key}.model", MODEL_KEYS)
    kw["hardware"] = _numbers(item.get("hardware", {}), f"{key}.hardware", HARDWARE_KEYS)
    return ServerConfig(**kw)


MAX_SIDECARS = 4


def _sidecar_urls(value: Any, key: str) -> tuple[str, ...]:
    """A short list of http(s) URLs (LMCache's, KVBM's port): each is read with the server's deadline."""
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_SIDECARS:
        raise ConfigError(f"{key}: expected a list of 1 to {MAX_SIDECARS} URLs, got {shown(value)}")
    return tuple(parse_url(u, f"{key}[{i}]") for i, u in enumerate(value))


def _tier_bytes(value: Any, key: str) -> dict[str, float]:
    """{"1:fs": 2e12}: the capacity in bytes of each secondary offload tier (vLLM exports none)."""
    if not isinstance(value, dict) or not all(isinstance(k, str) and k for k in value):
        raise ConfigError(f"{key}: expected a mapping of tier label (like \"1:fs\") to bytes, got {shown(value)}")
    return {k: _float_range(0.0, 1e30, lo_open=True)(v, f"{key}.{k}") for k, v in value.items()}


def _numbers(value: Any, key: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a mapping, got {shown(value)}")
    out: dict[str, Any] = {}
    for k, v in value.items():
        if k not in allowed:
            raise unknown_key(f"{key}.{k}", k, allowed)
        if k == "gpu_model":
            out[k] = _str(v, f"{key}.{k}")
        else:
            out[k] = _float_range(0.0, lo_open=True)(v, f"{key}.{k}")
    return out


def _servers(value: Any, key: str = "servers") -> tuple[ServerConfig, ...]:
    if not isinstance(value, list):
        raise ConfigError(f"{key}: expected a list of servers, got {shown(value)}")
    servers = tuple(_server(item, f"{key}[{i}]") for i, item in enumerate(value))
    first_index: dict[str, int] = {}  # a dict, not list.count: 40,000 servers check in linear time
    for i, s in enumerate(servers):
        if s.name in first_index:
            raise ConfigError(f"{key}: duplicate server name {s.name!r} ({key}[{first_index[s.name]}] and "
                              f"{key}[{i}])")
        first_index[s.name] = i
    for i, s in enumerate(servers):
        if s.pair_off_server and s.pair_off_server not in first_index:
            raise ConfigError(f"{key}[{i}].pair_off_server: no server named {s.pair_off_server!r}")
    return servers


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


def read_text(path: str) -> str:
    """A file's text (UTF-8, at most MAX_FILE_BYTES), or ConfigError with one line naming the file and the
    problem."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)  # bounded: the path may be /dev/zero or a 10 GB mistake
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_FILE_BYTES // 2**20} MiB (the limit)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path}: line {line}: not valid UTF-8 (byte 0x{data[e.start]:02x})") from None


def read_yaml(path: str) -> Any:
    """A YAML file's data, or ConfigError with one line naming the file and the problem."""
    text = read_text(path)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} not valid YAML ({getattr(e, 'problem', e)})") from None
    except RecursionError:
        raise ConfigError(f"{path}: not usable YAML (nested too deeply)") from None
    except ValueError as e:  # the constructor's own: a date like 2024-13-45, an integer of 5,000 digits
        raise ConfigError(f"{path}: not usable YAML ({str(e).split(';')[0]})") from None


def read_json(path: str) -> Any:
    """A JSON file's data, or ConfigError with one line naming the file and the problem."""
    text = read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    except RecursionError:
        raise ConfigError(f"{path}: not usable JSON (nested too deeply)") from None
    except ValueError as e:  # an integer of more than 4,300 digits
        raise ConfigError(f"{path}: not usable JSON ({str(e).split(';')[0]})") from None


def check_writable(path: str, key: str, directory: bool = False) -> None:
    """ConfigError unless ``path`` can be created or replaced later as a file (or, with ``directory``, used as
    a directory): checked before any work, so a typo does not lose a long run's result at its end. Missing
    parents are fine (they are created); the nearest existing one must be a directory we may write in."""
    target = os.path.abspath(_str(path, key))
    if os.path.exists(target):
        if os.path.isdir(target) != directory:
            raise ConfigError(f"{key}: {path} is {'not ' if directory else ''}a directory")
        if not os.access(target, os.W_OK):
            raise ConfigError(f"{key}: cannot write {path} (permission denied)")
        return
    if not directory and path.endswith("/"):
        raise ConfigError(f"{key}: expected a file path, got a directory {path!r}")
    parent = os.path.dirname(target)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{key}: cannot write {path} ({parent} is not a directory)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: cannot write {path} (permission denied in {parent})")


def load_file(path: str) -> Config:
    return from_mapping(read_yaml(path))


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


# money and carbon from the environment: (variable, Config attribute, parser)
PRICE_ENVIRONMENT = (
    ("KVWATT_ELECTRICITY_PRICE_PER_KWH", "electricity_price", parse_price),
    ("KVWATT_ELECTRICITY_CURRENCY", "electricity_currency", parse_currency),
    ("KVWATT_CARBON_INTENSITY_G_PER_KWH", "carbon_intensity", lambda v, k: parse_price(v, k, "carbon_intensity")),
)


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
