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

from exporter import catalog
from exporter.figures import Snapshot
from exporter.rules import optin
from exporter.serve.exposition import Exposition, sample_lines, text_format


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


Samples = list[tuple[tuple[str, ...], float]]  # one family's (label values, value), as exported

# raw label values -> bounded ones: the same servers, windows and keys come back every tick (~9,000 samples a
# tick at 64 servers). Only all-str tuples are kept: a number never equals a str, so (1,) and (1.0,), which
# str() writes differently, can never hit a kept entry.
_bounded: dict[tuple, tuple[str, ...]] = {}
_BOUNDED_MAX = 65536


def _bounded_labels(raw_labels) -> tuple[str, ...]:
    labels = tuple([bounded_label(str(x)) for x in raw_labels])
    if type(raw_labels) is tuple and all(type(x) is str for x in raw_labels):
        if len(_bounded) > _BOUNDED_MAX:
            _bounded.clear()
        _bounded[raw_labels] = labels
    return labels


def samples(d: catalog.MetricDef, snap: Snapshot) -> Samples:
    """One definition's samples for this snapshot: unknown (None, NaN) and rejected values (exporter/catalog/bounds.py)
    left out, label values bounded (empty: the family is not exported)."""
    out: Samples = []
    seen: set[tuple[str, ...]] = set()
    rejected = {r.labels for r in snap.implausible if r.figure == d.name} if snap.implausible else None
    for raw_labels, value in d.fill(snap):
        value = _value(value)
        if value is None or (rejected and tuple(zip(d.labels, map(str, raw_labels))) in rejected):
            continue
        labels = _bounded.get(raw_labels)
        if labels is None:
            labels = _bounded_labels(raw_labels)
        if labels in seen:  # one definition, one sample per label set: a duplicate is a bug upstream
            raise ValueError(f"{d.name}{dict(zip(d.labels, labels))}: duplicate sample")
        seen.add(labels)
        out.append((labels, value))
    return out


def metric(d: catalog.MetricDef, got: Samples) -> Metric:
    """The prometheus_client family of one definition's samples."""
    cls = CounterMetricFamily if d.type == "counter" else GaugeMetricFamily
    fam = cls(d.name, d.help, labels=d.labels)
    for labels, value in got:
        fam.add_metric(list(labels), value)
    return fam


def family(d: catalog.MetricDef, snap: Snapshot) -> Metric | None:
    """The family of one definition for this snapshot, or None when it has no sample (not exported)."""
    got = samples(d, snap)
    return metric(d, got) if got else None


Collected = list[tuple[catalog.MetricDef, Samples]]


def collect(snap: Snapshot, opt_in: frozenset[str] = frozenset({optin.ALL})) -> Collected:
    """Every catalog family with a sample, as (definition, samples); ``opt_in``: the configuration's
    metrics_opt_in (the daemon passes it; the default, every family, is what the catalog declares)."""
    return [(d, got) for d in catalog.METRICS if optin.exported(d.name, opt_in) and (got := samples(d, snap))]


def families(snap: Snapshot, opt_in: frozenset[str] = frozenset({optin.ALL})) -> list[Metric]:
    """Every catalog family with a sample, as prometheus_client families."""
    return [metric(d, got) for d, got in collect(snap, opt_in)]


def exposition(snap: Snapshot, opt_in: frozenset[str]) -> Exposition:
    """What /metrics serves until the next tick: the catalog's families and the process' own. The text format is
    written at once, straight from the samples (a third of the cost of building the families and then writing
    them: at 64 servers ~9,000 samples a tick); the prometheus_client families, which the other forms
    (OpenMetrics, name[] subsets) serialise, are built on the first scrape that asks for one."""
    return exposition_of(collect(snap, opt_in))


def exposition_of(collected: Collected) -> Exposition:
    """``exposition`` of samples already collected (bench/tick_phases.py times the two stages apart)."""
    runtime = runtime_families()
    text = "".join(line for d, got in collected for line in _lines(d, got)) + text_format(runtime).decode("utf-8")
    return Exposition.lazy(text.encode("utf-8"), lambda: [metric(d, got) for d, got in collected] + runtime)


def _lines(d: catalog.MetricDef, got: Samples) -> list[str]:
    lines = sample_lines(d.name, "counter" if d.type == "counter" else "gauge", d.help, d.labels, got)
    return lines if lines is not None else [text_format([metric(d, got)]).decode("utf-8")]


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
