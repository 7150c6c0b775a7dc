"""Generates the README's configuration and metric reference from the code (config.KEYS, catalog.METRICS).

    python -m exporter.reference --write   # rewrite the README sections between the markers
    python -m exporter.reference --check   # exit 1 when the README is stale (tests/test_reference.py)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from exporter import catalog, config

README = Path(__file__).resolve().parents[1] / "README.md"

# key -> (default as written in YAML, meaning)
CONFIG_DOCS: dict[str, tuple[str, str]] = {
    "servers": ("`[{name: default, url: http://127.0.0.1:8000}]`",
                "servers to watch (vLLM, SGLang, TensorRT-LLM: the engine is detected, docs/engines.md): `name`, "
                "`url` (server root; `http://user:password@host:port` for basic auth, the password shown "
                "nowhere), optional `gpus` (indices or UUIDs), `reference_local_compute_share`, `model_config` "
                "(path to the model's config.json), `model` and `hardware` parameters, `pair_off_server`, "
                "`recorded_baseline` (docs/offload.md), `sidecar_urls` (1 to 4 further /metrics of the same "
                "server, e.g. LMCache's or Dynamo KVBM's own port, merged into its reading: docs/engines.md), "
                "`offload_tier_bytes` (capacity in bytes of each vLLM tiering tier, e.g. `{\"1:fs\": 2e12}`: "
                "vLLM exports none; gives the tier's residency, docs/offload.md), `kv_cache_metrics_sample` (the "
                "share of KV blocks vLLM's residency histograms track: the server's `--kv-cache-metrics-sample`, "
                "default `0.01`, exported nowhere; docs/pressure.md)"),
    "listen": ("`0.0.0.0:8492`", "address of /metrics, /, /healthz, /api/status"),
    "interval": ("`1s`", "sampling interval of every source (dense samples for the p95)"),
    "windows": ("`[1m, 5m]`", "rolling windows of the derived figures (label `window`)"),
    "kv_pressure_threshold": ("`0.90`", "configured p95 KV usage above which offloading pays (methods.md s3); "
                              "the regime flag uses it until a threshold is located"),
    "kv_pressure_threshold_source": ("`located`", "`located`: the regime flag uses the threshold located from "
                                     "the server's own history once there is evidence (methods.md s10), the "
                                     "configured one until then; `configured`: always `kv_pressure_threshold`"),
    "threshold_window": ("`1m`", "one evidence point per completed window of this fixed grid "
                         "(KV p95, preemptions, tax; methods.md s10); the reference share learns from the same"),
    "threshold_history": ("`6h`", "how long evidence windows are kept for locating the threshold"),
    "threshold_min_windows": ("`6`", "evidence windows (clean and pressured, at least 2 of each) a located "
                              "threshold needs"),
    "preemption_onset_per_minute": ("`0.5`", "sustained preemption rate that marks onset (methods.md s3)"),
    "http_timeout": ("`2s`", "timeout of one /metrics read; a slow server is down with reason `timeout`"),
    "max_body_bytes": ("`8388608`", "largest /metrics body read (reason `body_too_large` above)"),
    "state_dir": ("`/var/lib/kvwatt`", "where baselines are persisted (atomically); if the default is not "
                  "writable, `$XDG_STATE_HOME/kvwatt` or `~/.local/state/kvwatt`; one daemon per directory "
                  "(docs/energy.md, \"State directory\")"),
    "powercap_root": ("`/sys/class/powercap`", "RAPL powercap tree (flag `--powercap-root`)"),
    "nvml": ("`true`", "read GPU energy through NVML"),
    "idle_settle": ("`30s`", "settle delay after load before an idle stretch counts"),
    "idle_min_duration": ("`30s`", "idle stretch needed to learn P_idle"),
    "min_load_duration": ("`30s`", "load needed in a window before a J/token figure is given"),
    "idle_power_watts": ("`{}`", "configured P_idle per device id (`gpu:<uuid>`, `rapl:<zone>:<domain>`)"),
    "p99_tool_latency": ("`20s`", "the workload's p99 tool-call latency, for buffer sizing (methods.md s6)"),
    "buffer_headroom": ("`1.5`", "factor on the recommended buffer size"),
    "collapse_throughput_drop_ratio": ("`0.2`", "throughput below this share of its recent level = collapsed"),
    "collapse_power_near_idle_ratio": ("`1.5`", "GPU power below this multiple of P_idle = near idle"),
    "collapse_reference_window": ("`10m`", "how far back the recent throughput level is taken"),
    "load_to_compute_cost_ratio": ("`0.1`", "energy of reloading a token vs recomputing it (attribution model)"),
    "web_config_file": ("none", "TLS and basic auth of every endpoint, exporter-toolkit format (flag "
                                "`--web.config.file`; docs/deployment.md)"),
    "log_level": ("`info`", "`debug`, `info`, `warn` or `error` (flag `--log.level`, `$KVWATT_LOG_LEVEL`)"),
    "log_format": ("`logfmt`", "`logfmt` or `json`, one line per record with `ts`, `level`, `logger`, `caller`, "
                               "`msg` (flag `--log.format`, `$KVWATT_LOG_FORMAT`)"),
}


def config_table() -> str:
    rows = ["| key | default | meaning |", "|---|---|---|"]
    rows += [f"| `{k}` | {CONFIG_DOCS[k][0]} | {CONFIG_DOCS[k][1]} |" for k in config.KEYS]
    return "\n".join(rows)


def metric_table() -> str:
    out = []
    for section in dict.fromkeys(m.section for m in catalog.METRICS):
        out += [f"**{section}**", "", "| series | type | labels | meaning | computed in |", "|---|---|---|---|---|"]
        for m in catalog.METRICS:
            if m.section == section:
                labels = ", ".join(f"`{label}`" for label in m.labels)
                out.append(f"| `{m.name}` | {m.type} | {labels} | {m.help.replace('|', '/')} | `{m.where}` |")
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
