"""The one collector: renders the daemon's current state as fresh metric families at each scrape.

Families are built from exporter.catalog (name, type, labels, HELP), so nothing undocumented can be
emitted, and a server or GPU that vanished simply stops appearing. Unknown values are omitted, never 0.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from exporter import catalog
from exporter.view import ServerView, WindowView


class Families:
    """Lazily created families for one scrape; ``add`` appends a sample, skipping unknown values."""

    def __init__(self) -> None:
        self._fams: dict[str, Metric] = {}

    def add(self, name: str, labels: dict[str, str], value: float | bool | None) -> None:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return
        d = catalog.get(name)
        fam = self._fams.get(name)
        if fam is None:
            if d.type == "counter":
                fam = CounterMetricFamily(name, d.help, labels=d.labels)
            else:
                fam = GaugeMetricFamily(name, d.help, labels=d.labels)
            self._fams[name] = fam
        fam.add_metric([str(labels.get(k, "")) for k in d.labels], float(value))

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._fams.values())


def _b(v: bool | None) -> float | None:
    return None if v is None else (1.0 if v else 0.0)


def render_status(f: Families, status) -> None:
    """kvwatt_source_up / _info / sample duration for one source status."""
    key = {"source": status.source, "server": status.server}
    f.add("kvwatt_source_up", key, _b(status.up))
    f.add("kvwatt_sample_duration_seconds", key, status.duration_seconds)
    f.add("kvwatt_source_info", {**key, "state": status.state, "reason": status.reason or "none"}, 1)


def render_window(f: Families, server: str, w: WindowView) -> None:
    lab = {"server": server, "window": w.window}
    f.add("kvwatt_window_covered_seconds", lab, w.covered_seconds)
    f.add("kvwatt_kv_cache_usage_p95_ratio", lab, w.kv_usage_p95)
    f.add("kvwatt_kv_cache_usage_max_ratio", lab, w.kv_usage_max)
    f.add("kvwatt_kv_pressure_above_threshold", lab, _b(w.above_threshold))
    f.add("kvwatt_preemptions_per_minute", lab, w.preemptions_per_minute)
    f.add("kvwatt_preemption_onset", lab, _b(w.preemption_onset))
    f.add("kvwatt_generation_tokens_per_second", lab, w.generation_tokens_per_second)
    for source, share in (w.token_shares or {}).items():
        f.add("kvwatt_prompt_token_share_ratio", {**lab, "source": source}, share)
    f.add("kvwatt_recompute_tax_ratio", lab, w.recompute_tax)
    f.add("kvwatt_estimated_flops_per_second", lab, w.flops_per_second)
    f.add("kvwatt_estimated_flops_per_generated_token", lab, w.flops_per_generated_token)
    for name, labels, value in w.extra.get("series", ()):
        f.add(name, {**lab, **labels}, value)


def render_server(f: Families, v: ServerView) -> None:
    render_status(f, v.status)
    info = v.info
    f.add("kvwatt_server_info", {"server": v.name, "url": v.url,
                                 "model_name": info.model_name if info else "",
                                 "offload_backend": (info.offload_backend if info else "") or "unknown"}, 1)
    f.add("kvwatt_kv_pressure_threshold_ratio", {"server": v.name}, v.threshold)
    f.add("kvwatt_recompute_reference_share_ratio", {"server": v.name}, v.reference_share)
    if info is not None:
        f.add("kvwatt_offload_enabled", {"server": v.name}, _b(info.offload_enabled))
        f.add("kvwatt_offload_buffer_bytes", {"server": v.name}, info.offload_buffer_bytes)
    for w in v.windows:
        render_window(f, v.name, w)
    for name, labels, value in v.extra.get("series", ()):
        f.add(name, {"server": v.name, **labels}, value)


class KvwattCollector(Collector):
    """``snapshot`` returns (server views, host-wide renderers) for this scrape."""

    def __init__(self, snapshot: Callable[[], tuple[list[ServerView], list[Callable[[Families], None]]]]):
        self.snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        f = Families()
        views, host_renderers = self.snapshot()
        for v in views:
            render_server(f, v)
        for render in host_renderers:
            render(f)
        return list(f)
