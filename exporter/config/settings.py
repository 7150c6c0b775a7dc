"""The one table of settings: each setting's YAML key, Config attribute, parser, documentation, default where
Config() cannot say it, environment variable and flag (``SETTINGS``); ``KEYS``, the environment
(layers.apply_environment), the flags of `kvwatt run` (add_flags, flag_overrides) and the README's configuration
table (exporter/tooling/readme_tables.py) are derived from it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Any, Callable

from exporter import rules
from exporter.config.schema import Config, parse_servers
from exporter.config.values import (
    THRESHOLD_SOURCES,
    ConfigError,
    duration_at_most,
    float_range,
    parse_bool,
    parse_choice,
    parse_currency,
    parse_duration,
    parse_interval,
    parse_listen,
    parse_log_format,
    parse_log_level,
    parse_opt_in,
    parse_positive_int,
    parse_price,
    parse_processes,
    parse_str,
    parse_telemetry_path,
    parse_watts_map,
    parse_windows,
    unknown_key,
)


@dataclass(frozen=True)
class Setting:
    """One setting, declared once: everything else (``KEYS``, the environment, the flags of `kvwatt run`, the
    README's configuration table) is derived from the table below; tests/test_settings_table.py fails on a
    flag, variable or key declared anywhere else."""

    key: str | None  # the YAML key; None: not a configuration key (a flag or variable of `kvwatt run` only)
    attribute: str | None  # the Config attribute it sets; None: read by the command itself
    parse: Callable[[Any, str], Any] | None  # (value, key) -> value, ConfigError on a bad one
    meaning: str = ""  # the README's words (a shared rule's come from exporter/rules/__init__.py)
    default: str | None = None  # the default as YAML writes it, where Config()'s value cannot say it
    env: str | None = None  # the environment variable (file < environment < flag)
    flags: tuple[str, ...] = ()  # the flag of `kvwatt run`, then its aliases; the first names it in errors
    dest: str | None = None  # its argparse destination
    metavar: str | None = None
    help: str | None = None  # the flag's --help words
    # how `kvwatt run` applies the flag: "resolve" (a named argument of layers.resolve), "parsed" (parsed with
    # ``parse`` and set over file and environment), "raw" (set as given), "command" (commands/run.py reads it)
    flag_layer: str = "parsed"
    flag_options: tuple[tuple[str, Any], ...] = ()  # more argparse options: action, type, default


def rule(r: rules.Rule, parse: Any, **more: Any) -> Setting:
    """A shared rule's row: its YAML key, Config attribute and meaning come from exporter/rules/__init__.py."""
    return Setting(r.key, r.attribute, parse, r.meaning, **more)


def _carbon(value: Any, key: str):
    return parse_price(value, key, "carbon_intensity")


SERVERS_MEANING = (
    "servers to watch (vLLM, SGLang, TensorRT-LLM: the engine is detected, docs/engines.md): `name`, "
    "`url` (server root, read at /metrics, or the exposition's own path such as trtllm-serve's "
    "`http://host:8000/prometheus/metrics`; `http://user:password@host:port` for basic auth, the "
    "password shown nowhere), optional `gpus` (indices or UUIDs), `reference_local_compute_share`, "
    "`model_config` "
    "(path to the model's config.json), `model` and `hardware` parameters, `pair_off_server`, "
    "`recorded_baseline` (docs/offload.md), `sidecar_urls` (1 to 4 further /metrics of the same "
    "server, e.g. LMCache's or Dynamo KVBM's own port, merged into its reading: docs/engines.md), "
    "`offload_tier_bytes` (capacity in bytes of each vLLM tiering tier, e.g. `{\"1:fs\": 2e12}`: "
    "vLLM exports none; gives the tier's residency, docs/offload.md), `kv_cache_metrics_sample` (the "
    "share of KV blocks vLLM's residency histograms track: the server's `--kv-cache-metrics-sample`, "
    f"default `{rules.VLLM_KV_CACHE_METRICS_SAMPLE:g}`, exported nowhere; docs/pressure.md)")

CONFIG_ENV = "KVWATT_CONFIG"  # names the configuration file (layers.resolve reads it before the file)

# The table, in the README's order (configuration keys), then what only `kvwatt run` takes.
SETTINGS: tuple[Setting, ...] = (
    Setting("listen", "listen", parse_listen, "address of /metrics, /, /healthz, /api/status, /runbook",
            env="KVWATT_LISTEN", flags=("--web.listen-address", "--listen"), dest="listen", metavar="HOST:PORT",
            help="address to serve /metrics on (default 0.0.0.0:8492; also the key listen, $KVWATT_LISTEN)",
            flag_layer="resolve"),
    rule(rules.INTERVAL, parse_interval, env="KVWATT_INTERVAL", flags=("--interval",), dest="interval",
         metavar="DURATION", help="sampling interval: 500ms, 2s, or bare seconds (default 1s; 50ms to 60s)",
         flag_layer="resolve"),
    rule(rules.WINDOWS, parse_windows),
    rule(rules.KV_PRESSURE_THRESHOLD, float_range(0.0, 1.0, lo_open=True)),
    Setting("kv_pressure_threshold_source", "kv_pressure_threshold_source",
            lambda v, k: parse_choice(v, k, THRESHOLD_SOURCES),
            "`located`: the regime flag uses the threshold located from the server's own history once there is "
            "evidence (methods.md s10), the configured one until then; `configured`: always "
            "`kv_pressure_threshold`"),
    rule(rules.THRESHOLD_WINDOW, parse_duration),
    rule(rules.THRESHOLD_HISTORY, parse_duration),
    rule(rules.THRESHOLD_MIN_WINDOWS, parse_positive_int),
    rule(rules.PREEMPTION_ONSET_PER_MINUTE, float_range(0.0, lo_open=True)),
    Setting("http_timeout", "http_timeout_seconds", parse_duration,
            "timeout of one /metrics read; a slow server is down with reason `timeout`"),
    Setting("max_body_bytes", "max_body_bytes", parse_positive_int,
            "largest /metrics body read (reason `body_too_large` above)"),
    Setting("state_dir", "state_dir", parse_str,
            "where baselines are persisted (atomically); if the default is not writable, `$XDG_STATE_HOME/kvwatt` "
            "or `~/.local/state/kvwatt`; one daemon per directory (docs/energy.md, \"State directory\")",
            env="KVWATT_STATE_DIR", flags=("--state-dir",), dest="state_dir", metavar="DIR",
            help="where baselines are persisted (default /var/lib/kvwatt, or ~/.local/state/kvwatt when that is "
                 "not writable)", flag_layer="raw"),
    Setting("powercap_root", "powercap_root", parse_str, "RAPL powercap tree (flag `--powercap-root`)",
            env="KVWATT_POWERCAP_ROOT", flags=("--powercap-root",), dest="powercap_root", metavar="DIR",
            help="powercap tree for RAPL (default /sys/class/powercap)", flag_layer="raw"),
    Setting("nvml", "nvml_enabled", parse_bool, "read GPU energy through NVML"),
    rule(rules.IDLE_SETTLE, parse_duration),
    rule(rules.IDLE_MIN_DURATION, parse_duration),
    rule(rules.MIN_LOAD_DURATION, parse_duration),
    Setting("idle_power_watts", "idle_power_watts", parse_watts_map,
            "configured P_idle per device id (`gpu:<uuid>`, `rapl:<zone>:<domain>`)"),
    rule(rules.P99_TOOL_LATENCY, duration_at_most(rules.P99_TOOL_LATENCY.most, "24h (a day)")),
    rule(rules.BUFFER_HEADROOM, float_range(1.0, rules.BUFFER_HEADROOM.most)),
    rule(rules.COLLAPSE_THROUGHPUT_DROP_RATIO, float_range(0.0, 1.0, lo_open=True)),
    rule(rules.COLLAPSE_POWER_NEAR_IDLE_RATIO, float_range(1.0)),
    rule(rules.COLLAPSE_REFERENCE_WINDOW, parse_duration),
    rule(rules.LOAD_TO_COMPUTE_COST_RATIO, float_range(0.0)),
    rule(rules.HOST_MEMORY_JOULES_PER_BYTE, float_range(0.0, 1e-3)),
    rule(rules.HOST_LINK_JOULES_PER_BYTE, float_range(0.0, 1e-3)),
    rule(rules.DISK_JOULES_PER_BYTE, float_range(0.0, 1e-3)),
    Setting("electricity_price_per_kwh", "electricity_price", parse_price,
            "electricity price per kWh for the money figures: a number, or a URL read every `price_refresh` -- a "
            "Prometheus `.../api/v1/query?query=...` (one sample) or a `/metrics` URL with `#series_name` "
            "(optionally `#name{label=\"value\"}`); needs `electricity_currency`; none: no money figures (flag "
            "`--electricity-price-per-kwh`, `$KVWATT_ELECTRICITY_PRICE_PER_KWH`; docs/energy.md)",
            env="KVWATT_ELECTRICITY_PRICE_PER_KWH", flags=("--electricity-price-per-kwh",),
            dest="electricity_price", metavar="PRICE|URL",
            help="electricity price per kWh: a number, or a Prometheus .../api/v1/query?query=... URL, or a "
                 "/metrics URL with #series (also electricity_price_per_kwh, $KVWATT_ELECTRICITY_PRICE_PER_KWH; "
                 "needs --electricity-currency)"),
    Setting("electricity_currency", "electricity_currency", parse_currency,
            "ISO 4217 code of that price (`EUR`, `USD`), the `currency` label of the money series; no default "
            "(flag `--electricity-currency`, `$KVWATT_ELECTRICITY_CURRENCY`)",
            env="KVWATT_ELECTRICITY_CURRENCY", flags=("--electricity-currency",), dest="electricity_currency",
            metavar="CODE", help="ISO 4217 code of that price, e.g. EUR (also electricity_currency, "
                                 "$KVWATT_ELECTRICITY_CURRENCY)"),
    Setting("carbon_intensity_g_per_kwh", "carbon_intensity", _carbon,
            "grid carbon intensity in g CO2e per kWh for the CO2 figures: a number or a URL as for the price; "
            "none: no CO2 figures (flag `--carbon-intensity-g-per-kwh`, `$KVWATT_CARBON_INTENSITY_G_PER_KWH`)",
            env="KVWATT_CARBON_INTENSITY_G_PER_KWH", flags=("--carbon-intensity-g-per-kwh",),
            dest="carbon_intensity", metavar="GRAMS|URL",
            help="grid carbon intensity in g CO2e per kWh: a number or a URL as for the price (also "
                 "carbon_intensity_g_per_kwh, $KVWATT_CARBON_INTENSITY_G_PER_KWH)"),
    rule(rules.PRICE_REFRESH, parse_duration),
    rule(rules.PRICE_MAX_AGE, parse_duration),
    rule(rules.PHASE_MIN_WINDOWS, parse_positive_int),
    rule(rules.PHASE_MAX_CONDITION, float_range(1.0)),
    rule(rules.PHASE_HISTORY, duration_at_most(rules.PHASE_HISTORY.most, "168h (a week)")),
    Setting("metrics_opt_in", "metrics_opt_in", parse_opt_in,
            "families /metrics exports only when named here, or `[all]`: those marked *opt-in* below, which no "
            "alert, dashboard or page reads (their figures stay in /api/status); docs/fleet.md \"Series budget\"",
            default="`[]`"),
    Setting("web_config_file", "web_config_path", parse_str,
            "TLS and basic auth of every endpoint, exporter-toolkit format (flag `--web.config.file`; "
            "docs/deployment.md)",
            flags=("--web.config.file",), dest="web_config_file", metavar="FILE",
            help="TLS and basic auth of every endpoint, Prometheus exporter-toolkit format (also the config key "
                 "web_config_file; docs/deployment.md)", flag_layer="command"),
    Setting("log_level", "log_level", parse_log_level,
            "`debug`, `info`, `warn` or `error` (flag `--log.level`, `$KVWATT_LOG_LEVEL`)",
            env="KVWATT_LOG_LEVEL", flags=("--log.level", "--log-level"), dest="log_level", metavar="LEVEL",
            help="debug, info, warn or error (default info; also the key log_level, $KVWATT_LOG_LEVEL)"),
    Setting("log_format", "log_format", parse_log_format,
            "`logfmt` or `json`, one line per record with `ts`, `level`, `logger`, `caller`, `msg` (flag "
            "`--log.format`, `$KVWATT_LOG_FORMAT`)",
            env="KVWATT_LOG_FORMAT", flags=("--log.format",), dest="log_format", metavar="FORMAT",
            help="logfmt or json, one line per record (default logfmt; also log_format, $KVWATT_LOG_FORMAT)"),
    Setting("processes", "processes", parse_processes,
            "processes of `kvwatt run`, each deriving a group of servers on a core of its own (the first group in "
            "`kvwatt run` itself, each other in a worker process), merged at "
            f"the scrape: `auto` (one up to {rules.SERVERS_PER_PROCESS.default:g} servers, else one per "
            f"{rules.SERVERS_PER_PROCESS.default:g}) or a number (docs/fleet.md \"One kvwatt per node\")",
            default="`auto`", env="KVWATT_PROCESSES", flags=("--processes",), dest="processes", metavar="N|auto",
            help="processes, each deriving a group of servers (default auto: one per "
                 f"{rules.SERVERS_PER_PROCESS.default:g} servers; also processes, $KVWATT_PROCESSES)"),
    Setting("servers", "servers", None, SERVERS_MEANING,  # parsed by schema.parse_servers (a list of mappings)
            default="`[{name: default, url: http://127.0.0.1:8000}]`",
            env="KVWATT_SERVERS", flags=("--server",), dest="server", metavar="NAME=URL",
            help="a vLLM server root URL to watch (repeatable; replaces the file's server list)",
            flag_layer="resolve", flag_options=(("action", "append"),)),
    # `kvwatt run` only: not configuration keys
    Setting(None, None, None, "the configuration file", env=CONFIG_ENV, flags=("--config",), dest="config",
            metavar="FILE", help="YAML configuration file (also $KVWATT_CONFIG)", flag_layer="resolve"),
    Setting(None, None, parse_telemetry_path, "path of the exposition", flags=("--web.telemetry-path",),
            dest="telemetry_path", metavar="PATH", help="path of the exposition (default /metrics)",
            flag_layer="command", flag_options=(("default", "/metrics"),)),
    Setting(None, None, None, "connections open at once", flags=("--web.max-connections",),
            dest="web_max_connections", metavar="N",
            help="connections open at once; a new one beyond closes the least recently active (default 512, "
                 "lowered to fit the open-file limit)",
            flag_layer="command", flag_options=(("type", int), ("default", 512))),
    Setting(None, None, parse_duration, "idle connection timeout", flags=("--web.read-timeout",),
            dest="web_read_timeout", metavar="DURATION",
            help="an idle connection, one trickling its request headers or its TLS handshake is closed after this "
                 "(default 30s)",
            flag_layer="command", flag_options=(("default", "30s"),)),
)

# Derived: the YAML keys (key -> (Config attribute, parser)), the environment, the flags.
KEYS: dict[str, tuple[str, Any]] = {s.key: (s.attribute, s.parse) for s in SETTINGS if s.key is not None}
ENVIRONMENT: tuple[Setting, ...] = tuple(s for s in SETTINGS if s.env is not None)
FLAGS: tuple[Setting, ...] = tuple(s for s in SETTINGS if s.flags)
# money and carbon from the environment: (variable, Config attribute, parser)
PRICE_ENVIRONMENT = tuple((s.env, s.attribute, s.parse) for s in ENVIRONMENT
                          if s.attribute in ("electricity_price", "electricity_currency", "carbon_intensity"))


def add_flags(p: argparse.ArgumentParser) -> None:
    """The flags of `kvwatt run`, one per row of the table that has one."""
    for s in sorted(FLAGS, key=lambda s: s.dest not in ("config", "server")):  # what to watch first in --help
        p.add_argument(*s.flags, dest=s.dest, metavar=s.metavar, help=s.help, **dict(s.flag_options))


# The flags every command that reads the daemon's configuration shares with `kvwatt run` (kvwatt baseline idle,
# kvwatt baseline record): declared by their rows above, never retyped by a command.
SHARED_FLAGS = ("config", "state_dir", "powercap_root", "interval")


def add_shared_flags(p: argparse.ArgumentParser, dests: tuple[str, ...] = SHARED_FLAGS) -> None:
    """Add the named rows' flags to another command's parser, with the table's names, metavar and help (their
    values reach the command as given, to pass to layers.resolve: file < environment < flag, as for run)."""
    rows = {s.dest: s for s in FLAGS}
    for dest in dests:
        s = rows[dest]
        p.add_argument(*s.flags, dest=s.dest, metavar=s.metavar, help=s.help)


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The flags set over file and environment by attribute (the "parsed" ones parsed, ConfigError on a bad
    one; "raw" ones as given); those not given are left out."""
    out: dict[str, Any] = {}
    for s in FLAGS:
        value = getattr(args, s.dest, None)
        if value is None or s.flag_layer not in ("parsed", "raw"):
            continue
        out[s.attribute] = s.parse(value, s.flags[0]) if s.flag_layer == "parsed" else value
    return out


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
        kw[field_name] = parse_servers(value) if key == "servers" else parser(value, key)
    return replace(base or Config(), **kw)
