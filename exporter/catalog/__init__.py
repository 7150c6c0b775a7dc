"""Every figure kvwatt exports, declared once: its series (name, type, labels, HELP), the formula that computes
it, where it appears in /api/status and how the landing page words it, side by side -- one file per section
(health, energy, money, pressure, offload), each with the fill code of its declarations beside them;
exporter.catalog.declare holds what a declaration is made of.

Derived from these declarations, never copied by hand: the collector (exporter.serve.collector walks
METRICS), /api/status's per-window and per-server figure keys (exporter.serve.web), the landing page's table
of figures per window (exporter.serve.page), and the README's metric reference (exporter.readme_tables). The
alert/dashboard generators refuse a query naming a ``kvwatt_`` series missing from it. To find a metric's
formula: search its name under exporter/catalog/; ``computes`` is the dotted path of the formula under
exporter. (each kind's, where there are several), or a NotDerived saying why there is none in exporter/derive/
(tests/test_catalog.py proves each is really called for its series; tests/test_catalog_formulas.py that each
resolves into exporter/derive/). It is a string so that importing the catalog imports no computation. Formulas
cite docs/methods.md sections.

A fill yields ``(label values in the order of labels, value)``; a None value is left out (unknown, never 0).
A declaration with a ``status`` key fills its series from the same getter as its JSON value; structured JSON
blocks that are not one figure each (energy by scope, savings by baseline, ...) are serialised in
exporter.serve.web, each naming the declarations it serialises; a figure in neither says so with ``Elsewhere``
(tests/test_figures_declared.py walks a real /api/status and proves each key has exactly one owner).

The one exception: /metrics also carries prometheus_client's standard ``process_*`` and ``python_*`` families
(ProcessCollector, PlatformCollector, GCCollector; exporter.serve.collector.runtime_families), which describe the
kvwatt process itself, as every Prometheus client library's do. They are not listed here because their
names, help and labels are the library's, the same in every exporter.
"""

from __future__ import annotations

from exporter.build import build_info
from exporter.catalog import energy, health, money, offload, pressure
from exporter.catalog.declare import (
    NOT_DERIVED,
    SERVER,
    WINDOW,
    Elsewhere,
    Fill,
    MetricDef,
    NotDerived,
    Sample,
    StatusKey,
    Words,
    formula,
    per_server,
    per_server_key,
    per_window,
    per_window_key,
    server_key,
    window_key,
)
from exporter.catalog.energy import DEVICES
from exporter.catalog.money import PRICES
from exporter.catalog.pressure import STATES, VERDICTS

__all__ = ["METRICS", "BY_NAME", "get", "build_info", "NOT_DERIVED", "SERVER", "WINDOW", "Elsewhere", "Fill",
           "MetricDef", "NotDerived", "Sample", "StatusKey", "Words", "formula", "per_server", "per_server_key",
           "per_window", "per_window_key", "server_key", "window_key", "DEVICES", "PRICES", "STATES", "VERDICTS"]

# The exposition order (of /metrics, of the page's rows and of /api/status keys declared since its fixed order)
# is the order kvwatt has always served; the golden files pin it, so the sections' groups interleave here.
METRICS: tuple[MetricDef, ...] = (
    *health.EXPORTER, *health.SOURCES, *energy.MEASURED, *money.METRICS, *energy.PER_PHASE, *pressure.REGIME,
    *energy.PREEMPTION, *offload.TRAFFIC, *pressure.RESIDENCY, *offload.RESIDENCY_TARGET,
    *offload.TIERED,  # issue 41's second tier (one block in catalog/offload.py)
)

BY_NAME: dict[str, MetricDef] = {m.name: m for m in METRICS}


def get(name: str) -> MetricDef:
    return BY_NAME[name]
