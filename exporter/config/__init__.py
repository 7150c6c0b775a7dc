"""Configuration: YAML file, then environment, then flags (each overrides the one before).

Every key is validated; a bad one raises ConfigError whose message names the key and the problem, and the
CLI turns that into one line on stderr and exit status 2. One idea per module: ``values`` (the value parsers),
``schema`` (Config, ServerConfig, the servers list), ``settings`` (the one table of keys: YAML key, attribute,
parser, default, environment variable, flag, documentation), ``files`` (reading input files), ``layers`` (file <
environment < flags). Every public name stays importable from ``exporter.config``.
"""

from __future__ import annotations

from exporter.config.files import check_writable, load_file, read_json, read_text, read_yaml  # noqa: F401 (the package's face)
from exporter.config.layers import apply_environment, keep_settings, parse_server_flag, resolve  # noqa: F401 (the package's face)
from exporter.config.schema import (  # noqa: F401 (the package's face)
    HARDWARE_KEYS,
    MAX_SIDECARS,
    MODEL_KEYS,
    SERVER_KEYS,
    Config,
    ServerConfig,
    check_prices,
    is_unconfigured_default,
    shown_server,
)
from exporter.config.settings import (  # noqa: F401 (the package's face)
    ENVIRONMENT,
    FLAGS,
    KEYS,
    PRICE_ENVIRONMENT,
    SETTINGS,
    Setting,
    add_flags,
    flag_overrides,
    from_mapping,
)
from exporter.config.values import (  # noqa: F401 (the package's face)
    DEFAULT_LISTEN,
    DEFAULT_SERVER_URL,
    DEFAULT_STATE_DIR,
    LOG_FORMATS,
    LOG_LEVELS,
    MIN_WINDOW_SECONDS,
    PRICE_MAXIMA,
    PROMETHEUS_QUERY_PATH,
    RESERVED_PATHS,
    THRESHOLD_SOURCES,
    ConfigError,
    PriceSetting,
    duration_arg,
    finite_number,
    format_window,
    is_finite,
    listen_url,
    parse_currency,
    parse_duration,
    parse_interval,
    parse_listen,
    parse_log_format,
    parse_log_level,
    parse_price,
    parse_telemetry_path,
    parse_url,
    redacted_url,
    shown,
    unknown_key,
    url_problem,
    valid_port,
)
