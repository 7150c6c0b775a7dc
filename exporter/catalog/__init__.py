"""Every figure kvwatt exports, declared once: its series (name, type, labels, HELP), the formula that computes
it, where it appears in /api/status and how the landing page words it, side by side. The declarations are
grouped by idea into sections (``declare.Section``: a name, its declarations, its JSON blocks), a file holding a
few (health: Exporter, Sources; energy: Energy, Energy per phase; pressure: KV pressure regime, Preemptions,
Tokens and FLOPs, Recomputation tax, KV-block residency; offload: Offload traffic, Offload buffer sizing,
Collapse, Offload economics, Advice; money: Money and carbon), each with the fill code of its declarations and
the serialisers of its JSON blocks beside them; exporter.catalog.declare holds what a declaration is made of.
``SECTIONS`` below is their one declared order.

Derived from these declarations, never copied by hand: the collector (exporter.serve.collector walks
METRICS), /api/status's per-window and per-server figure keys (exporter.serve.web, in catalog order), the landing
page's table of figures per window (exporter.serve.page), and the README's metric reference, one table per
section (exporter.tooling.readme_tables). The alert/dashboard generators refuse a query naming a ``kvwatt_`` series
missing from it. To find a metric's formula: search its name under exporter/catalog/; ``computes`` is the dotted
path of the formula under exporter. (each kind's, where there are several), or a NotDerived saying why there is
none in exporter/derive/ (tests/test_catalog.py proves each is really called for its series;
tests/test_catalog_formulas.py that each resolves into exporter/derive/). It is a string so that importing the
catalog imports no computation. Formulas cite docs/methods.md sections.

A fill yields ``(label values in the order of labels, value)``; a None value is left out (unknown, never 0).
A figure's JSON has one home, its section: a declaration with a ``status`` key fills its series from the same
getter as its JSON value; structured JSON that is not one figure each (energy by scope, savings by baseline,
the threshold's evidence, ...) is a ``Block`` of the section, naming the declarations it serialises; a figure in
neither says so with ``Elsewhere`` (tests/test_figures_declared.py walks a real /api/status and proves each key
has exactly one owner).

The one exception: /metrics also carries prometheus_client's standard ``process_*`` and ``python_*`` families
(ProcessCollector, PlatformCollector, GCCollector; exporter.serve.collector.runtime_families), which describe the
kvwatt process itself, as every Prometheus client library's do. They are not listed here because their
names, help and labels are the library's, the same in every exporter.
"""

from __future__ import annotations

from exporter.catalog import energy, health, money, offload, pressure
from exporter.catalog.declare import (
    NOT_DERIVED,
    SERVER,
    WINDOW,
    Block,
    Elsewhere,
    Fill,
    MetricDef,
    NotDerived,
    Sample,
    Section,
    StatusKey,
    Words,
    formula,
    per_server,
    per_server_key,
    per_window,
    per_window_key,
    server_block,
    server_key,
    window_block,
    window_key,
)
from exporter.catalog.energy import DEVICES
from exporter.catalog.money import PRICES
from exporter.catalog.pressure import STATES, VERDICTS
from exporter.runtime.build import build_info

__all__ = ["METRICS", "BY_NAME", "get", "build_info", "SECTIONS", "BLOCKS", "Block", "Section", "NOT_DERIVED", "SERVER",
           "WINDOW", "Elsewhere", "Fill", "MetricDef", "NotDerived", "Sample", "StatusKey", "Words", "formula",
           "per_server", "per_server_key", "per_window", "per_window_key", "server_block", "server_key", "window_block",
           "window_key", "DEVICES", "PRICES", "STATES", "VERDICTS"]

# The sections in their declared order: the order of /metrics, of the README's reference, of the page's rows and
# of /api/status's keys (each scope's dict: section by section, its figures' keys, then its blocks'). A new
# figure goes into the section of its idea, at the place in that section where it reads best.
SECTIONS: tuple[Section, ...] = (
    health.EXPORTER_SEC, health.SOURCES_SEC,
    energy.ENERGY_SEC, energy.PHASE_SEC,
    pressure.REGIME_SEC, pressure.PREEMPTION_SEC, pressure.TOKENS_SEC, pressure.TAX_SEC, pressure.RESIDENCY_SEC,
    offload.TRAFFIC_SEC, offload.BUFFER_SEC, offload.COLLAPSE_SEC, offload.ECONOMICS_SEC, offload.ADVICE_SEC,
    money.MONEY_SEC,
)

METRICS: tuple[MetricDef, ...] = tuple(m for section in SECTIONS for m in section.metrics)
BLOCKS: tuple[Block, ...] = tuple(b for section in SECTIONS for b in section.blocks)

BY_NAME: dict[str, MetricDef] = {m.name: m for m in METRICS}
_unknown = sorted({n for b in BLOCKS for n in b.serialises} - set(BY_NAME))
if _unknown:  # a block naming a family the catalog lacks fails at import
    raise ValueError(f"a JSON block serialises {_unknown}: not catalog families")


def get(name: str) -> MetricDef:
    return BY_NAME[name]
