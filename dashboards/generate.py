#!/usr/bin/env python3
"""Generate kvwatt's Grafana dashboards from this one Python definition.

    python dashboards/generate.py            # write dashboards/kvwatt-*.json
    python dashboards/generate.py --check    # exit 1 when a committed JSON file is stale

The committed JSON is the provisioned copy (``editable: false``) and is also what the UI import takes: it has
no ``__inputs``; every panel and query uses the ``${datasource}`` variable. Builder choice, label design and
provisioning paths: dashboards/README.md.

Selectors are built by ``kv()`` (kvwatt series) and ``vl()`` (vLLM series), which look the name up in
``exporter.catalog`` / ``exporter.sources.vllm_names`` and add exactly the matchers that series' labels allow, so a
query cannot filter on a label its series does not carry.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from exporter import rules  # noqa: E402
from exporter.catalog import BY_NAME  # noqa: E402
from exporter.sources.vllm_names import WIRE_SERIES  # noqa: E402
from exporter.tooling import rulecopies  # noqa: E402

SCHEMA_VERSION = 42
DS: dict[str, str] = {"type": "prometheus", "uid": "${datasource}"}
PROVISIONED_DS_UID = "kvwatt-prometheus"  # dashboards/provisioning/datasource.yaml
PROVISIONED_DS_NAME = "kvwatt Prometheus"
TAGS = ["kvwatt", "vllm", "kv-offload"]
# kvwatt's and vLLM's series, and the fleet rules' recorded ones (level:kvwatt_...:operation)
SERIES_RE = re.compile(r"(?<![\w:])(?:[a-z_]+:kvwatt_[a-z0-9_]+:[a-z0-9_]+|kvwatt_[a-z0-9_]+|vllm:[a-z0-9_:]+)")
SERVER_VARS = ("server", "server_on", "server_off")

# the dashed reference lines: the daemon's defaults (exporter/rules/__init__.py), never a copy
ONSET_PER_MINUTE = rules.PREEMPTION_ONSET_PER_MINUTE.default
P99_TOOL_LATENCY_SECONDS = rules.P99_TOOL_LATENCY.default
RECOMPUTE_TAX_THRESHOLD = rules.RECOMPUTE_TAX_THRESHOLD.default


# --- selectors ---------------------------------------------------------------------------------------------

def _matchers(pairs: list[tuple[str, str, str]]) -> str:
    return "{" + ", ".join(f'{k}{op}"{v}"' for k, op, v in pairs) + "}"


def kv(name: str, server: str = "server", **eq: str) -> str:
    """Selector of a kvwatt series: job and instance always (the kvwatt exporter picked in the chained
    variables); server and window where the series has those labels.

    ``server`` names the dashboard variable the server label follows (server, server_on, server_off); ``eq``
    adds exact matchers (e.g. scope="gpu").
    """
    labels = BY_NAME[name].labels  # KeyError: not a kvwatt series
    pairs = [("job", "=~", "$job"), ("instance", "=~", "$instance")]
    if "server" in labels:
        pairs.append(("server", "=~", f"${server}"))
    if "window" in labels:
        pairs.append(("window", "=~", "$window"))
    for k, v in eq.items():
        if k not in labels:
            raise ValueError(f"{name} has no label {k!r}")
        pairs.append((k, "=", v))
    return name + _matchers(pairs)


VLLM_LABELS = frozenset({"server", "engine", "model_name", "le", "source", "reason", "transfer_type"})


def vl(name: str, server: str = "server", **eq: str) -> str:
    """Selector of a vLLM series on the wire, filtered by server only.

    vLLM's scrape carries ``server`` as a target label equal to kvwatt's name of that server (docs/fleet.md,
    label discipline 3; deploy/ sets it), so the chained job -> instance -> server selection reaches vLLM's
    series with no matching by hand. job and instance are vLLM's scrape's, not kvwatt's: they are not
    filtered (dashboards/README.md).
    """
    if name not in WIRE_SERIES:
        raise KeyError(f"{name} is not a vLLM series on the wire")
    pairs = [("server", "=~", f"${server}")]
    for k, v in eq.items():
        if k not in VLLM_LABELS:
            raise ValueError(f"{name}: unexpected label {k!r}")
        pairs.append((k, "=", v))
    return name + _matchers(pairs)


def rate(selector: str) -> str:
    return f"rate({selector}[$__rate_interval])"


def quantile(q: float, bucket_selector: str, by: str = "server") -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) ({rate(bucket_selector)}))"


# --- typed panel model -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    expr: str
    legend: str = ""
    table: bool = False  # instant query formatted as a table
    instant: bool = False  # instant query: the value now (the first row's stats)


@dataclass(frozen=True)
class Mapping:
    value: str  # a value, or NULL_NAN: no value or NaN (an unknown, see or_unknown)
    text: str
    color: str


NULL_NAN = "null+nan"  # Grafana's special-value match


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str
    targets: tuple[Target, ...] = ()
    kind: str = "timeseries"  # timeseries | stat | state-timeline | table | text
    w: int = 8
    h: int = 8
    stacked: bool = False
    min: float | None = None
    max: float | None = None
    log: bool = False
    axis_label: str = ""
    threshold_line: float | None = None  # a dashed reference line (display only; see description)
    colors: tuple[str, str] = ("ok", "bad")  # PALETTE names below / from threshold_line (stat: the value's)
    band: tuple[str, str, str] | None = None  # (line, upper, lower) legend names: a line in a filled band
    no_value: str = ""  # what a stat shows when its queries return nothing
    mappings: tuple[Mapping, ...] = ()
    dashed_refids: tuple[str, ...] = ()  # targets drawn as dashed reference lines
    repeat: str | None = None  # one panel per selected value of this variable
    content: str = ""  # text panels


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Variable:
    name: str
    label: str
    query: str = ""  # label_values(...) for query variables
    kind: str = "query"  # query | datasource
    multi: bool = True
    current: str | None = None  # single-value default; multi variables default to All
    description: str = ""


@dataclass(frozen=True)
class Link:
    title: str
    uid: str
    tooltip: str


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    variables: tuple[Variable, ...]
    rows: tuple[Row, ...]
    links: tuple[Link, ...] = field(default=())


# --- JSON rendering ----------------------------------------------------------------------------------------

REFIDS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
PALETTE = {"ok": "green", "warn": "orange", "bad": "red", "off": "transparent", "info": "blue",
           "unknown": "#8e8e8e", "text": "text"}


def series_in(panel: Panel) -> list[str]:
    """kvwatt_/vllm: series a panel's queries read, in order of appearance."""
    seen: dict[str, None] = {}
    for t in panel.targets:
        for name in SERIES_RE.findall(t.expr):
            seen.setdefault(name, None)
    return list(seen)


def described(panel: Panel) -> str:
    names = series_in(panel)
    if any("ALERTS" in t.expr for t in panel.targets):
        names.append("ALERTS")
    if not names:
        return panel.description
    return panel.description + "\n\nSource series: " + ", ".join(f"`{n}`" for n in names) + "."


def _target(t: Target, refid: str) -> dict[str, Any]:
    out: dict[str, Any] = {"datasource": DS, "editorMode": "code", "expr": t.expr, "legendFormat": t.legend,
                           "refId": refid}
    if t.table:
        out.update({"format": "table", "instant": True, "range": False})
    elif t.instant:
        out.update({"instant": True, "range": False})
    else:
        out.update({"instant": False, "range": True})
    return out


def _thresholds(panel: Panel) -> dict[str, Any]:
    below, above = (PALETTE[c] for c in panel.colors)
    steps: list[dict[str, Any]] = [{"color": below, "value": None}]
    if panel.threshold_line is not None:
        steps.append({"color": above, "value": panel.threshold_line})
    return {"mode": "absolute", "steps": steps}


def _mappings(panel: Panel) -> list[dict[str, Any]]:
    values = {m.value: {"text": m.text, "color": PALETTE[m.color], "index": i}
              for i, m in enumerate(panel.mappings) if m.value != NULL_NAN}
    out: list[dict[str, Any]] = [{"type": "value", "options": values}] if values else []
    out += [{"type": "special", "options": {"match": NULL_NAN, "result": {"text": m.text, "color": PALETTE[m.color],
                                                                          "index": i}}}
            for i, m in enumerate(panel.mappings) if m.value == NULL_NAN]
    return out


