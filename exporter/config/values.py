"""Value parsers: every number, duration, URL, address, price and name kvwatt reads from a file, the environment
or a flag passes one of these; a bad value raises ConfigError naming the key and the problem."""

from __future__ import annotations

import argparse
import difflib
import ipaddress
import math
import re
import reprlib
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse, urlsplit

from exporter.rules import optin

DEFAULT_SERVER_URL = "http://127.0.0.1:8000"


DEFAULT_LISTEN = "0.0.0.0:8492"


DEFAULT_STATE_DIR = "/var/lib/kvwatt"  # not writable: the per-user directory (exporter.runtime.statedir)


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
        raise ConfigError(f"{key}: expected {expected}, got {shown(value)}{exponent_hint(value)}")
    if not is_finite(value):
        raise ConfigError(f"{key}: expected a finite number, got {shown(value)}")
    return float(value)


def exponent_hint(value: Any) -> str:
    """Why a number written like 8.0e9 arrived as text: YAML 1.1 (PyYAML) takes an exponent as a number only
    with a dot and a sign (8.0e+9); '' for anything else. The text is refused, never guessed at: a quoted "8.0e9"
    and an unquoted one read the same."""
    if not (isinstance(value, str) and "e" in value.lower() and _NUMBER_RE.match(value.strip())):
        return ""
    mantissa, exponent = value.strip().lower().split("e")
    mantissa = mantissa if "." in mantissa else mantissa + ".0"
    exponent = exponent if exponent[0] in "+-" else "+" + exponent
    if f"{mantissa}e{exponent}" == value.strip().lower():
        return " (a quoted number is text: remove the quotes)"
    return f" (YAML reads {value.strip()} as text: write {mantissa}e{exponent}, with a dot and a signed exponent)"


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
            raise ConfigError(f"{key}: expected {expected}, got {shown(value)}{exponent_hint(value)}")
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
        if not math.isfinite(seconds):  # 400 digits overflow a float: refused like .inf
            raise ConfigError(f"{key}: expected a finite number, got {shown(value)}")
    if zero_ok and seconds == 0:
        return 0.0
    if not seconds > 0:
        raise ConfigError(f"{key}: must be {'zero or more' if zero_ok else 'greater than zero'}, got {shown(value)}")
    return seconds


def duration_at_most(most: float, words: str):
    """parse_duration, at most ``most`` seconds (``words``: the bound as the error says it)."""
    def parse(value: Any, key: str) -> float:
        seconds = parse_duration(value, key)
        if seconds > most:
            raise ConfigError(f"{key}: must be at most {words}, got {shown(value)}")
        return seconds
    parse.duration = True  # exporter/tooling/readme_tables.py writes its default as a duration
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


# key -> (field name, parser). Parsers take (value, key) and raise ConfigError.
def float_range(lo: float, hi: float | None = None, lo_open: bool = False):
    def parse(value: Any, key: str) -> float:
        v = finite_number(value, key)
        if (v <= lo if lo_open else v < lo) or (hi is not None and v > hi):
            bound = f"> {lo}" if lo_open else f">= {lo}"
            rng = f"{bound}" + (f" and <= {hi}" if hi is not None else "")
            raise ConfigError(f"{key}: must be {rng}, got {shown(value)}")
        return v
    return parse


def parse_positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{key}: expected a positive integer, got {shown(value)}")
    return value


def parse_processes(value: Any, key: str) -> int | str:
    """``auto`` or a positive integer (a digit string from the environment or a flag)."""
    if value == "auto":
        return value
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{key}: expected auto or a positive integer, got {shown(value)}")
    return value


def parse_bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {shown(value)}")
    return value


THRESHOLD_SOURCES = ("located", "configured")


def parse_choice(value: Any, key: str, choices: tuple[str, ...], given: Any = None) -> str:
    """``value`` when it is one of ``choices``; the error shows ``given`` (what the user wrote) if set."""
    if value not in choices:
        got = shown(value if given is None else given)
        raise ConfigError(f"{key}: expected one of {', '.join(choices)}, got {got}")
    return value


def parse_str(value: Any, key: str) -> str:
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
    text = parse_str(value, key)
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
    if host_problem(u.hostname):
        return host_problem(u.hostname)
    try:
        port = u.port  # None when absent; ValueError when not a number or beyond 65535
    except ValueError:
        port = 0
    return "the port must be 1-65535" if port == 0 else None


def host_problem(host: str) -> str | None:
    """Why ``host`` (a URL's, brackets and port removed) cannot be resolved, or None: an IP address, or a DNS
    name the resolver can encode (IDNA: labels of 1 to 63 characters, 253 in all). `a..b` and a 64-character
    label passed the URL parser and made `kvwatt run` die at its first read (a UnicodeError from getaddrinfo)."""
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    try:
        encoded = host.encode("idna")
    except UnicodeError:
        encoded = b""
    if not encoded or len(encoded.rstrip(b".")) > 253:
        return "the host must be an IP address or a DNS name of labels 1 to 63 characters long"
    return None


def parse_url(value: Any, key: str) -> str:
    text = parse_str(value, key)
    problem = url_problem(text)
    if problem:  # the password never goes into a message
        raise ConfigError(f"{key}: {problem}, got {shown(redacted_url(text))}")
    return text.rstrip("/")


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
    return parse_choice("warn" if text == "warning" else text, key, LOG_LEVELS, value)


def parse_log_format(value: Any, key: str) -> str:
    return parse_choice(_lowered(value), key, LOG_FORMATS, value)


RESERVED_PATHS = ("/", "/healthz", "/api/status", "/runbook")  # kvwatt's other endpoints (serve/web.py build_app)


_PATH_RE = re.compile(r"^/[A-Za-z0-9._~!$&'()*+,;=:@/-]*$")


def parse_telemetry_path(value: Any, key: str) -> str:
    """The path /metrics is served on: absolute, URL path characters only, not another endpoint's."""
    text = parse_str(value, key)
    if not _PATH_RE.match(text) or text in RESERVED_PATHS:
        raise ConfigError(f"{key}: expected a path like /metrics, not one of {', '.join(RESERVED_PATHS)}, "
                          f"got {shown(value)}")
    return text


def parse_opt_in(value: Any, key: str) -> frozenset[str]:
    """A list of optin.OPT_IN_FAMILIES names, or [all]."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key}: expected a list of family names (or [all]), got {shown(value)}")
    for i, v in enumerate(value):
        if v != optin.ALL and v not in optin.OPT_IN_FAMILIES:
            raise ConfigError(f"{key}[{i}]: {shown(v)} is not an opt-in family; expected all or one of "
                              f"{', '.join(sorted(optin.OPT_IN_FAMILIES))}")
    return frozenset(value)


def parse_windows(value: Any, key: str) -> tuple[float, ...]:
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


def parse_watts_map(value: Any, key: str) -> dict[str, float]:
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a mapping of device to watts, got {shown(value)}")
    return {str(k): float_range(0.0)(v, f"{key}.{k}") for k, v in value.items()}


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
        return PriceSetting(value=float_range(0.0, PRICE_MAXIMA[quantity])(value, key))
    if not isinstance(value, str) or url_problem(value, expected):
        shown_value = redacted_url(value) if isinstance(value, str) else value
        raise ConfigError(f"{key}: {url_problem(value, expected) if isinstance(value, str) else expected}, "
                          f"got {shown(shown_value)}")
    url, _, series = parse_str(value, key).partition("#")
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
