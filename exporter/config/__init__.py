"""Configuration: YAML file, then environment, then flags (each overrides the one before).

Every key is validated; a bad one raises ConfigError whose message names the key and the problem, and the
CLI turns that into one line on stderr and exit status 2. One idea per module: ``values`` (the value parsers),
``schema`` (Config, ServerConfig, the servers list), ``settings`` (the one table of keys: YAML key, attribute,
parser, default, environment variable, flag, documentation), ``files`` (reading input files), ``layers`` (file <
environment < flags). Every public name stays importable from ``exporter.config``.
"""

from __future__ import annotations

from exporter.config.values import (  # noqa: F401 (the package's face)
    DEFAULT_SERVER_URL, DEFAULT_LISTEN, DEFAULT_STATE_DIR, ConfigError, MIN_WINDOW_SECONDS, shown, is_finite,
    finite_number, parse_duration, parse_interval, duration_arg, unknown_key, format_window, PriceSetting,
    THRESHOLD_SOURCES, valid_port, parse_listen, listen_url, url_problem, parse_url, redacted_url, LOG_LEVELS,
    LOG_FORMATS, parse_log_level, parse_log_format, RESERVED_PATHS, parse_telemetry_path,
    PROMETHEUS_QUERY_PATH, PRICE_MAXIMA, parse_price, parse_currency)
from exporter.config.schema import (  # noqa: F401 (the package's face)
    ServerConfig, Config, is_unconfigured_default, shown_server, check_prices, SERVER_KEYS, MODEL_KEYS,
    HARDWARE_KEYS, MAX_SIDECARS)
from exporter.config.settings import (  # noqa: F401 (the package's face)
    Setting, SETTINGS, KEYS, ENVIRONMENT, FLAGS, PRICE_ENVIRONMENT, add_flags, flag_overrides, from_mapping)
from exporter.config.files import (  # noqa: F401 (the package's face)
    read_text, read_yaml, read_json, check_writable, load_file)
from exporter.config.layers import (  # noqa: F401 (the package's face)
    parse_server_flag, keep_settings, apply_environment, resolve)