def _field_defaults(panel: Panel) -> dict[str, Any]:
    d: dict[str, Any] = {"unit": panel.unit, "thresholds": _thresholds(panel), "mappings": _mappings(panel)}
    if panel.min is not None:
        d["min"] = panel.min
    if panel.max is not None:
        d["max"] = panel.max
    if panel.no_value:
        d["noValue"] = panel.no_value
    if panel.kind == "timeseries":
        d["color"] = {"mode": "palette-classic"}
        d["custom"] = {
            "drawStyle": "line", "lineInterpolation": "linear", "lineWidth": 1, "showPoints": "never",
            "fillOpacity": 60 if panel.stacked else 10, "spanNulls": False, "axisLabel": panel.axis_label,
            "axisPlacement": "auto",
            "scaleDistribution": {"type": "log", "log": 10} if panel.log else {"type": "linear"},
            "stacking": {"mode": "normal" if panel.stacked else "none", "group": "A"},
            "thresholdsStyle": {"mode": "dashed" if panel.threshold_line is not None else "off"},
        }
    elif panel.kind == "state-timeline":
        d["color"] = {"mode": "thresholds"}
        d["custom"] = {"fillOpacity": 80, "lineWidth": 0}
    elif panel.kind == "stat":
        d["color"] = {"mode": "thresholds"}
    elif panel.kind == "table":
        d["custom"] = {"align": "auto", "cellOptions": {"type": "auto"}}
    return d


