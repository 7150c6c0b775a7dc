"""The one collector: fresh metric families from the latest Snapshot at each collect (client_python's custom
collector pattern), built by walking exporter.catalog, so nothing undocumented can be emitted and a server or
GPU that vanished simply stops appearing. It only serialises: every value was computed at tick time."""

from __future__ import annotations

import hashlib
import math
from typing import Callable, Iterable

from prometheus_client import GCCollector, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from exporter import catalog, optin
from exporter.figures import Snapshot


def _value(v) -> float | None:
    if v is None:
        return None
    v = float(v)
    return None if math.isnan(v) else v


# Label values can come from upstream data (a server's model_name, an NVML UUID, a sysfs zone name): each is
# cut to this length here, where every family passes, so no family can export a 300 KB value.
MAX_LABEL_CHARS = 128
_HASH_CHARS = 8
TRUNCATION_MARKER = "...#"  # then the first hex digits of the whole value's SHA-256


def bounded_label(value: str) -> str:
    """``value`` itself up to MAX_LABEL_CHARS; longer, its head, the marker and a hash of the whole value
    (MAX_LABEL_CHARS in all), so two long values with the same head stay two series."""
    if len(value) <= MAX_LABEL_CHARS:
        return value
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH_CHARS]
    return value[:MAX_LABEL_CHARS - len(TRUNCATION_MARKER) - _HASH_CHARS] + TRUNCATION_MARKER + digest


def family(d: catalog.MetricDef, snap: Snapshot) -> Metric | None:
    """The family of one definition for this snapshot, or None when it has no sample (not exported)."""
    fam = None
    seen: set[tuple[str, ...]] = set()
    rejected = {r.labels for r in snap.implausible if r.figure == d.name}  # exporter/bounds.py
    for raw_labels, value in d.fill(snap):
        value = _value(value)
        if value is None or (rejected and tuple(zip(d.labels, map(str, raw_labels))) in rejected):
            continue
        labels = tuple(bounded_label(str(x)) for x in raw_labels)
        if labels in seen:  # one definition, one sample per label set: a duplicate is a bug upstream
            raise ValueError(f"{d.name}{dict(zip(d.labels, labels))}: duplicate sample")
        seen.add(labels)
        if fam is None:
            cls = CounterMetricFamily if d.type == "counter" else GaugeMetricFamily
            fam = cls(d.name, d.help, labels=d.labels)
        fam.add_metric(list(labels), value)
    return fam


def families(snap: Snapshot, opt_in: frozenset[str] = frozenset({optin.ALL})) -> list[Metric]:
    """Every catalog family with a sample; ``opt_in``: the configuration's metrics_opt_in (the daemon passes
    it; the default, every family, is what the catalog declares)."""
    return [f for d in catalog.METRICS if optin.exported(d.name, opt_in) and (f := family(d, snap)) is not None]


# The standard process_* and python_* families of the kvwatt process (the catalog's one documented exception,
# exporter.catalog), in a registry of their own (not the global REGISTRY), collected with each tick's families
# by Daemon.step.
_RUNTIME = CollectorRegistry(auto_describe=False)
for _standard in (ProcessCollector, PlatformCollector, GCCollector):
    _standard(registry=_RUNTIME)


def runtime_families() -> list[Metric]:
    """process_* (CPU seconds, memory, open fds, start time; Linux /proc) and python_* (version, GC)."""
    return list(_RUNTIME.collect())


def render(snap: Snapshot) -> bytes:
    """The text exposition of one snapshot's catalog families (what /metrics serves until the next tick, less
    the runtime families; see Daemon.step)."""
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
