"""The one collector: fresh metric families from the latest Snapshot at each collect (client_python's custom
collector pattern), built by walking exporter.catalog, so nothing undocumented can be emitted and a server or
GPU that vanished simply stops appearing. It only serialises: every value was computed at tick time."""

from __future__ import annotations

import math
from typing import Callable, Iterable

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from exporter import catalog
from exporter.figures import Snapshot


def _value(v) -> float | None:
    if v is None:
        return None
    v = float(v)
    return None if math.isnan(v) else v


def family(d: catalog.MetricDef, snap: Snapshot) -> Metric | None:
    """The family of one definition for this snapshot, or None when it has no sample (not exported)."""
    fam = None
    seen: set[tuple[str, ...]] = set()
    for labels, value in d.fill(snap):
        value = _value(value)
        if value is None:
            continue
        if labels in seen:  # one definition, one sample per label set: a duplicate is a bug upstream
            raise ValueError(f"{d.name}{dict(zip(d.labels, labels))}: duplicate sample")
        seen.add(labels)
        if fam is None:
            cls = CounterMetricFamily if d.type == "counter" else GaugeMetricFamily
            fam = cls(d.name, d.help, labels=d.labels)
        fam.add_metric([str(x) for x in labels], value)
    return fam


def families(snap: Snapshot) -> list[Metric]:
    return [f for d in catalog.METRICS if (f := family(d, snap)) is not None]


def render(snap: Snapshot) -> bytes:
    """The text exposition of one snapshot (what /metrics serves until the next tick)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvwattCollector(lambda: snap))
    return generate_latest(registry)


class KvwattCollector(Collector):
    """``snapshot`` returns the latest Snapshot (or None before the first tick)."""

    def __init__(self, snapshot: Callable[[], Snapshot | None]):
        self.snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        snap = self.snapshot()
        return [] if snap is None else families(snap)
