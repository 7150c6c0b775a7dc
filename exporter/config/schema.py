"""What a configuration is: Config and ServerConfig (the typed settings) and the parsing of the servers list."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from exporter import rules
from exporter.config.values import (
    DEFAULT_LISTEN,
    DEFAULT_SERVER_URL,
    DEFAULT_STATE_DIR,
    ConfigError,
    PriceSetting,
    float_range,
    parse_str,
    parse_url,
    redacted_url,
    shown,
    unknown_key,
)


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
    # scales sampled evictions to blocks (derive/residency.py). vLLM's default (rules.py).
    kv_cache_metrics_sample: float = rules.VLLM_KV_CACHE_METRICS_SAMPLE


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
    # the energy per byte of each hop of a reloaded token (methods.md s14): configured, never measured
    host_memory_joules_per_byte: float = rules.HOST_MEMORY_JOULES_PER_BYTE.default
    host_link_joules_per_byte: float = rules.HOST_LINK_JOULES_PER_BYTE.default
    disk_joules_per_byte: float = rules.DISK_JOULES_PER_BYTE.default
    # money and carbon (docs/energy.md): None = not configured, the figures are absent (no invented default)
    electricity_price: PriceSetting | None = None  # per kWh, in electricity_currency
    electricity_currency: str | None = None  # ISO 4217 code, required with a price (a label of the money series)
    carbon_intensity: PriceSetting | None = None  # g CO2e per kWh
    price_refresh_seconds: float = rules.PRICE_REFRESH.default
    price_max_age_seconds: float = rules.PRICE_MAX_AGE.default
    phase_min_windows: int = rules.PHASE_MIN_WINDOWS.default
    phase_max_condition: float = rules.PHASE_MAX_CONDITION.default
    phase_history_seconds: float = rules.PHASE_HISTORY.default
    # families exported only when named here (exporter/rules/optin.py; "all": every one): docs/fleet.md "Series budget"
    metrics_opt_in: frozenset[str] = frozenset()
    web_config_path: str | None = None  # TLS / basic auth of the endpoints (exporter/serve/webconfig.py)
    log_level: str = "info"  # debug | info | warn | error (exporter/runtime/logsetup.py)
    log_format: str = "logfmt"  # logfmt | json
    # worker processes of `kvwatt run`: "auto" (rules.SERVERS_PER_PROCESS servers each) or a number
    # (exporter/runtime/workers.py)
    processes: int | str = "auto"
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


def is_unconfigured_default(s: "ServerConfig") -> bool:
    """The server kvwatt watches when none is configured anywhere (resolve: file, environment, flags)."""
    return s.name == "default" and s.url == DEFAULT_SERVER_URL


def shown_server(server: "ServerConfig") -> str:
    """``name=url``, with its sidecars' URLs after a ``+``, passwords masked: a server in a message."""
    urls = "+".join(redacted_url(u) for u in (server.url, *server.sidecar_urls))
    return f"{server.name}={urls}"


def check_prices(cfg: "Config") -> "Config":
    """A price needs its currency (no default currency is invented); a currency alone is harmless."""
    if cfg.electricity_price is not None and cfg.electricity_currency is None:
        raise ConfigError("electricity_currency: required with electricity_price_per_kwh (an ISO 4217 code like "
                          "EUR; flag --electricity-currency, $KVWATT_ELECTRICITY_CURRENCY)")
    return cfg


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


# A model's shape: counts, so positive integers (0.5 layers gave a ZeroDivisionError traceback at start-up),
# each at most far beyond any model (the largest have ~130 layers, 128 KV heads, head_dim 576, hidden 20,480),
# so that KV bytes per token and the parameter estimate stay finite. config.json's are held to the same
# (sources/model_config.py).
MODEL_SHAPE_MAXIMA = {"layers": 100_000, "kv_heads": 100_000, "head_dim": 1_000_000, "hidden_size": 10_000_000}


def positive_int(value: Any, key: str, most: int) -> int:
    """A count: an integer (32, or 32.0 as YAML or JSON may write it) in 1..``most``."""
    whole = isinstance(value, (int, float)) and not isinstance(value, bool) and \
        (isinstance(value, int) or value.is_integer())
    if not whole or not 1 <= value <= most:
        raise ConfigError(f"{key}: expected a positive integer (at most {most:,}), got {shown(value)}")
    return int(value)


_NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]+$")


def parse_server(item: Any, key: str) -> ServerConfig:
    if not isinstance(item, dict):
        raise ConfigError(f"{key}: expected a mapping with name and url, got {shown(item)}")
    for k in item:
        if k not in SERVER_KEYS:
            raise unknown_key(f"{key}.{k}", k, SERVER_KEYS)
    for required in ("name", "url"):
        if required not in item:
            raise ConfigError(f"{key}.{required}: missing")
    name = parse_str(item["name"], f"{key}.name")
    if not _NAME_RE.match(name):
        raise ConfigError(f"{key}.name: use letters, digits, '_', '-', '.', ':' only, got {shown(name)}")
    kw: dict[str, Any] = {"name": name, "url": parse_url(item["url"], f"{key}.url")}
    if "gpus" in item:
        gpus = item["gpus"]
        if not isinstance(gpus, list) or not all(isinstance(g, (int, str)) and not isinstance(g, bool) for g in gpus):
            raise ConfigError(f"{key}.gpus: expected a list of GPU indices or UUIDs, got {shown(gpus)}")
        kw["gpus"] = tuple(str(g) for g in gpus)
    if "reference_local_compute_share" in item:
        kw["reference_local_compute_share"] = float_range(0.0, 1.0)(
            item["reference_local_compute_share"], f"{key}.reference_local_compute_share")
    for k in ("model_config", "pair_off_server", "recorded_baseline"):
        if k in item:
            kw[SERVER_KEYS[k]] = parse_str(item[k], f"{key}.{k}")
    if "sidecar_urls" in item:
        kw["sidecar_urls"] = _sidecar_urls(item["sidecar_urls"], f"{key}.sidecar_urls")
    if "offload_tier_bytes" in item:
        kw["offload_tier_bytes"] = _tier_bytes(item["offload_tier_bytes"], f"{key}.offload_tier_bytes")
    if "kv_cache_metrics_sample" in item:  # vLLM asserts 0 < sample <= 1
        kw["kv_cache_metrics_sample"] = float_range(0.0, 1.0, lo_open=True)(
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
    return {k: float_range(0.0, 1e30, lo_open=True)(v, f"{key}.{k}") for k, v in value.items()}


def _numbers(value: Any, key: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a mapping, got {shown(value)}")
    out: dict[str, Any] = {}
    for k, v in value.items():
        if k not in allowed:
            raise unknown_key(f"{key}.{k}", k, allowed)
        if k == "gpu_model":
            out[k] = parse_str(v, f"{key}.{k}")
        elif k in MODEL_SHAPE_MAXIMA:
            out[k] = positive_int(v, f"{key}.{k}", MODEL_SHAPE_MAXIMA[k])
        else:
            out[k] = float_range(0.0, lo_open=True)(v, f"{key}.{k}")
    return out


def parse_servers(value: Any, key: str = "servers") -> tuple[ServerConfig, ...]:
    if not isinstance(value, list):
        raise ConfigError(f"{key}: expected a list of servers, got {shown(value)}")
    servers = tuple(parse_server(item, f"{key}[{i}]") for i, item in enumerate(value))
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