def _overrides(panel: Panel) -> list[dict[str, Any]]:
    if panel.kind == "stat":  # a dashed target of a stat is a secondary figure (an SE): no colour of its own
        return [{"matcher": {"id": "byFrameRefID", "options": ref},
                 "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": "transparent"}}]}
                for ref in panel.dashed_refids]
    out = [{"matcher": {"id": "byFrameRefID", "options": ref},
            "properties": [{"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                           {"id": "custom.stacking", "value": {"mode": "none", "group": "A"}}]}
           for ref in panel.dashed_refids]
    if panel.band:  # Grafana fills from the upper series down to the lower one (fillBelowTo, by display name)
        line, upper, lower = panel.band
        out.append({"matcher": {"id": "byName", "options": line},
                    "properties": [{"id": "custom.fillOpacity", "value": 0}, {"id": "custom.lineWidth", "value": 2}]})
        out.append({"matcher": {"id": "byName", "options": upper},
                    "properties": [{"id": "custom.fillBelowTo", "value": lower},
                                   {"id": "custom.fillOpacity", "value": 25},
                                   {"id": "custom.lineWidth", "value": 0}]})
        out.append({"matcher": {"id": "byName", "options": lower},
                    "properties": [{"id": "custom.fillOpacity", "value": 0},
                                   {"id": "custom.lineWidth", "value": 0}]})
    return out


def _options(panel: Panel) -> dict[str, Any]:
    legend = {"displayMode": "table", "placement": "bottom", "showLegend": True, "calcs": ["lastNotNull", "max"]}
    if panel.kind == "timeseries":
        return {"legend": legend, "tooltip": {"mode": "multi", "sort": "desc"}}
    if panel.kind == "state-timeline":
        return {"showValue": "auto", "mergeValues": True, "alignValue": "left", "rowHeight": 0.9,
                "legend": {"displayMode": "list", "placement": "bottom", "showLegend": False},
                "tooltip": {"mode": "single", "sort": "none"}}
    if panel.kind == "stat":
        return {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "colorMode": "background", "graphMode": "none", "justifyMode": "auto", "orientation": "auto",
                "textMode": "value_and_name", "wideLayout": True, "showPercentChange": False}
    if panel.kind == "table":
        return {"showHeader": True, "cellHeight": "sm", "footer": {"show": False, "reducer": ["sum"]}}
    if panel.kind == "text":
        return {"mode": "markdown", "content": panel.content}
    raise ValueError(panel.kind)


def _panel(panel: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    out: dict[str, Any] = {"id": pid, "type": panel.kind, "title": panel.title, "description": described(panel),
                           "gridPos": {"h": panel.h, "w": panel.w, "x": x, "y": y}}
    if panel.kind != "text":
        out["datasource"] = DS
        out["targets"] = [_target(t, REFIDS[i]) for i, t in enumerate(panel.targets)]
    out["fieldConfig"] = {"defaults": _field_defaults(panel) if panel.kind != "text" else {"unit": panel.unit},
                          "overrides": _overrides(panel)}
    out["options"] = _options(panel)
    if panel.kind == "table":
        out["transformations"] = [{"id": "organize", "options": {"excludeByName": {"Time": True, "Value": True},
                                                                  "renameByName": {}}}]
    if panel.repeat:
        out.update({"repeat": panel.repeat, "repeatDirection": "h", "maxPerRow": 3})
    return out


def _layout(rows: tuple[Row, ...]) -> list[dict[str, Any]]:
    """Rows one under another; panels flow left to right, wrapping at 24 columns."""
    out: list[dict[str, Any]] = []
    pid, y = 1, 0
    for row in rows:
        out.append({"id": pid, "type": "row", "title": row.title, "collapsed": False, "panels": [],
                    "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        pid, y = pid + 1, y + 1
        x, line_h = 0, 0
        for p in row.panels:
            if x + p.w > 24:
                x, y, line_h = 0, y + line_h, 0
            out.append(_panel(p, pid, x, y))
            pid, x, line_h = pid + 1, x + p.w, max(line_h, p.h)
        y += line_h
    return out


def _variable(v: Variable) -> dict[str, Any]:
    if v.kind == "datasource":
        return {"name": v.name, "label": v.label, "type": "datasource", "query": "prometheus", "regex": "",
                "hide": 0, "multi": False, "includeAll": False, "refresh": 1, "options": [],
                "current": {"selected": False, "text": PROVISIONED_DS_NAME, "value": PROVISIONED_DS_UID},
                "description": v.description}
    out: dict[str, Any] = {"name": v.name, "label": v.label, "type": "query", "datasource": DS,
                           "query": v.query, "definition": v.query, "refresh": 2, "regex": "", "sort": 1,
                           "hide": 0, "options": [], "multi": v.multi, "includeAll": v.multi,
                           "description": v.description}
    if v.multi:
        out["allValue"] = ".+"
        out["current"] = {"selected": True, "text": ["All"], "value": ["$__all"]}
    else:
        out["current"] = {"selected": False, "text": v.current or "", "value": v.current or ""}
    return out


def _link(link: Link) -> dict[str, Any]:
    return {"title": link.title, "type": "link", "url": f"/d/{link.uid}", "tooltip": link.tooltip, "icon": "dashboard",
            "includeVars": True, "keepTime": True, "targetBlank": False, "asDropdown": False, "tags": []}


def render(d: Dashboard) -> dict[str, Any]:
    links = [_link(link) for link in d.links]
    links.append({"title": "kvwatt dashboards", "type": "dashboards", "tags": ["kvwatt"], "asDropdown": True,
                  "includeVars": True, "keepTime": True, "targetBlank": False, "icon": "external link",
                  "tooltip": "", "url": ""})
    return {
        "id": None,
        "uid": d.uid,
        "title": d.title,
        "description": d.description,
        "tags": TAGS,
        "editable": False,  # provisioned copy; the UI import takes the same file (README)
        "graphTooltip": 1,
        "timezone": "browser",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {"refresh_intervals": ["10s", "30s", "1m", "5m", "15m"]},
        "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                  "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                  "name": "Annotations & Alerts", "type": "dashboard"}]},
        "links": links,
        "templating": {"list": [_variable(v) for v in d.variables]},
        "panels": _layout(d.rows),
    }


# --- variables ---------------------------------------------------------------------------------------------

DATASOURCE = Variable("datasource", "Data source", kind="datasource", multi=False,
                      description="Prometheus that scrapes kvwatt and the vLLM servers.")
# job -> instance -> server: each narrows the next, so a server is picked without matching labels by hand.
# kvwatt_server_info exists for every configured server from kvwatt's first tick, whatever the engine.
JOB = Variable("job", "Job", "label_values(kvwatt_server_info, job)",
               description="kvwatt's scrape jobs.")
INSTANCE = Variable("instance", "Instance", 'label_values(kvwatt_server_info{job=~"$job"}, instance)',
                    description="kvwatt exporters (one per GPU node) in the selected jobs.")
SERVER_QUERY = 'label_values(kvwatt_server_info{job=~"$job", instance=~"$instance"}, server)'
SERVER = Variable("server", "Server", SERVER_QUERY,
                  description="Engine servers the selected kvwatt exporters watch, by kvwatt's name. Engine "
                              "series follow it through their `server` target label (docs/fleet.md).")
WINDOW = Variable("window", "Window",
                  'label_values(kvwatt_kv_cache_usage_p95_ratio{job=~"$job", instance=~"$instance"}, window)',
                  multi=False, current="5m",
                  description="kvwatt's evaluation window (configured windows, default 1m and 5m).")
SERVER_ON = Variable("server_on", "Server ON", SERVER_QUERY, multi=False,
                     description="The server with KV offloading ON.")
SERVER_OFF = Variable("server_off", "Server OFF", SERVER_QUERY, multi=False,
                      description="Its OFF twin (same node, model and workload).")


# --- overview ----------------------------------------------------------------------------------------------

def _by(by: str, selector: str) -> str:
    return f"max by ({by}) ({selector})"


# Baseline kinds from the most to the least trustworthy (dashboards/README.md, Experiment results).
BASELINES = ("paired", "recorded", "estimated", "potential")
UNKNOWN = Mapping(NULL_NAN, "unknown", "unknown")
ACTIVE = (Mapping("0", "inactive", "ok"), Mapping("1", "ACTIVE", "bad"))
SIGNATURE = (Mapping("1", "active", "bad"), Mapping("0", "clear", "ok"), Mapping("-1", "no offloading", "off"),
             UNKNOWN)
# Grafana custom units (valueFormats.getValueFormat): count: scales by K/M/B/T and appends the symbol, si:
# by SI prefixes. Checked against @grafana/data 13.2: 1.23K tokens/s, 16 GFLOP/token, 12K tokens.
TOKENS_PER_SECOND = "count:tokens/s"
TOKENS = "count:tokens"
REQUESTS = "count:requests"


def or_unknown(expr: str, label: str = "", server: str = "server") -> str:
    """``expr`` (one series per server), and NaN for every watched server it has no value for.

    kvwatt leaves an unknown figure out of /metrics (catalog: None is never exported), so without this a
    server whose figure is unknown would silently vanish from a stat; NaN is mapped to "unknown". ``label``
    (a label of ``expr``'s series other than server) is set to "unknown" on the filler, for the legend.
    """
    fill = f"{_by('server', kv('kvwatt_server_info', server))} * NaN"
    if label:
        fill = f'label_replace({fill}, "{label}", "unknown", "server", ".*")'
    return f"{expr} or on (server) ({fill})"


def best_baseline(metric: str, server: str = "server") -> str:
    """``metric`` by (server, baseline), for each server only its most trustworthy baseline kind (BASELINES)."""
    return " or on (server) ".join(_by("server, baseline", kv(metric, server, baseline=b)) for b in BASELINES)


def saving_stderr(server: str = "server") -> str:
    """SE of dE for the baseline kind best_baseline picked."""
    return f"{_by('server, baseline', kv('kvwatt_energy_saving_stderr_ratio', server))}"


DE_BAND = ("dE", "dE + 1 SE", "dE - 1 SE")  # legend names: the line, the band's upper and lower edges


def dE_band(server: str = "server") -> tuple[Target, ...]:
    """dE of the best baseline and dE +/- 1 SE (the band's edges; absent where dE has no SE)."""
    best = f"({best_baseline('kvwatt_energy_saving_ratio', server)})"
    line, upper, lower = DE_BAND
    return (Target(best, line),
            Target(f"{best} + {saving_stderr(server)}", upper),
            Target(f"{best} - {saving_stderr(server)}", lower))


def _undersized_or_no_offloading() -> str:
    """1/0 while the buffer is (not) undersized; -1 ("no offloading") where the server does not offload, which
    kvwatt exports as no value for kvwatt_offload_buffer_undersized (catalog: _buffer)."""
    return (f"{_by('server', kv('kvwatt_offload_buffer_undersized'))} or on (server) "
            f"({_by('server', kv('kvwatt_offload_enabled'))} == 0) - 1")


VERDICT_STATE = (Mapping("2", "known", "ok"), Mapping("1", "provisional", "warn"), Mapping("0", "unknown", "unknown"),
                 UNKNOWN)


def _verdict_state() -> str:
    """kvwatt_verdict_state as one number per server and verdict: 2 known, 1 provisional, 0 unknown."""
    known = _by("server, verdict", kv("kvwatt_verdict_state", state="known"))
    provisional = _by("server, verdict", kv("kvwatt_verdict_state", state="provisional"))
    return f"2 * {known} + on (server, verdict) {provisional}"


_DE = best_baseline("kvwatt_energy_saving_ratio")
PAYING = Row("Is offloading paying right now?", (
    Panel("Energy saving dE now", "Per server: dE = (J/tok OFF - J/tok ON) / J/tok OFF (methods.md s2) against "
          "its most trustworthy baseline kind (paired = a live OFF twin, then recorded = an OFF profile, "
          "estimated = a model, potential = what a server without offloading would save with it), named in "
          "brackets; under it its standard error (SE, delta method) for the same kind. Green: offloading saves "
          "energy; red: it costs. unknown: no comparison yet (no baseline, or not enough load).",
          "percentunit",
          (Target(or_unknown(_DE, "baseline"), "{{server}} dE ({{baseline}})", instant=True),
           Target(f"({saving_stderr()} and on (server, baseline) ({_DE})) or on (server, baseline) (({_DE}) * NaN)",
                  "{{server}} SE ({{baseline}})", instant=True)),
          kind="stat", w=7, h=6, threshold_line=0, colors=("bad", "ok"), mappings=(UNKNOWN,),
          dashed_refids=("B",), no_value="unknown"),
    Panel("Offloading", "Per server: does it offload KV to host memory (on/off)? unknown: kvwatt has not read the "
          "server's configuration (server unreachable).", "none",
          (Target(or_unknown(_by("server", kv("kvwatt_offload_enabled"))), "{{server}}", instant=True),),
          kind="stat", w=3, h=6, mappings=(Mapping("1", "on", "info"), Mapping("0", "off", "off"), UNKNOWN),
          no_value="unknown"),
    Panel("Marginal energy per token now", "Per server and scope (gpu, host): (E - P_idle*dt) / generated tokens "
          "over the window (methods.md s1). unknown: less than 30 s of load, no tokens, or no energy reading.",
          "joule",
          (Target(or_unknown(_by("server, scope", kv("kvwatt_marginal_energy_per_token_joules")), "scope"),
                  "{{server}} {{scope}}", instant=True),),
          kind="stat", w=5, h=6, colors=("info", "info"), mappings=(UNKNOWN,), no_value="unknown"),
    Panel("Failure signatures now", "Per server: active / clear / unknown for the throughput-collapse signature "
          "(methods.md s5; unknown while any of its conditions cannot be told, e.g. GPU power unknown: see "
          "Collapse conditions below), sustained preemption onset, and an offload buffer too small for the p99 "
          "tool-call latency (no offloading: the server does not offload). unknown is never shown as clear.",
          "none",
          (Target(or_unknown(_by("server", kv("kvwatt_collapse_signature"))), "{{server}} collapse", instant=True),
           Target(or_unknown(_by("server", kv("kvwatt_preemption_onset"))), "{{server}} preemption onset",
                  instant=True),
           Target(or_unknown(_undersized_or_no_offloading()), "{{server}} buffer undersized", instant=True)),
          kind="stat", w=9, h=6, mappings=SIGNATURE, no_value="unknown"),
    # the verdicts the alerts, /api/status and the page read (one verdict everywhere): kvwatt's own series,
    # never the p95 compared here against a copy of a threshold
    Panel("KV pressure regime now", "Per server: kvwatt's regime verdict over the window, "
          "kvwatt_kv_pressure_regime_above: above on any sign of pressure the engine shows (requests waiting "
          "for KV capacity, preemptions, a recompute tax above noise, KV-block residency), below only on positive "
          "signs of low pressure; the threshold in use (next panel) only predicts (methods.md s10). Its state "
          "(known, provisional, unknown) is in the Verdict states panel. The same verdict as /api/status "
          "`regime`, the landing page and the KVPressureAboveThreshold alert. unknown: neither shown yet, or the "
          "server is down.",
          "none", (Target(or_unknown(_by("server", kv("kvwatt_kv_pressure_regime_above"))), "{{server}}",
                          instant=True),),
          kind="stat", w=8, h=6, mappings=(Mapping("0", "below", "ok"), Mapping("1", "above", "warn"), UNKNOWN),
          no_value="unknown"),
    Panel("Regime threshold in use", "Per server: the p95 KV usage threshold the regime verdict uses, "
          "kvwatt_kv_pressure_threshold_in_use_ratio, and where it comes from (source: located from the server's "
          "own history, or the configured kv_pressure_threshold; docs/pressure.md).", "percentunit",
          (Target(or_unknown(_by("server, source", kv("kvwatt_kv_pressure_threshold_in_use_ratio")), "source"),
                  "{{server}} ({{source}})", instant=True),),
          kind="stat", w=8, h=6, colors=("info", "info"), mappings=(UNKNOWN,), no_value="unknown"),
    Panel("Recompute tax now", "Per server: kvwatt_recompute_tax_ratio, the local_compute share minus the "
          "server's low-pressure reference share (methods.md s4); red from the default recompute_tax_threshold "
          f"{RECOMPUTE_TAX_THRESHOLD:g} (the KVRecomputeTaxHigh alert's). unknown: no reference share yet or too "
          "few prompt tokens.", "percentunit",
          (Target(or_unknown(_by("server", kv("kvwatt_recompute_tax_ratio"))), "{{server}}", instant=True),),
          kind="stat", w=8, h=6, threshold_line=RECOMPUTE_TAX_THRESHOLD, mappings=(UNKNOWN,), no_value="unknown"),
    Panel("Verdict states now", "Per server: the state of each learned verdict, kvwatt_verdict_state (a "
          "stateset: the state whose series is 1): regime, tax, reference (the low-pressure share the tax rests "
          "on) and threshold (the located one); known, provisional (shown, may still change) or unknown "
          "(methods.md s10). Read the three panels above with it: a provisional verdict is not yet a known one.",
          "none", (Target(or_unknown(_verdict_state(), "verdict"), "{{server}} {{verdict}}", instant=True),),
          kind="stat", w=24, h=4, mappings=VERDICT_STATE, no_value="unknown"),
))

REGIME = Row("Regime", (
    Panel("Regime now", "Per server: is the window's p95 KV usage above the regime threshold? Above it, "
          "offloading pays (14-32 % less energy per token in the study); below it, savings are within noise.",
          "none", (Target(_by("server", kv("kvwatt_kv_pressure_regime_above")), "{{server}}"),), kind="stat",
          w=6, mappings=(Mapping("0", "below threshold", "ok"), Mapping("1", "above threshold", "warn"))),
    Panel("Failure signatures", "1 while a signature holds: collapse (condition set classic: offloading on, zero "
          "preemptions, throughput collapsed, power near idle, requests pending; or stalled_engine: engine steps "
          "stopped while requests are pending), sustained preemption onset, and an offload "
          "buffer too small for the p99 tool-call latency (or failing stores).", "none",
          (Target(_by("server", kv("kvwatt_collapse_signature")), "{{server}} collapse"),
           Target(_by("server, condition_set", kv("kvwatt_collapse_condition_set")),
                  "{{server}} collapse: {{condition_set}}"),
           Target(_by("server", kv("kvwatt_preemption_onset")), "{{server}} preemption onset"),
           Target(_by("server", kv("kvwatt_offload_buffer_undersized")), "{{server}} buffer undersized")),
          kind="state-timeline", w=10, mappings=ACTIVE),
    Panel("Firing kvwatt alerts", "kvwatt alerts firing now (alertname KV* or Kvwatt*). Alerts without a server "
          "label (host-wide sources) are shown whatever server is selected.", "none",
          (Target('sum by (alertname, severity, server) (ALERTS{alertname=~"KV.*|Kvwatt.*", alertstate="firing", '
                  'server=~"$server|"})', table=True),),
          kind="table", w=8),
    Panel("Collapse conditions", "Each condition of the collapse signature on its own (methods.md s5); the "
          "signature fires when all the conditions of one set hold at once (classic: the first five; "
          "stalled_engine: engine_steps_stopped and requests_pending).", "none",
          (Target(_by("server, condition", kv("kvwatt_collapse_condition")), "{{server}} {{condition}}"),),
          kind="state-timeline", w=12, mappings=(Mapping("0", "no", "off"), Mapping("1", "yes", "warn"))),
    Panel("Source health", "1 when kvwatt's last read of a source (vllm per server, nvml, rapl) succeeded; the "
          "reason for a failure is in kvwatt_source_info.", "none",
          (Target(_by("source, server", kv("kvwatt_source_up", server="server|")), "{{source}} {{server}}"),),
          kind="state-timeline", w=12, mappings=(Mapping("0", "down", "bad"), Mapping("1", "up", "ok"))),
))

ENERGY = Row("Energy", (
    Panel("Marginal energy per token", "(E - P_idle*dt) / generated tokens over the window, for GPU and host "
          "(RAPL) scope (methods.md s1). Absent without 30 s of load or without tokens.", "joule",
          (Target(_by("server, scope", kv("kvwatt_marginal_energy_per_token_joules")), "{{server}} {{scope}}"),),
          w=8, min=0),
    Panel("Total energy per token", "E / generated tokens over the window, idle power included, for GPU and "
          "host scope.", "joule",
          (Target(_by("server, scope", kv("kvwatt_energy_per_token_joules")), "{{server}} {{scope}}"),), w=8, min=0),
    Panel("Energy saving dE by baseline", "dE = (J/tok OFF - J/tok ON) / J/tok OFF; positive means offloading "
          "saves. baseline: paired = a live OFF twin, recorded = an OFF profile from `kvwatt baseline record`, "
          "estimated = a model estimate (least trustworthy), potential = what a server without offloading "
          "would save with it (a model estimate).", "percentunit",
          (Target(_by("server, baseline", kv("kvwatt_energy_saving_ratio")), "{{server}} dE ({{baseline}})"),), w=8,
          threshold_line=0, colors=("bad", "ok")),
    Panel("GPU power vs idle baseline", "Board power, the rate of the GPU energy counter, and the idle baseline "
          "P_idle that marginal J/token subtracts.", "watt",
          (Target(f"max by (instance, gpu) ({kv('kvwatt_gpu_power_watts')})", "{{instance}} GPU {{gpu}} power"),
           Target(f"sum by (instance, gpu) ({rate(kv('kvwatt_gpu_energy_joules_total'))})",
                  "{{instance}} GPU {{gpu}} energy rate"),
           Target(f"max by (instance, gpu) ({kv('kvwatt_gpu_idle_power_watts')})", "{{instance}} GPU {{gpu}} idle")),
          w=8, min=0, dashed_refids=("C",)),
    Panel("Host power (RAPL) vs idle baseline", "CPU package and DRAM power from the rate of the RAPL energy "
          "counters, against their idle baselines.", "watt",
          (Target(f"sum by (instance, zone, domain) ({rate(kv('kvwatt_host_energy_joules_total'))})",
                  "{{instance}} {{zone}} {{domain}}"),
           Target(f"max by (instance, zone, domain) ({kv('kvwatt_host_idle_power_watts')})",
                  "{{instance}} {{zone}} {{domain}} idle")),
          w=8, min=0, dashed_refids=("B",)),
    Panel("Generation throughput", "Generated tokens per second: kvwatt's window figure per server (every "
          "engine) and, for vLLM servers, the rate of vLLM's own counter.", TOKENS_PER_SECOND,
          (Target(_by("server", kv("kvwatt_generation_tokens_per_second")), "{{server}} (kvwatt window)"),
           Target(f"sum by (server) ({rate(vl('vllm:generation_tokens_total'))})", "{{server}} (vLLM counter)")),
          w=8, min=0),
    Panel("dE with its standard-error band: $server", "dE of this server against its most trustworthy baseline "
          "kind (as in the first row), with a band of one standard error either side (delta method, methods.md "
          "s2; no band where the comparison has no repeats yet) and a dashed zero line: a band wholly above "
          "zero means offloading saves energy beyond noise. One panel per selected server.", "percentunit",
          dE_band(), w=24, threshold_line=0, colors=("bad", "ok"), band=DE_BAND,
          repeat="server"),
))

# money and carbon (docs/energy.md): the series exist only where a price or a carbon intensity is configured;
# the currency is a label (the legend says it), so the money units name no currency
PER_MILLION_TOKENS, PER_DAY, PER_KWH = "suffix:/1M tokens", "suffix:/day", "suffix:/kWh"
CO2_PER_THOUSAND_TOKENS, CO2_PER_DAY, CO2_PER_KWH = "si:g/1k tokens", "si:g/day", "si:g/kWh"
NOT_CONFIGURED = ("Absent unless kvwatt is given an electricity price (electricity_price_per_kwh with "
                  "electricity_currency) or a carbon intensity (carbon_intensity_g_per_kwh): docs/energy.md.")

# kvwatt exports the marginal energy and the price and intensity in force; the money and carbon figures per
# server are their products (exporter/derive/cost.py; opt-in on /metrics, exporter/rules/optin.py), taken here
JOULES_PER_KWH = 3.6e6
SECONDS_PER_DAY = 86400
MARGINAL_WATTS = (f"{kv('kvwatt_marginal_energy_per_token_joules')}\n* on (job, instance, server, window) group_left\n"
                  f"{kv('kvwatt_generation_tokens_per_second')}")
PRICE = f"max by (job, instance, currency) ({kv('kvwatt_electricity_price_per_kwh')})"
INTENSITY = f"max by (job, instance) ({kv('kvwatt_carbon_intensity_grams_per_kwh')})"


def priced(quantity: str, per_kwh: str, by: str, currency: bool) -> str:
    """``quantity`` (joules) / 3.6e6 J/kWh x the price or intensity per kWh of the same kvwatt."""
    join = "group_left (currency)" if currency else "group_left"
    return f"max by ({by}) (\n({quantity}) / {JOULES_PER_KWH:g}\n* on (job, instance) {join}\n{per_kwh}\n)"


MONEY = Row("Money and carbon", (
    Panel("Energy cost per day at this load", "Per server and scope: the window's power above idle, "
          "(E - P_idle*dt)/dt, held for a day, at the electricity price in force (currency in the legend). "
          + NOT_CONFIGURED, PER_DAY,
          (Target(priced(f"({MARGINAL_WATTS}) * {SECONDS_PER_DAY}", PRICE, "server, scope, currency", True),
                  "{{server}} {{scope}} ({{currency}})"),), w=8, min=0),
    Panel("CO2e per day at this load", "Per server and scope: the same power above idle held for a day, in "
          "grams CO2e at the grid's carbon intensity. " + NOT_CONFIGURED, CO2_PER_DAY,
          (Target(priced(f"({MARGINAL_WATTS}) * {SECONDS_PER_DAY}", INTENSITY, "server, scope", False),
                  "{{server}} {{scope}}"),),
          w=8, min=0),
    Panel("Price and carbon intensity in force", "The electricity price per kWh (configured, or read from a "
          "series URL; absent once older than price_max_age) and its currency. " + NOT_CONFIGURED, PER_KWH,
          (Target(f"max by (currency, source) ({kv('kvwatt_electricity_price_per_kwh')})",
                  "price ({{currency}}, {{source}})"),), w=8, min=0),
    Panel("Energy cost per million generated tokens", "Per server and scope: marginal J/token "
          "(kvwatt_marginal_energy_per_token_joules) x 1e6 tokens at the electricity price (currency in the "
          "legend). " + NOT_CONFIGURED, PER_MILLION_TOKENS,
          (Target(priced(f"{kv('kvwatt_marginal_energy_per_token_joules')} * 1e6", PRICE, "server, scope, currency",
                         True),
                  "{{server}} {{scope}} ({{currency}})"),), w=8, min=0),
    Panel("CO2e per 1,000 generated tokens", "Per server and scope: marginal J/token x 1,000 tokens in grams "
          "CO2e at the grid's carbon intensity. " + NOT_CONFIGURED, CO2_PER_THOUSAND_TOKENS,
          (Target(priced(f"{kv('kvwatt_marginal_energy_per_token_joules')} * 1e3", INTENSITY, "server, scope",
                         False), "{{server}} {{scope}}"),),
          w=8, min=0),
    Panel("Grid carbon intensity in force", "g CO2e per kWh (configured, or read from a series URL). "
          + NOT_CONFIGURED, CO2_PER_KWH,
          (Target(f"max by (source) ({kv('kvwatt_carbon_intensity_grams_per_kwh')})", "intensity ({{source}})"),),
          w=8, min=0),
))

RECOMPUTE = Row("Recomputation", (
    Panel("Prompt-token share by source: $server", "Where prompt tokens come from over the window: computed locally, "
          "hit in the GPU prefix cache, or loaded from the offload tier (stacked, sums to 1). One panel per "
          "selected server. First prefills only (vLLM counters): re-prefill after preemption is not counted.",
          "percentunit",
          (Target(_by("source", kv("kvwatt_prompt_token_share_ratio")), "{{source}}"),),
          w=24, stacked=True, min=0, max=1, repeat="server"),
    Panel("Prompt tokens by source (vLLM only)", "Rate of vLLM's prompt-token counter by source, per server "
          "(stacked). vLLM servers only; the shares above come from every engine.", TOKENS_PER_SECOND,
          (Target(f"sum by (server, source) ({rate(vl('vllm:prompt_tokens_by_source_total'))})",
                  "{{server}} {{source}}"),),
          w=6, stacked=True, min=0),
    Panel("Recompute tax", "local_compute share minus this server's low-pressure reference share (methods.md "
          "s4): the prompt work that pressure forces the GPU to redo. Dashed: the reference share.", "percentunit",
          (Target(_by("server", kv("kvwatt_recompute_tax_ratio")), "{{server}} tax"),
           Target(_by("server", kv("kvwatt_recompute_reference_share_ratio")), "{{server}} reference share")),
          w=6, dashed_refids=("B",)),
    Panel("Preemptions per minute", "Preemptions per minute from kvwatt's dense samples and from the rate of "
          "vLLM's counter. Dashed line: the default onset rate "
          f"{ONSET_PER_MINUTE:g}/min (preemption_onset_per_minute).", "cpm",
          (Target(_by("server", kv("kvwatt_preemptions_per_minute")), "{{server}} (kvwatt window)"),
           Target(f"sum by (server) ({rate(vl('vllm:num_preemptions_total'))}) * 60",
                  "{{server}} (vLLM counter)")),
          w=6, min=0, threshold_line=ONSET_PER_MINUTE),
))

RECOMPUTE_ENERGY = Row("Energy of recomputation", (
    Panel("Per-phase J/token: $server", "Marginal joules per computed prompt token, per generated token and per "
          "reloaded token, by scope (gpu, host): measured by kvwatt's non-negative regression of each repeat "
          "window's marginal energy on its token counts once the token mix varies enough (methods.md s12), the "
          "configured attribution model before (see the source panel). Dashed: the standard error. One panel "
          "per selected server.", "joule",
          (Target(_by("scope, phase", kv("kvwatt_phase_joules_per_token")), "{{scope}} {{phase}}"),
           Target(_by("scope, phase", kv("kvwatt_phase_joules_per_token_stderr")), "{{scope}} {{phase}} SE")),
          w=10, min=0, log=True, dashed_refids=("B",), repeat="server"),
    Panel("Per-phase costs: measured or prior", "Which per-phase costs are in use per server and scope: "
          "measured (state known) or the attribution prior (not_identifiable: too few windows or a constant "
          "token mix; /api/status says why), and the repeat windows they rest on.", "none",
          (Target(_by("server, scope, source, state", kv("kvwatt_phase_cost_source")) + " * on (server, scope) "
                  "group_left "
                  + _by("server, scope", kv("kvwatt_phase_cost_windows")),
                  "{{server}} {{scope}}: {{source}} ({{state}})", instant=True),),
          kind="stat", w=4),
    Panel("Recomputation energy and offloading saving", "Power spent recomputing the recomputation tax's prompt "
          "tokens (tax share x prompt tokens/s x J per computed prompt token) and, on an offloading server, the "
          "power offloading saved (reloaded tokens/s x (J computed - J reloaded)), per server and scope "
          "(methods.md s12). x 24 h / 1000 = kWh per day.", "watt",
          (Target(_by("server, scope", kv("kvwatt_recompute_tax_watts")), "{{server}} {{scope}} recomputation"),
           Target(_by("server, scope", kv("kvwatt_offload_saved_watts")), "{{server}} {{scope}} saved")),
          w=10, min=0, dashed_refids=("B",)),
))

PRESSURE = Row("KV pressure", (
    Panel("KV cache usage vs threshold", "p95 of KV usage over the window from kvwatt's 1 s samples, the "
          "regime threshold in use (dashed: located from the server's own history once there is evidence, else "
          "the configured one; docs/pressure.md), and the scraped vLLM gauge, which misses the peaks.",
          "percentunit",
          (Target(_by("server", kv("kvwatt_kv_cache_usage_p95_ratio")), "{{server}} p95"),
           Target(_by("server, source", kv("kvwatt_kv_pressure_threshold_in_use_ratio")),
                  "{{server}} threshold ({{source}})"),
           Target(f"max by (server) ({vl('vllm:kv_cache_usage_perc')})", "{{server}} scraped (vLLM gauge)")),
          w=8, min=0, max=1, dashed_refids=("B",)),
    Panel("Requests running and waiting (vLLM only)", "vLLM's scheduler gauges summed over its engine cores: "
          "running, and waiting by reason (capacity = no KV room, deferred). vLLM servers only: kvwatt exports no "
          "engine-neutral request counts.", REQUESTS,
          (Target(f"sum by (server) ({vl('vllm:num_requests_running')})", "{{server}} running"),
           Target(f"sum by (server, reason) ({vl('vllm:num_requests_waiting_by_reason')})",
                  "{{server}} waiting ({{reason}})")),
          w=8, min=0),
    Panel("Offload buffer residency", "How long an offloaded block survives: buffer bytes / write rate "
          "(methods.md s6). It should exceed the workload's p99 tool-call latency (dashed: the default "
          f"p99_tool_latency {P99_TOOL_LATENCY_SECONDS:g} s); kvwatt_offload_buffer_undersized compares against "
          "the configured value.", "s",
          (Target(_by("server", kv("kvwatt_offload_buffer_residency_seconds")), "{{server}} residency"),),
          w=8, min=0, threshold_line=P99_TOOL_LATENCY_SECONDS),
    Panel("Offload buffer: configured vs recommended", "The configured host offload buffer and the size that "
          "keeps residency above the p99 tool-call latency with the configured headroom.", "bytes",
          (Target(_by("server", kv("kvwatt_offload_buffer_bytes")), "{{server}} configured"),
           Target(_by("server", kv("kvwatt_offload_recommended_buffer_bytes")), "{{server}} recommended")),
          w=8, min=0, dashed_refids=("B",)),
    Panel("Offload bandwidth", "Store (GPU to host) and load (host to GPU) rates: kvwatt's window figures per "
          "server (every engine) and, for vLLM servers, the rate of vLLM's offload byte counters.", "Bps",
          (Target(_by("server", kv("kvwatt_offload_write_bytes_per_second")), "{{server}} store"),
           Target(_by("server", kv("kvwatt_offload_read_bytes_per_second")), "{{server}} load"),
           Target(f"sum by (server) ({rate(vl('vllm:kv_offload_store_bytes_total'))})",
                  "{{server}} store (vLLM counter)"),
           Target(f"sum by (server) ({rate(vl('vllm:kv_offload_load_bytes_total'))})",
                  "{{server}} load (vLLM counter)")),
          w=16, min=0),
))

# vLLM's tiering (a CPU tier and secondary tiers such as "1:fs" on disk): one series per server and tier, from vLLM's
# own counters (kvwatt's per-tier families are opt-in; issue 41). Absent on servers without TieringOffloadingSpec.
TIERS = Row("Offload tiers (vLLM tiering)", (
    Panel("Tier traffic (vLLM only)", "Per server and tier: bytes/s cascaded from the CPU tier on to a secondary tier "
          "(written) and promoted from it back into the CPU tier (read), vLLM's "
          "kv_offload_tiering_{write,read}_bytes counters.",
          "Bps",
          (Target(f"sum by (server, tier) ({rate(vl('vllm:kv_offload_tiering_write_bytes_total'))})",
                  "{{server}} {{tier}} written"),
           Target(f"sum by (server, tier) ({rate(vl('vllm:kv_offload_tiering_read_bytes_total'))})",
                  "{{server}} {{tier}} read")),
          w=8, min=0),
    Panel("Tier hit ratio (vLLM only)", "Per server and tier: chunk lookups that hit in the tier / lookups sent to it "
          "(the CPU tier is 0:primary). A disk tier that is written and never hit costs its writes for nothing.",
          "percentunit",
          (Target(f"sum by (server, tier) ({rate(vl('vllm:kv_offload_tiering_chunk_hits_total'))})\n/\n"
                  f"sum by (server, tier) ({rate(vl('vllm:kv_offload_tiering_chunk_queries_total'))})",
                  "{{server}} {{tier}}"),),
          w=8, min=0, max=1),
    Panel("Cached prompt tokens by tier (vLLM only)", "Per server: prompt tokens/s served from each cache tier "
          "(device = the GPU's prefix cache, host = the CPU tier, disk = a secondary tier), vLLM 0.32's "
          "prompt_tokens_cached_by_source counter.", TOKENS_PER_SECOND,
          (Target(f"sum by (server, source) ({rate(vl('vllm:prompt_tokens_cached_by_source_total'))})",
                  "{{server}} {{source}}"),),
          w=8, min=0, stacked=True),
    Panel("Tier drops and failures (vLLM only)", "Per server and tier: KV blocks/s the tier's back-pressure detector "
          "dropped (alert KVOffloadTierDroppingStores) and failed promotion and cascade jobs/s (alert "
          "KVOffloadTierJobsFailing). A healthy tier shows none.", "ops",
          (Target(f"sum by (server, tier) ({rate(vl('vllm:kv_offload_tiering_backpressure_blocks_dropped_total'))})",
                  "{{server}} {{tier}} blocks dropped"),
           Target(f"sum by (server, tier) ({rate(vl('vllm:kv_offload_tiering_promotion_job_failures_total'))})",
                  "{{server}} {{tier}} failed promotions"),
           Target(f"sum by (server, tier) ({rate(vl('vllm:kv_offload_tiering_cascade_job_failures_total'))})",
                  "{{server}} {{tier}} failed cascades")),
          w=24, min=0),
))

LATENCY = Row("Latency (vLLM only)", (
    Panel("Time to first token (vLLM only)", "TTFT quantiles from vLLM's histogram, per server. vLLM servers "
          "only: kvwatt exports no engine-neutral latency.", "s",
          tuple(Target(quantile(q, vl("vllm:time_to_first_token_seconds_bucket")), f"{{{{server}}}} p{p}")
                for q, p in ((0.5, 50), (0.95, 95), (0.99, 99))),
          w=12, min=0),
    Panel("Inter-token latency (vLLM only)", "Inter-token latency (time per output token) quantiles from vLLM's "
          "histogram, per server. vLLM servers only.", "s",
          tuple(Target(quantile(q, vl("vllm:inter_token_latency_seconds_bucket")), f"{{{{server}}}} p{p}")
                for q, p in ((0.5, 50), (0.95, 95), (0.99, 99))),
          w=12, min=0),
))

ANALYSIS = Row("Analysis", (
    Panel("Cached-to-prefill ratio vs critical", "kappa observed = external_kv_transfer / local_compute prompt "
          "tokens over the window, against kappa_crit (dashed, roofline form, methods.md s7): above it, "
          "execution turns transfer-bound.", "none",
          (Target(_by("server", kv("kvwatt_cached_to_prefill_ratio")), "{{server}} kappa"),
           Target(_by("server", kv("kvwatt_critical_cached_to_prefill_ratio")), "{{server}} kappa_crit")),
          w=10, log=True, dashed_refids=("B",), axis_label="tokens loaded per token computed"),
    Panel("Recompute break-even length", "Sequence length above which reloading KV beats recomputing it "
          "(Tetris form with GQA width, methods.md s7).", TOKENS,
          (Target(_by("server", kv("kvwatt_recompute_breakeven_tokens")), "{{server}}"),), kind="stat", w=4),
))

OVERVIEW = Dashboard(
    uid="kvwatt-overview",
    title="kvwatt / Overview",
    description="Per engine server: is offloading paying right now, KV-pressure regime, cost of a token, where "
                "prompt tokens come from, failure signatures. Generated by dashboards/generate.py; do not edit "
                "by hand.",
    variables=(DATASOURCE, JOB, INSTANCE, SERVER, WINDOW),
    rows=(PAYING, REGIME, ENERGY, MONEY, RECOMPUTE, RECOMPUTE_ENERGY, PRESSURE, TIERS, LATENCY, ANALYSIS),
    links=(Link("Experiment: ON vs OFF", "kvwatt-experiment", "Paired comparison of an offloading ON/OFF pair"),),
)


# --- experiment --------------------------------------------------------------------------------------------

def _on_off(title: str, description: str, unit: str, metric: str, **kw: Any) -> Panel:
    legend = "{{server}} {{scope}}" if "scope" in BY_NAME[metric].labels else "{{server}}"
    by = "server, scope" if "scope" in BY_NAME[metric].labels else "server"
    return Panel(title, description + " ON: $server_on; OFF: $server_off.", unit,
                 (Target(_by(by, kv(metric, server="server_on")), "ON " + legend),
                  Target(_by(by, kv(metric, server="server_off")), "OFF " + legend)), **kw)


REPORT_TEXT = """\
**Offline experiment results.** `kvwatt experiment` runs a paired ON/OFF plan (n >= 3 runs per condition,
shuffled order, idle baseline, warm-up, measurement, cool-down; methods.md s2) and writes its results as files
in the output directory it is given: per-run rows (CSV/JSON) and a report (Markdown, with HTML and PNG
figures) holding n, the means, dE% and dTPS% with their standard errors. Read the report there; this dashboard
shows the *live* comparison kvwatt computes while both servers run (`kvwatt_energy_saving_ratio` and friends)
and the two servers side by side. See dashboards/README.md."""

COMPARISON = Row("Live comparison", (
    Panel("Energy saving dE ($server_on)", "dE of the ON server against each baseline kind (paired = its live "
          "OFF twin, recorded = an OFF profile, estimated = a model). Positive means offloading saves.",
          "percentunit",
          (Target(_by("baseline", kv("kvwatt_energy_saving_ratio", server="server_on")), "dE {{baseline}}"),),
          kind="stat", w=8),
    Panel("Standard error of dE ($server_on)", "Standard error of dE by the delta method (methods.md s2), "
          "where the comparison has repeats.", "percentunit",
          (Target(_by("baseline", kv("kvwatt_energy_saving_stderr_ratio", server="server_on")),
                  "SE {{baseline}}"),),
          kind="stat", w=6),
    Panel("Throughput gain dTPS ($server_on)", "dTPS = (TPS ON - TPS OFF) / TPS OFF against each baseline "
          "kind.", "percentunit",
          (Target(_by("baseline", kv("kvwatt_throughput_gain_ratio", server="server_on")), "dTPS {{baseline}}"),),
          kind="stat", w=6),
    Panel("dE and dTPS over time", "Energy saving and throughput gain of every selected server that has a "
          "comparison, by baseline kind; dashed: one standard error of dE.", "percentunit",
          (Target(_by("server, baseline", kv("kvwatt_energy_saving_ratio")), "{{server}} dE ({{baseline}})"),
           Target(_by("server, baseline", kv("kvwatt_throughput_gain_ratio")), "{{server}} dTPS ({{baseline}})"),
           Target(_by("server, baseline", kv("kvwatt_energy_saving_stderr_ratio")), "{{server}} SE dE ({{baseline}})"),
           Target(_by("server, baseline", kv("kvwatt_throughput_gain_stderr_ratio")),
                  "{{server}} SE dTPS ({{baseline}})")),
          w=24, dashed_refids=("C", "D"), threshold_line=0, colors=("bad", "ok")),
    Panel("dE with its standard-error band ($server_on)", "dE of the ON server against its most trustworthy "
          "baseline kind (paired first), with a band of one standard error either side (no band where the "
          "comparison has no repeats yet) and a dashed zero line: a band wholly above zero means offloading "
          "saves energy beyond noise.", "percentunit",
          dE_band("server_on"), w=24, threshold_line=0, colors=("bad", "ok"), band=DE_BAND),
))

SIDE_BY_SIDE = Row("Side by side: ON vs OFF", (
    _on_off("Marginal J/token: ON vs OFF", "Marginal energy per generated token of both servers (GPU and host).",
            "joule", "kvwatt_marginal_energy_per_token_joules", w=8, min=0),
    _on_off("Generated tokens/s: ON vs OFF", "Generation throughput of both servers over the window.",
            TOKENS_PER_SECOND, "kvwatt_generation_tokens_per_second", w=8, min=0),
    _on_off("KV usage p95: ON vs OFF", "p95 KV usage of both servers from dense samples: the comparison is "
            "only meaningful where both run the same pressure.", "percentunit",
            "kvwatt_kv_cache_usage_p95_ratio", w=8, min=0, max=1),
    _on_off("Preemptions per minute: ON vs OFF", "Preemptions per minute of both servers; offloading should "
            "bring them down (zero preemptions with collapsed throughput is the collapse signature).", "cpm",
            "kvwatt_preemptions_per_minute", w=8, min=0),
    Panel("Prompt-token share: ON vs OFF", "Prompt-token shares by source of both servers: offloading moves "
          "the recompute tax from local_compute into external_kv_transfer. ON: $server_on; OFF: $server_off.",
          "percentunit",
          (Target(_by("server, source", kv("kvwatt_prompt_token_share_ratio", server="server_on")),
                  "ON {{server}} {{source}}"),
           Target(_by("server, source", kv("kvwatt_prompt_token_share_ratio", server="server_off")),
                  "OFF {{server}} {{source}}")),
          w=8, min=0, max=1),
    Panel("TTFT p95: ON vs OFF (vLLM only)", "p95 time to first token from vLLM's histogram of both servers "
          "(vLLM servers only). ON: $server_on; OFF: $server_off.", "s",
          (Target(quantile(0.95, vl("vllm:time_to_first_token_seconds_bucket", server="server_on")),
                  "ON {{server}} p95"),
           Target(quantile(0.95, vl("vllm:time_to_first_token_seconds_bucket", server="server_off")),
                  "OFF {{server}} p95")),
          w=8, min=0),
))

REPORTS = Row("Offline results", (
    Panel("Where the experiment report is", "How to read the offline ON/OFF results that `kvwatt experiment` "
          "writes as files.", "none", kind="text", w=24, h=6, content=REPORT_TEXT),
))

EXPERIMENT = Dashboard(
    uid="kvwatt-experiment",
    title="kvwatt / Experiment: offloading ON vs OFF",
    description="Live paired comparison of an offloading ON server with its OFF twin: dE, dTPS with standard "
                "errors, and the two servers side by side. Generated by dashboards/generate.py.",
    variables=(DATASOURCE, JOB, INSTANCE, SERVER, WINDOW, SERVER_ON, SERVER_OFF),
    rows=(COMPARISON, SIDE_BY_SIDE, REPORTS),
    links=(Link("Overview", "kvwatt-overview", "Regime, energy, recomputation and pressure of every server"),),
)

DASHBOARDS: dict[str, Dashboard] = {"kvwatt-overview.json": OVERVIEW, "kvwatt-experiment.json": EXPERIMENT}


# --- the fleet: the global layer's recorded series (deploy/fleet/kvwatt-fleet-rules.yaml) --------------------

FLEET_DIR = HERE.parent / "deploy" / "fleet"
FLEET_RULES = FLEET_DIR / "kvwatt-fleet-rules.yaml"


def _fleet_records() -> frozenset[str]:
    import yaml  # the node dashboards need no YAML; the fleet one reads what the fleet rules record

    groups = yaml.safe_load(FLEET_RULES.read_text(encoding="utf-8"))["groups"]
    return frozenset(r["record"] for g in groups for r in g["rules"])


FLEET_RECORDS = _fleet_records()


def rec(name: str, **eq: str) -> str:
    """Selector of a series the fleet rules record (KeyError: a name they do not record); a cluster-level
    series follows the ``cluster`` variable."""
    if name not in FLEET_RECORDS:
        raise KeyError(f"{name} is not recorded by {FLEET_RULES.name}")
    pairs = [("cluster", "=~", "$cluster")] if name.startswith("cluster") else []
    return name + (_matchers(pairs + [(k, "=", v) for k, v in eq.items()]) if pairs or eq else "")


CLUSTER = Variable("cluster", "Cluster", "label_values(cluster:kvwatt_servers:count, cluster)",
                   description="Clusters reporting kvwatt's servers (their Prometheus' external label).")
FLEET_DATASOURCE = Variable("datasource", "Data source", kind="datasource", multi=False,
                            description="The global layer: a federating Prometheus, Thanos Querier or Mimir "
                                        "that evaluates deploy/fleet/kvwatt-fleet-rules.yaml.")
PARTIAL = ("Absent while a cluster that reported in the last hour reports nothing (Clusters missing): the "
           "fleet's sums are never shown for part of it (docs/fleet.md).")

FLEET_NOW = Row("The fleet now", (
    Panel("GPU J/token, fleet", "The fleet's GPU energy over its generated tokens, both summed over every server "
          "of every cluster (kvwatt's longest window), not a mean of the servers' ratios. " + PARTIAL, "joule",
          (Target(rec("fleet_scope:kvwatt_energy_per_token_joules:ratio_window5m", scope="gpu"), "fleet"),),
          kind="stat", w=4),
    Panel("dE, fleet", "1 - the marginal energy the fleet's compared servers used / what they would have used "
          "without offloading, by baseline kind (docs/fleet.md). " + PARTIAL, "percentunit",
          (Target(rec("fleet_baseline:kvwatt_energy_saving:ratio_window5m"), "{{baseline}}"),),
          kind="stat", w=6),
    Panel("Recomputation tax, fleet", "The recomputation tax's power summed over every server (GPU). "
          + PARTIAL, "watt",
          (Target(rec("fleet_scope:kvwatt_recompute_tax_watts:sum_window5m", scope="gpu"), "fleet"),),
          kind="stat", w=4),
    Panel("Recomputation share of GPU energy, fleet", "The tax's power over the fleet's marginal GPU power. "
          + PARTIAL, "percentunit",
          (Target(rec("fleet_scope:kvwatt_recompute_energy_share:ratio_window5m", scope="gpu"), "fleet"),),
          kind="stat", w=4),
    Panel("Servers watched", "Engine servers kvwatt watches, every cluster. " + PARTIAL, "none",
          (Target(rec("fleet:kvwatt_servers:count"), "servers"),), kind="stat", w=3),
    Panel("Clusters missing", "Clusters that reported kvwatt's servers in the last hour and report none now: "
          "while above 0 the fleet figures are absent.", "none",
          (Target(rec("fleet:kvwatt_clusters_missing:count"), "missing"),), kind="stat", w=3),
))

FLEET_CLUSTERS = Row("Per cluster", (
    Panel("GPU J/token by cluster", "Each cluster's GPU energy over its tokens (kvwatt's longest window).",
          "joule",
          (Target(rec("cluster_scope:kvwatt_energy_per_token_joules:ratio_window5m", scope="gpu"),
                  "{{cluster}}"),), w=8, min=0),
    Panel("GPU power by cluster", "Each cluster's GPU power drawn by the servers kvwatt watches.", "watt",
          (Target(rec("cluster_scope:kvwatt_energy_joules:rate_window5m", scope="gpu"), "{{cluster}}"),),
          w=8, min=0),
    Panel("Recomputation tax by cluster", "Each cluster's recomputation tax in watts (GPU).", "watt",
          (Target(rec("cluster_scope:kvwatt_recompute_tax_watts:sum_window5m", scope="gpu"), "{{cluster}}"),),
          w=8, min=0),
    Panel("dE by cluster", "1 - each cluster's marginal energy / what it would have used without offloading, "
          "by baseline kind; dashed: zero.", "percentunit",
          (Target(f"1 - {rec('cluster_baseline:kvwatt_saving_marginal_energy_joules:rate_window5m')}\n"
                  f"/ ({rec('cluster_baseline:kvwatt_saving_counterfactual_energy_joules:rate_window5m')} > 0)",
                  "{{cluster}} {{baseline}}"),), w=8, threshold_line=0, colors=("bad", "ok")),
    Panel("Servers by cluster", "Engine servers kvwatt watches in each cluster.", "none",
          (Target(rec("cluster:kvwatt_servers:count"), "{{cluster}}"),), w=8, min=0),
))

FLEET = Dashboard(
    uid="kvwatt-fleet",
    title="kvwatt / Fleet",
    description="The fleet's J/token, dE and recomputation tax summed across clusters, for the global layer "
                "(docs/fleet.md). Generated by dashboards/generate.py into deploy/fleet/.",
    variables=(FLEET_DATASOURCE, CLUSTER),
    rows=(FLEET_NOW, FLEET_CLUSTERS),
    links=(Link("Overview", "kvwatt-overview", "One cluster's servers (against that cluster's Prometheus)"),),
)
# written beside the fleet rules: it runs against the global layer, not a cluster's Prometheus
FLEET_DASHBOARDS: dict[str, Dashboard] = {"kvwatt-fleet.json": FLEET}


# --- command line ------------------------------------------------------------------------------------------

def dumps(d: Dashboard) -> str:
    return json.dumps(render(d), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed JSON is stale or a "
                        "generator copies a rule of exporter/rules/__init__.py as a literal")
    parser.add_argument("--dir", type=Path, default=HERE, help="where the JSON files live (default: %(default)s)")
    args = parser.parse_args(argv)
    stale: list[str] = []
    files = ([(args.dir / f, d) for f, d in DASHBOARDS.items()]
             + [(FLEET_DIR / f, d) for f, d in FLEET_DASHBOARDS.items()])
    for path, dashboard in files:
        filename = path.name
        text = dumps(dashboard)
        if args.check:
            current = path.read_text(encoding="utf-8") if path.exists() else ""
            if current != text:
                stale.append(filename)
                diff = difflib.unified_diff(current.splitlines(), text.splitlines(), f"{path} (committed)",
                                            f"{path} (generated)", lineterm="", n=1)
                print("\n".join(list(diff)[:40]), file=sys.stderr)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    if stale:
        print(f"stale: {', '.join(stale)}; run: python dashboards/generate.py", file=sys.stderr)
    copies = rulecopies.find_copies() if args.check else []
    for c in copies:
        print(c, file=sys.stderr)
    return 1 if stale or copies else 0


if __name__ == "__main__":
    sys.exit(main())
