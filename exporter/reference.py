"""Generates the README's configuration and metric reference from the code (config.KEYS with its defaults from
Config() and the shared rules' meanings from exporter/rules.py, catalog.METRICS).

The metric reference also says where /api/status carries each figure (exporter.serve.web.status_paths).

    python -m exporter.reference --write   # rewrite the README sections between the markers
    python -m exporter.reference --check   # exit 1 when the README is stale (tests/test_reference.py)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from exporter import catalog, config, optin, rules
from exporter.serve import web

README = Path(__file__).resolve().parents[1] / "README.md"

# Keys that are not shared rules: (default as written in YAML where Config's cannot say it, meaning). The
# shared rules' defaults and meanings come from exporter/rules.py, every other default from Config() itself.
CONFIG_DOCS: dict[str, tuple[str | None, str]] = {
    "servers": ("`[{name: default, url: http://127.0.0.1:8000}]`",
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
                "default `0.01`, exported nowhere; docs/pressure.md)"),
    "listen": (None, "address of /metrics, /, /healthz, /api/status, /runbook"),
    "kv_pressure_threshold_source": (None, "`located`: the regime flag uses the threshold located from "
                                     "the server's own history once there is evidence (methods.md s10), the "
                                     "configured one until then; `configured`: always `kv_pressure_threshold`"),
    "http_timeout": (None, "timeout of one /metrics read; a slow server is down with reason `timeout`"),
    "max_body_bytes": (None, "largest /metrics body read (reason `body_too_large` above)"),
    "state_dir": (None, "where baselines are persisted (atomically); if the default is not "
                  "writable, `$XDG_STATE_HOME/kvwatt` or `~/.local/state/kvwatt`; one daemon per directory "
                  "(docs/energy.md, \"State directory\")"),
    "powercap_root": (None, "RAPL powercap tree (flag `--powercap-root`)"),
    "nvml": (None, "read GPU energy through NVML"),
    "idle_power_watts": (None, "configured P_idle per device id (`gpu:<uuid>`, `rapl:<zone>:<domain>`)"),
    "electricity_price_per_kwh": (None, "electricity price per kWh for the money figures: a number, or a URL read "
                                  "every `price_refresh` -- a Prometheus `.../api/v1/query?query=...` (one "
                                  "sample) or a `/metrics` URL with `#series_name` (optionally "
                                  "`#name{label=\"value\"}`); needs `electricity_currency`; none: no money "
                                  "figures (flag `--electricity-price-per-kwh`, "
                                  "`$KVWATT_ELECTRICITY_PRICE_PER_KWH`; docs/energy.md)"),
    "electricity_currency": (None, "ISO 4217 code of that price (`EUR`, `USD`), the `currency` label of the money "
                             "series; no default (flag `--electricity-currency`, `$KVWATT_ELECTRICITY_CURRENCY`)"),
    "carbon_intensity_g_per_kwh": (None, "grid carbon intensity in g CO2e per kWh for the CO2 figures: a number "
                                   "or a URL as for the price; none: no CO2 figures (flag "
                                   "`--carbon-intensity-g-per-kwh`, `$KVWATT_CARBON_INTENSITY_G_PER_KWH`)"),
    "metrics_opt_in": ("`[]`", "families /metrics exports only when named here, or `[all]`: those marked *opt-in* "
                       "below, which no alert, dashboard or page reads (their figures stay in /api/status); "
                       "docs/fleet.md \"Series budget\""),
    "web_config_file": (None, "TLS and basic auth of every endpoint, exporter-toolkit format (flag "
                              "`--web.config.file`; docs/deployment.md)"),
    "log_level": (None, "`debug`, `info`, `warn` or `error` (flag `--log.level`, `$KVWATT_LOG_LEVEL`)"),
    "log_format": (None, "`logfmt` or `json`, one line per record with `ts`, `level`, `logger`, `caller`, "
                         "`msg` (flag `--log.format`, `$KVWATT_LOG_FORMAT`)"),
}

_DURATION_PARSERS = (config.parse_duration, config.parse_interval)


def yaml_default(key: str) -> str:
    """Config()'s default of ``key`` as written in YAML: durations as 30s/1m/6h, booleans lower case."""
    attribute, parse = config.KEYS[key]
    value = getattr(config.Config(), attribute)
    if value is None:
        return "none"
    if parse in _DURATION_PARSERS or getattr(parse, "duration", False):
        text = config.format_window(value)
    elif isinstance(value, tuple):
        text = f"[{', '.join(config.format_window(v) for v in value)}]"
    elif isinstance(value, bool):
        text = str(value).lower()
    elif isinstance(value, dict):
        text = "{}" if not value else str(value)
    else:
        text = f"{value:g}" if isinstance(value, float) else str(value)
    return f"`{text}`"


def config_row(key: str) -> tuple[str, str]:
    """(default, meaning) of one configuration key."""
    if key in rules.RULES:
        return yaml_default(key), rules.RULES[key].meaning
    default, meaning = CONFIG_DOCS[key]
    return default or yaml_default(key), meaning


def config_table() -> str:
    rows = ["| key | default | meaning |", "|---|---|---|"]
    rows += [f"| `{k}` | {' | '.join(config_row(k))} |" for k in config.KEYS]
    return "\n".join(rows)


def metric_table() -> str:
    """One row per catalog declaration; "in /api/status" is where servers[] carries the figure (web.status_paths:
    its own key, or the block that serialises it), "-" where it is in /metrics only."""
    out = []
    for section in dict.fromkeys(m.section for m in catalog.METRICS):
        out += [f"**{section}**", "", "| series | type | labels | meaning | computed in | in /api/status |",
                "|---|---|---|---|---|---|"]
        for m in catalog.METRICS:
            if m.section == section:
                labels = ", ".join(f"`{label}`" for label in m.labels)
                where = ", ".join(f"`{p}`" for p in web.status_paths(m)) or "-"
                opt = " *opt-in* (`metrics_opt_in`)" if m.name in optin.OPT_IN_FAMILIES else ""
                computed = ", ".join(f"`{w}`" for w in m.wheres)  # each kind's formula, or what produces it
                out.append(f"| `{m.name}`{opt} | {m.type} | {labels} | {m.help.replace('|', '/')} | {computed} "
                           f"| {where} |")
        out.append("")
    return "\n".join(out).rstrip()


SECTIONS = {"config": config_table, "metrics": metric_table}


def render(readme: str) -> str:
    for name, fn in SECTIONS.items():
        begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
        head, sep, rest = readme.partition(begin)
        if not sep:
            raise SystemExit(f"README.md: marker {begin} missing")
        _, sep2, tail = rest.partition(end)
        if not sep2:
            raise SystemExit(f"README.md: marker {end} missing")
        readme = f"{head}{begin}\n{fn()}\n{end}{tail}"
    return readme


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    current = README.read_text()
    new = render(current)
    if args.check:
        if new != current:
            print("README.md reference is stale: run python -m exporter.reference --write", file=sys.stderr)
            return 1
        return 0
    if args.write:
        README.write_text(new)
    else:
        print(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
