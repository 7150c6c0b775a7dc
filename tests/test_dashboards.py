"""Lint of the committed Grafana dashboards, mirroring grafana/dashboard-linter's rules, plus kvwatt's own.

Each rule is a function ``dashboard -> [error, ...]``. Every rule must pass on every committed dashboard, and
every rule must fail on at least one mutated copy (``MUTATIONS``), so a rule that cannot fail is caught too.
Where a rule is stricter than the linter's, the docstring says so. PromQL is parsed by the real Prometheus
parser (promtool) in ``test_target_promql_rule``.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from exporter.catalog import BY_NAME
from exporter.sources.vllm_names import WIRE_SERIES
from tests.support.grafana import (
    DASHBOARD_DIR,
    QUERY_PANEL_TYPES,
    ROOT,
    Selector,
    expand,
    load_dashboards,
    panels,
    ranges,
    referenced_variables,
    selectors,
    targets,
    variables,
)

Dashboard = dict[str, Any]
Rule = Callable[[Dashboard], list[str]]

GENERATOR = DASHBOARD_DIR / "generate.py"
EXPECTED_UIDS = {"kvwatt-overview.json": "kvwatt-overview", "kvwatt-experiment.json": "kvwatt-experiment"}
DS_UIDS = {"$datasource", "${datasource}"}
SERVER_VARS = {"server", "server_on", "server_off"}
GRAFANA_GLOBALS = {"__rate_interval", "__interval", "__range", "__all"}
# Labels vLLM puts on its series (vllm-metrics.md), what Prometheus adds, and the `server` target label its
# scrape carries (docs/fleet.md, label discipline 3).
VLLM_LABELS = {"job", "instance", "server", "model_name", "engine", "le", "source", "reason", "transfer_type", "tier"}
SCRAPE_LABELS = {"job", "instance"}
# ALERTS carry the labels their alert rule keeps, not the scrape's: no job matcher is required (a rule that
# aggregates job away would otherwise vanish from the panel). Engine series (vllm:*) are scraped by the
# engine's job, not kvwatt's: they follow the selection through `server`, never job/instance. Both are
# documented in dashboards/README.md.
JOB_EXEMPT = {"ALERTS"}
# Grafana unit ids (the linter's list, grafana-data valueFormats categories), restricted to families we may use.
# "short" is not among them: it is a scale, not a unit (tokens/s, FLOPs per token, token counts).
VALID_UNITS = {
    "none", "string", "percent", "percentunit", "sci", "locale",
    "bytes", "decbytes", "bits", "decbits", "kbytes", "mbytes", "gbytes",
    "pps", "binBps", "Bps", "binbps", "bps", "KiBs", "KBs", "MiBs", "MBs", "GiBs", "GBs",
    "watt", "kwatt", "mwatt", "watth", "kwatth", "joule", "ev", "volt", "amp",
    "flops", "mflops", "gflops", "tflops", "pflops",
    "hertz", "ns", "µs", "ms", "s", "m", "h", "d", "dtdurationms", "dtdurations",
    "cps", "ops", "reqps", "rps", "wps", "iops", "cpm", "opm", "rpm", "wpm",
    "bool", "bool_yes_no", "bool_on_off", "celsius",
}
# Grafana's custom units (valueFormats.getValueFormat): count:<symbol> scales by K/M/B/T, si:<symbol> by SI
# prefixes, suffix:<symbol> does not scale.
CUSTOM_UNIT = re.compile(r"^(count|si|suffix):\S.*$")
LABEL_VALUES = re.compile(r"^(label_values|label_names|metrics|query_result)\((.*?)(?:,\s*(\w+))?\)$")


def query_panels(d: Dashboard) -> list[dict[str, Any]]:
    return [p for p in panels(d) if p.get("type") in QUERY_PANEL_TYPES]


def variable(d: Dashboard, name: str) -> dict[str, Any] | None:
    return next((v for v in variables(d) if v.get("name") == name), None)


def where(p: dict[str, Any], t: dict[str, Any] | None = None) -> str:
    return f"panel {p.get('title')!r}" + (f" target {t.get('refId')}" if t else "")


# --- template rules ----------------------------------------------------------------------------------------

def template_datasource_rule(d: Dashboard) -> list[str]:
    """template-datasource-rule: one templated Prometheus datasource named `datasource`, labeled 'Data source'."""
    ds = [v for v in variables(d) if v.get("type") == "datasource"]
    if len(ds) != 1:
        return [f"expected one datasource variable, found {len(ds)}"]
    v = ds[0]
    errors = []
    if v.get("name") != "datasource":
        errors.append(f"datasource variable is named {v.get('name')!r}, should be 'datasource'")
    if v.get("query") != "prometheus":
        errors.append(f"datasource variable queries {v.get('query')!r}, should be 'prometheus'")
    if v.get("label") != "Data source":
        errors.append(f"datasource variable is labeled {v.get('label')!r}, should be 'Data source'")
    return errors


def _check_template(d: Dashboard, name: str) -> list[str]:
    """The linter's checkTemplate, plus includeAll (All = .+ needs the All option)."""
    v = variable(d, name)
    if v is None:
        return [f"is missing the {name} template"]
    errors = []
    if (v.get("datasource") or {}).get("uid") not in DS_UIDS:
        errors.append(f"{name} template should use datasource '$datasource', is {v.get('datasource')!r}")
    if v.get("type") != "query":
        errors.append(f"{name} template should be a Prometheus query, is {v.get('type')!r}")
    if v.get("label") != name.replace("_", " ").capitalize():
        errors.append(f"{name} template should be labeled {name.replace('_', ' ').capitalize()!r}")
    if not v.get("multi"):
        errors.append(f"{name} template should be a multi select")
    if not v.get("includeAll"):
        errors.append(f"{name} template should include All")
    if v.get("allValue") != ".+":
        errors.append(f"{name} template allValue should be '.+', is {v.get('allValue')!r}")
    return errors


def template_job_rule(d: Dashboard) -> list[str]:
    """template-job-rule."""
    return _check_template(d, "job")


def template_instance_rule(d: Dashboard) -> list[str]:
    """template-instance-rule (instance of the kvwatt exporter, see template_chained_rule)."""
    return _check_template(d, "instance")


def template_server_rule(d: Dashboard) -> list[str]:
    """kvwatt convention: `server` follows the same rules as `job`."""
    return _check_template(d, "server")


# Each variable's query must filter on the variables before it (Grafana refreshes a variable when one it
# references changes), and read a kvwatt series, which exists for every engine.
CHAIN = {"instance": ("job",), "server": ("job", "instance"), "server_on": ("job", "instance"),
         "server_off": ("job", "instance"), "window": ("job", "instance")}


def template_chained_rule(d: Dashboard) -> list[str]:
    """kvwatt: job -> instance -> server are chained (no matching by hand), in that order, on
    kvwatt series; instance is kvwatt's exporter, so no vLLM address has to be matched to a server."""
    errors = []
    order = [v.get("name") for v in variables(d)]
    for name, before in CHAIN.items():
        v = variable(d, name)
        if v is None:
            continue
        m = LABEL_VALUES.match(v.get("query") or "")
        sels = selectors(m.group(2)) if m else []
        if len(sels) != 1 or not (sels[0].name or "").startswith("kvwatt_"):
            errors.append(f"template {name!r} does not read one kvwatt series: {v.get('query')!r}")
            continue
        for label in before:
            if not _matcher_is(sels[0], label, f"${label}"):
                errors.append(f'template {name!r} is not chained on {label}=~"${label}"')
            elif label in order and order.index(label) > order.index(name):
                errors.append(f"template {name!r} comes before {label!r}, which it follows")
    return errors


def template_label_promql_rule(d: Dashboard) -> list[str]:
    """template-label-promql-rule: label_values(<PromQL>, label) etc. with a valid function and selector."""
    errors = []
    for v in variables(d):
        if v.get("type") != "query":
            continue
        m = LABEL_VALUES.match(v.get("query") or "")
        if not m:
            errors.append(f"template {v.get('name')!r}: invalid templated label {v.get('query')!r}")
            continue
        try:
            sels = selectors(m.group(2))
        except ValueError as e:
            errors.append(f"template {v.get('name')!r}: {e}")
            continue
        if m.group(1) == "label_values" and not sels and m.group(3) is None:
            continue  # label_values(label)
        if not sels:
            errors.append(f"template {v.get('name')!r}: no series selector in {v.get('query')!r}")
    return errors


def template_on_time_change_reload_rule(d: Dashboard) -> list[str]:
    """template-on-time-change-reload: query variables refresh on time range change (2)."""
    return [f"template {v.get('name')!r} refresh is {v.get('refresh')!r}, should be 2"
            for v in variables(d) if v.get("type") == "query" and v.get("refresh") != 2]


def template_variables_used_rule(d: Dashboard) -> list[str]:
    """Every $var referenced exists; every variable but the datasource is used (template-unused)."""
    defined = {v["name"] for v in variables(d)}
    text = json.dumps([p for p in panels(d)]) + json.dumps([v.get("query", "") for v in variables(d)])
    used = referenced_variables(text)
    errors = [f"${name} is referenced but not defined" for name in sorted(used - defined - GRAFANA_GLOBALS)]
    errors += [f"variable {name!r} is never used" for name in sorted(defined - used - {"datasource"})]
    return errors


# --- panel rules -------------------------------------------------------------------------------------------

def panel_datasource_rule(d: Dashboard) -> list[str]:
    """panel-datasource-rule, for every panel with queries and (stricter) every one of its targets."""
    errors = []
    for p in query_panels(d):
        if (p.get("datasource") or {}).get("uid") not in DS_UIDS:
            errors.append(f"{where(p)} does not use the templated datasource: {p.get('datasource')!r}")
        for t in p.get("targets", []):
            if (t.get("datasource") or {}).get("uid") not in DS_UIDS:
                errors.append(f"{where(p, t)} does not use the templated datasource: {t.get('datasource')!r}")
    return errors


def panel_title_description_rule(d: Dashboard) -> list[str]:
    """panel-title-description-rule for every non-row panel; (kvwatt) the description names each series read."""
    errors = []
    for p in panels(d):
        if p.get("type") == "row":
            continue
        if not p.get("title") or not p.get("description"):
            errors.append(f"panel id {p.get('id')} has a missing title or description")
            continue
        for t in p.get("targets", []):
            for name in series_names_of(t.get("expr", "")):
                if f"`{name}`" not in p["description"]:
                    errors.append(f"{where(p)}: description does not name its source series `{name}`")
    return errors


def unit_of(p: dict[str, Any]) -> str:
    return ((p.get("fieldConfig") or {}).get("defaults") or {}).get("unit", "")


def panel_units_rule(d: Dashboard) -> list[str]:
    """panel-units-rule, for every panel with queries (stricter: state-timeline too; "short" refused; Grafana's
    count:/suffix: custom units accepted)."""
    errors = []
    for p in query_panels(d):
        unit = unit_of(p)
        if unit not in VALID_UNITS and not CUSTOM_UNIT.match(unit):
            errors.append(f"{where(p)} has no or invalid units defined: {unit!r}")
    return errors


# The unit a panel must have, from the name of the kvwatt series its first query reads (Prometheus naming:
# the suffix says the unit). Longest suffix first. Exempt: flags drawn through value mappings ("none").
UNIT_BY_SUFFIX = (
    # money and carbon (docs/energy.md): currency in the label, so money units name none
    ("_cost_per_million_tokens", "suffix:/1M tokens"), ("_cost_per_day", "suffix:/day"),
    ("_price_per_kwh", "suffix:/kWh"), ("_grams_per_thousand_tokens", "si:g/1k tokens"),
    ("_grams_per_day", "si:g/day"), ("_grams_per_kwh", "si:g/kWh"),
    ("_tokens_per_second", "count:tokens/s"), ("_per_generated_token", "si:FLOP/token"),
    ("_bytes_per_second", "Bps"), ("_per_token_joules", "joule"), ("_per_minute", "cpm"), ("_windows", "count:windows"),
    ("_tokens", "count:tokens"), ("_seconds", "s"), ("_bytes", "bytes"), ("_watts", "watt"),
    ("_joules_total", "watt"),  # drawn as rate(): watts
)
PER_KWH_SUFFIXES = ("_price_per_kwh", "_grams_per_kwh")
PRICED_UNITS = {"suffix:/1M tokens", "suffix:/day", "si:g/1k tokens", "si:g/day"}
# _ratio series are shares or relative changes (percentunit) except kappa, tokens loaded per token computed.
NOT_PERCENT_RATIOS = {"kvwatt_cached_to_prefill_ratio", "kvwatt_critical_cached_to_prefill_ratio"}


def expected_unit(series: str) -> str | None:
    if series.endswith("_ratio"):
        return "none" if series in NOT_PERCENT_RATIOS else "percentunit"
    return next((unit for suffix, unit in UNIT_BY_SUFFIX if series.endswith(suffix)), None)


def unit_follows_series_rule(d: Dashboard) -> list[str]:
    """kvwatt: a panel's unit is the one its first kvwatt series' name states (tokens/s, FLOP/token, tokens,
    joules per token, ratios as percentunit, ...), never a bare number."""
    errors = []
    for p in query_panels(d):
        names = [n for t in p.get("targets", [])[:1] for n in series_names_of(t["expr"]) if n.startswith("kvwatt_")]
        if len(set(names)) > 1 and any(n.endswith(PER_KWH_SUFFIXES) for n in names):
            # energy priced in the query (x price or intensity per kWh): a money or carbon unit
            if unit_of(p) not in PRICED_UNITS:
                errors.append(f"{where(p)} prices energy ({names}) but its unit is {unit_of(p)!r}, not one of "
                              f"{sorted(PRICED_UNITS)}")
            continue
        want = expected_unit(names[0]) if names else None
        if want is not None and unit_of(p) != want:
            errors.append(f"{where(p)} reads {names[0]} but its unit is {unit_of(p)!r}, not {want!r}")
    return errors


def panel_no_targets_rule(d: Dashboard) -> list[str]:
    """panel-no-targets-rule: a query panel without a query shows nothing."""
    return [f"{where(p)} has no targets" for p in query_panels(d) if not p.get("targets")]


# --- target rules ------------------------------------------------------------------------------------------

def series_names_of(expr: str) -> list[str]:
    return [n for s in selectors(expr) for n in s.names()]


def target_rate_interval_rule(d: Dashboard) -> list[str]:
    """target-rate-interval-rule; stricter: every range vector, whatever function takes it."""
    return [f"{where(p, t)}: {fn}(...[{rng}]) should use $__rate_interval"
            for p, t in targets(d) for fn, rng in ranges(t["expr"]) if rng != "$__rate_interval"]


def _matcher_is(s: Selector, label: str, value: str) -> bool:
    m = s.matcher(label)
    return m is not None and m.op == "=~" and m.value == value


def target_job_rule(d: Dashboard) -> list[str]:
    """target-job-rule: every kvwatt selector has job=~"$job" (ALERTS and engine series exempt, JOB_EXEMPT)."""
    return [f"{where(p, t)}: selector {s.name} has no job=~\"$job\" matcher"
            for p, t in targets(d) for s in selectors(t["expr"])
            if s.name not in JOB_EXEMPT and s.name not in WIRE_SERIES and not _matcher_is(s, "job", "$job")]


def target_labels_rule(d: Dashboard) -> list[str]:
    """kvwatt: each selector filters by the variables its series' labels allow and by no label it lacks.

    kvwatt_* (labels from exporter.catalog): instance=~"$instance" always, server=~"$server" (or
    $server_on/$server_off) when it has a server label, window=~"$window" when it has a window label.
    vllm:* : a server variable (its scrape's target label) and neither job nor instance, which are vLLM's
    scrape's, not the kvwatt exporter's the variables pick.
    """
    errors = []
    for p, t in targets(d):
        for s in selectors(t["expr"]):
            for name in s.names():
                errors += [f"{where(p, t)}: {e}" for e in _selector_label_errors(s, name)]
    return errors


def _selector_label_errors(s: Selector, name: str) -> list[str]:
    used = {m.label for m in s.matchers} - {"__name__"}
    if name in BY_NAME:
        labels = set(BY_NAME[name].labels) | SCRAPE_LABELS
        errors = [f"{name} has no label {lab!r}" for lab in sorted(used - labels)]
        if not _matcher_is(s, "instance", "$instance"):
            errors.append(f'{name} is not filtered by instance=~"$instance"')
        if "server" in labels:
            m = s.matcher("server")
            if m is None or m.op != "=~" or not referenced_variables(m.value) & SERVER_VARS:
                errors.append(f"{name} is not filtered by a server variable")
        if "window" in labels and not _matcher_is(s, "window", "$window"):
            errors.append(f'{name} is not filtered by window=~"$window"')
        return errors
    if name in WIRE_SERIES:
        errors = [f"{name} has no label {lab!r}" for lab in sorted(used - VLLM_LABELS)]
        errors += [f"{name} is filtered by the kvwatt exporter's {lab}" for lab in sorted(used & SCRAPE_LABELS)]
        m = s.matcher("server")
        if m is None or m.op != "=~" or not referenced_variables(m.value) & SERVER_VARS:
            errors.append(f"{name} is not filtered by a server variable")
        return errors
    return []


def series_exist_rule(d: Dashboard) -> list[str]:
    """Every series a query or a variable names is exported by kvwatt (catalog) or by vLLM (WIRE_SERIES)."""
    exprs = [(where(p, t), t["expr"]) for p, t in targets(d)]
    for v in variables(d):
        m = LABEL_VALUES.match(v.get("query") or "")
        if v.get("type") == "query" and m:
            exprs.append((f"variable {v['name']!r}", m.group(2)))
    known = set(BY_NAME) | set(WIRE_SERIES) | JOB_EXEMPT
    return [f"{at}: {name} is neither a kvwatt series (exporter.catalog) nor a vLLM one (WIRE_SERIES)"
            for at, expr in exprs for name in series_names_of(expr) if name not in known]


def engine_neutral_rule(d: Dashboard) -> list[str]:
    """kvwatt: kvwatt_* series are engine-neutral, vllm:* series exist for vLLM servers only. A panel that
    reads only vLLM series says "(vLLM only)" in its title; a vLLM target beside kvwatt ones says "vLLM" in
    its legend, so a panel empty or half-drawn for another engine is never mistaken for a missing figure."""
    errors = []
    for p in query_panels(d):
        names = [n for t in p.get("targets", []) for n in series_names_of(t["expr"])]
        engine = [n for n in names if n in WIRE_SERIES]
        if not engine:
            continue
        if not any(n.startswith("kvwatt_") for n in names):
            if "(vLLM only)" not in p.get("title", ""):
                errors.append(f"{where(p)} reads only vLLM series ({engine[0]}) but is not titled (vLLM only)")
            continue
        for t in p.get("targets", []):
            if any(n in WIRE_SERIES for n in series_names_of(t["expr"])) and "vLLM" not in t.get("legendFormat", ""):
                errors.append(f"{where(p, t)} reads a vLLM series; its legend does not say vLLM")
    return errors


# --- the overview's first row: is offloading paying right now? --------------------------------------------

FIRST_ROW_TITLE = "Is offloading paying right now?"
# series the first row must read, each in an instant stat, with what its value mappings must show
FIRST_ROW_SERIES = {
    "kvwatt_energy_saving_ratio": {},
    "kvwatt_energy_saving_stderr_ratio": {},
    "kvwatt_offload_enabled": {"1": "on", "0": "off"},
    "kvwatt_marginal_energy_per_token_joules": {},
    "kvwatt_collapse_signature": {"1": "active", "0": "clear"},
    "kvwatt_preemption_onset": {"1": "active", "0": "clear"},
    "kvwatt_offload_buffer_undersized": {"1": "active", "0": "clear", "-1": "no offloading"},
}
UNKNOWN_FILL = re.compile(r"or on \(server\) \(.*kvwatt_server_info\{[^}]*\}\) \* NaN")


def first_row(d: Dashboard) -> list[dict[str, Any]]:
    """The panels of the dashboard's first row (under its first row header)."""
    out: list[dict[str, Any]] = []
    for p in d.get("panels", [])[1:]:
        if p.get("type") == "row":
            break
        out.append(p)
    return out


def _value_texts(p: dict[str, Any]) -> tuple[dict[str, str], str | None]:
    mappings = ((p.get("fieldConfig") or {}).get("defaults") or {}).get("mappings", [])
    values = {k: v.get("text") for m in mappings if m.get("type") == "value" for k, v in m["options"].items()}
    special = next((m["options"]["result"].get("text") for m in mappings
                    if m.get("type") == "special" and m["options"].get("match") == "null+nan"), None)
    return values, special


def first_row_rule(d: Dashboard) -> list[str]:
    """kvwatt: the overview opens with "is offloading paying right now": per server dE with its
    baseline kind (legend) and SE, offload on/off, marginal J/token and the failure signatures, as instant
    stats; a server whose figure is unknown reads "unknown" (a NaN filler from kvwatt_server_info mapped by a
    null+nan mapping), never clear or off."""
    if d.get("uid") != "kvwatt-overview":
        return []
    panels0 = d.get("panels", [])
    if not panels0 or panels0[0].get("type") != "row" or panels0[0].get("title") != FIRST_ROW_TITLE:
        return [f"the first row is not {FIRST_ROW_TITLE!r}"]
    errors, seen = [], set()
    for p in first_row(d):
        values, special = _value_texts(p)
        if p.get("type") != "stat":
            errors.append(f"{where(p)} is a {p.get('type')}, not a stat")
        if special != "unknown":
            errors.append(f"{where(p)} does not show NaN / no value as 'unknown'")
        for t in p.get("targets", []):
            names = series_names_of(t["expr"])
            if not t.get("instant"):
                errors.append(f"{where(p, t)} is not an instant query (the value now)")
            if "{{server}}" not in t.get("legendFormat", ""):
                errors.append(f"{where(p, t)}: legend does not name the server")
            if names and names[0] == "kvwatt_energy_saving_ratio" and "{{baseline}}" not in t["legendFormat"]:
                errors.append(f"{where(p, t)}: dE legend does not name its baseline kind")
            first = names[0] if names else ""
            if first in FIRST_ROW_SERIES and first != "kvwatt_energy_saving_stderr_ratio" \
                    and not UNKNOWN_FILL.search(t["expr"]):
                errors.append(f"{where(p, t)}: a server without {first} would vanish instead of reading unknown")
            for name in names[:1]:  # what the target shows; the rest only fills in unknowns
                want = FIRST_ROW_SERIES.get(name)
                if want is None:
                    continue
                seen.add(name)
                wrong = {k: values.get(k) for k, text in want.items() if values.get(k) != text}
                if wrong:
                    errors.append(f"{where(p)}: mappings for {name} show {wrong}, want {want}")
    errors += [f"the first row does not read {name}" for name in sorted(set(FIRST_ROW_SERIES) - seen)]
    return errors


def _threshold_values(p: dict[str, Any]) -> list[float]:
    steps = (((p.get("fieldConfig") or {}).get("defaults") or {}).get("thresholds") or {}).get("steps", [])
    return [s["value"] for s in steps if s.get("value") is not None]


def de_time_series_rule(d: Dashboard) -> list[str]:
    """kvwatt: every dE time series draws a zero line; each dashboard has one with an SE band:
    targets dE + SE and dE - SE, the upper filled down to the lower (fillBelowTo)."""
    errors, bands = [], 0
    for p in query_panels(d):
        if p.get("type") != "timeseries" or not any(
                "kvwatt_energy_saving_ratio" in series_names_of(t["expr"]) for t in p.get("targets", [])):
            continue
        custom = p["fieldConfig"]["defaults"].get("custom", {})
        if 0 not in _threshold_values(p) or custom.get("thresholdsStyle", {}).get("mode", "off") == "off":
            errors.append(f"{where(p)} draws no zero line")
        legends = {t.get("legendFormat"): t["expr"] for t in p.get("targets", [])}
        for o in p["fieldConfig"].get("overrides", []):
            props = {prop["id"]: prop.get("value") for prop in o.get("properties", [])}
            upper, lower = o.get("matcher", {}).get("options"), props.get("custom.fillBelowTo")
            if lower is None:
                continue
            ok = all(name in legends and "kvwatt_energy_saving_stderr_ratio" in legends[name]
                     for name in (upper, lower))
            if not ok or " + " not in legends.get(upper, "") or " - " not in legends.get(lower, ""):
                errors.append(f"{where(p)}: fillBelowTo {upper!r} -> {lower!r} is not dE + SE down to dE - SE")
            else:
                bands += 1
    return errors + ([] if bands else ["no dE time series with an SE band (fillBelowTo)"])


# --- dashboard rules ---------------------------------------------------------------------------------------

def uneditable_dashboard_rule(d: Dashboard) -> list[str]:
    """uneditable-dashboard-rule: the committed JSON is the provisioned copy."""
    return [] if d.get("editable") is False else ["is editable, it should be set to 'editable: false'"]


def no_inputs_rule(d: Dashboard) -> list[str]:
    """No `__inputs` / `${DS_...}`: they break file provisioning."""
    text = json.dumps(d)
    errors = ["has __inputs"] if "__inputs" in d or "__requires" in d else []
    return errors + (["references a ${DS_...} input"] if re.search(r"\$\{?DS_", text) else [])


def unique_ids_rule(d: Dashboard) -> list[str]:
    ids = [p.get("id") for p in panels(d)]
    errors = [f"panel id {i} is used twice" for i in sorted({i for i in ids if ids.count(i) > 1})]
    errors += [f"panel {p.get('title')!r} has no integer id" for p in panels(d) if not isinstance(p.get("id"), int)]
    for p in panels(d):
        refs = [t.get("refId") for t in p.get("targets", [])]
        if len(refs) != len(set(refs)) or None in refs:
            errors.append(f"{where(p)} has missing or duplicate refIds {refs}")
    return errors


def schema_version_rule(d: Dashboard) -> list[str]:
    """schemaVersion 42, and nothing its migrations (41: time_options, 42: hideFrom.tooltip) would rewrite."""
    errors = [] if d.get("schemaVersion") == 42 else [f"schemaVersion is {d.get('schemaVersion')!r}, not 42"]
    if "time_options" in (d.get("timepicker") or {}):
        errors.append("timepicker.time_options was removed in schemaVersion 41")
    for p in panels(d):
        for o in (p.get("fieldConfig") or {}).get("overrides", []):
            for prop in o.get("properties", []):
                v = prop.get("value")
                if prop.get("id") == "custom.hideFrom" and v.get("viz") and not v.get("tooltip"):
                    errors.append(f"{where(p)}: hideFrom.viz without tooltip (schemaVersion 42)")
    return errors


def links_rule(d: Dashboard) -> list[str]:
    """The two dashboards link to each other by uid."""
    other = {"kvwatt-overview": "kvwatt-experiment", "kvwatt-experiment": "kvwatt-overview"}.get(d.get("uid"))
    urls = {link.get("url") for link in d.get("links", [])}
    return [] if other and f"/d/{other}" in urls else [f"no link to /d/{other}"]


RULES: dict[str, Rule] = {
    "template-datasource-rule": template_datasource_rule,
    "template-job-rule": template_job_rule,
    "template-instance-rule": template_instance_rule,
    "template-server-rule": template_server_rule,
    "template-chained-rule": template_chained_rule,
    "template-label-promql-rule": template_label_promql_rule,
    "template-on-time-change-reload-rule": template_on_time_change_reload_rule,
    "template-variables-used-rule": template_variables_used_rule,
    "panel-datasource-rule": panel_datasource_rule,
    "panel-title-description-rule": panel_title_description_rule,
    "panel-units-rule": panel_units_rule,
    "unit-follows-series-rule": unit_follows_series_rule,
    "engine-neutral-rule": engine_neutral_rule,
    "first-row-rule": first_row_rule,
    "de-time-series-rule": de_time_series_rule,
    "panel-no-targets-rule": panel_no_targets_rule,
    "target-rate-interval-rule": target_rate_interval_rule,
    "target-job-rule": target_job_rule,
    "target-labels-rule": target_labels_rule,
    "series-exist-rule": series_exist_rule,
    "uneditable-dashboard-rule": uneditable_dashboard_rule,
    "no-inputs-rule": no_inputs_rule,
    "unique-ids-rule": unique_ids_rule,
    "schema-version-rule": schema_version_rule,
    "links-rule": links_rule,
}

DASHBOARDS = load_dashboards()


def test_committed_dashboards_are_the_expected_ones():
    assert {name: d.get("uid") for name, d in DASHBOARDS.items()} == EXPECTED_UIDS


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("filename", sorted(EXPECTED_UIDS))
def test_rule_passes(rule: str, filename: str):
    errors = RULES[rule](DASHBOARDS[filename])
    assert not errors, f"{filename}: {rule}:\n" + "\n".join(errors)


# --- every rule must be able to fail ----------------------------------------------------------------------

def _panel(d: Dashboard, title: str) -> dict[str, Any]:
    return next(p for p in panels(d) if p.get("title") == title)


def _var(d: Dashboard, name: str) -> dict[str, Any]:
    v = variable(d, name)
    assert v is not None
    return v


def _set(obj: dict[str, Any], key: str, value: Any) -> None:
    obj[key] = value


def _swap_variables(d: Dashboard, a: str, b: str) -> None:
    vs = d["templating"]["list"]
    i, j = vs.index(_var(d, a)), vs.index(_var(d, b))
    vs[i], vs[j] = vs[j], vs[i]


def _cut_expr(d: Dashboard, title: str, at: str) -> None:
    t = _panel(d, title)["targets"][0]
    assert at in t["expr"], (at, t["expr"])
    t["expr"] = t["expr"][:t["expr"].index(at)]


def _replace_expr(d: Dashboard, title: str, old: str, new: str) -> None:
    t = _panel(d, title)["targets"][0]
    assert old in t["expr"], (old, t["expr"])
    t["expr"] = t["expr"].replace(old, new)


MUTATIONS: list[tuple[str, str, Callable[[Dashboard], None]]] = [
    ("template-datasource-rule", "renamed", lambda d: _set(_var(d, "datasource"), "name", "DS_PROMETHEUS")),
    ("template-datasource-rule", "removed", lambda d: d["templating"]["list"].pop(0)),
    ("template-job-rule", "single-select", lambda d: _set(_var(d, "job"), "multi", False)),
    ("template-job-rule", "allValue", lambda d: _set(_var(d, "job"), "allValue", "")),
    ("template-job-rule", "fixed datasource", lambda d: _set(_var(d, "job"), "datasource", {"uid": "abc"})),
    ("template-instance-rule", "no All", lambda d: _set(_var(d, "instance"), "includeAll", False)),
    ("template-server-rule", "server allValue", lambda d: _set(_var(d, "server"), "allValue", ".*")),
    ("template-server-rule", "server missing", lambda d: d["templating"]["list"].remove(_var(d, "server"))),
    ("template-chained-rule", "server not chained on instance",
     lambda d: _set(_var(d, "server"), "query", 'label_values(kvwatt_server_info{job=~"$job"}, server)')),
    ("template-chained-rule", "instance of vLLM's scrape",
     lambda d: _set(_var(d, "instance"), "query", 'label_values(vllm:num_requests_running{job=~"$job"}, instance)')),
    ("template-chained-rule", "server before instance", lambda d: _swap_variables(d, "server", "instance")),
    ("template-label-promql-rule", "bad function", lambda d: _set(_var(d, "server"), "query", "labels(up, x)")),
    ("template-on-time-change-reload-rule", "refresh on load", lambda d: _set(_var(d, "server"), "refresh", 1)),
    ("template-variables-used-rule", "undefined variable",
     lambda d: _replace_expr(d, "Regime now", '"$server"', '"$servers"')),
    ("panel-datasource-rule", "panel datasource",
     lambda d: _set(_panel(d, "Regime now"), "datasource", {"type": "prometheus", "uid": "${DS_PROMETHEUS}"})),
    ("panel-datasource-rule", "target datasource",
     lambda d: _set(_panel(d, "Regime now")["targets"][0], "datasource", {"uid": "prom"})),
    ("panel-title-description-rule", "no description", lambda d: _set(_panel(d, "Regime now"), "description", "")),
    ("panel-title-description-rule", "series not named",
     lambda d: _set(_panel(d, "Regime now"), "description", "The regime.")),
    ("panel-units-rule", "no unit", lambda d: _panel(d, "Regime now")["fieldConfig"]["defaults"].pop("unit")),
    ("panel-units-rule", "invalid unit",
     lambda d: _set(_panel(d, "Marginal energy per token")["fieldConfig"]["defaults"], "unit", "joules")),
    ("panel-units-rule", "short", lambda d: _set(_panel(d, "Generation throughput")["fieldConfig"]["defaults"],
                                                 "unit", "short")),
    ("unit-follows-series-rule", "tokens/s as a bare number",
     lambda d: _set(_panel(d, "Generation throughput")["fieldConfig"]["defaults"], "unit", "none")),
    ("unit-follows-series-rule", "energy priced per day shown in joules",
     lambda d: _set(_panel(d, "Energy cost per day at this load")["fieldConfig"]["defaults"], "unit", "joule")),
    ("unit-follows-series-rule", "token count as a bare number",
     lambda d: _set(_panel(d, "Recompute break-even length")["fieldConfig"]["defaults"], "unit", "none")),
    ("unit-follows-series-rule", "dE not in percent",
     lambda d: _set(_panel(d, "Energy saving dE now")["fieldConfig"]["defaults"], "unit", "none")),
    ("engine-neutral-rule", "vLLM-only panel not titled so",
     lambda d: _set(_panel(d, "Time to first token (vLLM only)"), "title", "Time to first token")),
    ("engine-neutral-rule", "vLLM target legend does not say vLLM",
     lambda d: _set(_panel(d, "Generation throughput")["targets"][1], "legendFormat", "{{server}} (counter)")),
    ("first-row-rule", "another row first", lambda d: _set(d["panels"][0], "title", "Regime")),
    ("first-row-rule", "unknown shown as clear",
     lambda d: _set(_panel(d, "Failure signatures now")["fieldConfig"]["defaults"]["mappings"][1]["options"]
                    ["result"], "text", "clear")),
    ("first-row-rule", "a server without a value vanishes",
     lambda d: _cut_expr(d, "Offloading", " or on (server) (")),
    ("first-row-rule", "range query",
     lambda d: _set(_panel(d, "Energy saving dE now")["targets"][0], "instant", False)),
    ("first-row-rule", "no baseline kind",
     lambda d: _set(_panel(d, "Energy saving dE now")["targets"][0], "legendFormat", "{{server}} dE")),
    ("first-row-rule", "no SE", lambda d: _panel(d, "Energy saving dE now")["targets"].pop(1)),
    ("first-row-rule", "no offload on/off", lambda d: _panel(d, "Offloading")["targets"].pop(0)),
    ("first-row-rule", "no marginal J/token",
     lambda d: _replace_expr(d, "Marginal energy per token now", "kvwatt_marginal_energy_per_token_joules",
                             "kvwatt_energy_per_token_joules")),
    ("de-time-series-rule", "no zero line",
     lambda d: _set(_panel(d, "Energy saving dE by baseline")["fieldConfig"]["defaults"]["custom"],
                    "thresholdsStyle", {"mode": "off"})),
    ("de-time-series-rule", "no SE band",
     lambda d: _set(_panel(d, "dE with its standard-error band: $server")["fieldConfig"], "overrides", [])),
    ("panel-no-targets-rule", "no targets", lambda d: _set(_panel(d, "Regime now"), "targets", [])),
    ("target-rate-interval-rule", "fixed range",
     lambda d: _replace_expr(d, "Time to first token (vLLM only)", "[$__rate_interval]", "[5m]")),
    ("target-job-rule", "no job matcher", lambda d: _replace_expr(d, "Regime now", 'job=~"$job", ', "")),
    ("target-job-rule", "job equality", lambda d: _replace_expr(d, "Regime now", 'job=~"$job"', 'job="$job"')),
    ("target-labels-rule", "kvwatt's instance on a vLLM series",
     lambda d: _replace_expr(d, "Time to first token (vLLM only)", 'server=~"$server"',
                             'server=~"$server", instance=~"$instance"')),
    ("target-labels-rule", "vLLM series not following server",
     lambda d: _replace_expr(d, "Time to first token (vLLM only)", 'server=~"$server"', 'model_name=~".+"')),
    ("target-labels-rule", "kvwatt series not following instance",
     lambda d: _replace_expr(d, "Regime now", 'instance=~"$instance", ', "")),
    ("target-labels-rule", "model_name on a kvwatt series",
     lambda d: _replace_expr(d, "Regime now", 'server=~"$server"', 'model_name=~"$model_name"')),
    ("target-labels-rule", "no window",
     lambda d: _replace_expr(d, "Regime now", ', window=~"$window"', "")),
    ("series-exist-rule", "llm-d's vllm:num_preemptions",
     lambda d: _replace_expr(d, "Preemptions per minute", "kvwatt_preemptions_per_minute", "vllm:num_preemptions")),
    ("series-exist-rule", "unknown kvwatt series",
     lambda d: _replace_expr(d, "Regime now", "kvwatt_kv_pressure_regime_above", "kvwatt_regime")),
    ("uneditable-dashboard-rule", "editable", lambda d: _set(d, "editable", True)),
    ("no-inputs-rule", "__inputs", lambda d: _set(d, "__inputs", [{"name": "DS_PROMETHEUS"}])),
    ("unique-ids-rule", "duplicate id",
     lambda d: _set(_panel(d, "Regime now"), "id", _panel(d, "Source health")["id"])),
    ("schema-version-rule", "schema 41", lambda d: _set(d, "schemaVersion", 41)),
    ("links-rule", "no links", lambda d: _set(d, "links", [])),
]


def test_every_rule_has_a_mutation():
    assert set(RULES) <= {rule for rule, _, _ in MUTATIONS} | {"target-promql-rule"}


@pytest.mark.parametrize("rule,what,mutate", MUTATIONS, ids=[f"{r}:{w}" for r, w, _ in MUTATIONS])
def test_rule_fails_on_a_broken_dashboard(rule: str, what: str, mutate: Callable[[Dashboard], None]):
    d = copy.deepcopy(DASHBOARDS["kvwatt-overview.json"])
    mutate(d)
    try:
        errors = RULES[rule](d)
    except ValueError as e:  # the lexer refusing a query is a failure too
        errors = [str(e)]
    assert errors, f"{rule} did not notice: {what}"


# --- target-promql-rule: the real Prometheus parser -------------------------------------------------------

LINT_VALUES = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}


def _lint_expand(expr: str, d: Dashboard) -> str:
    """The linter's placeholder expansion: variables become plain words, $__rate_interval a duration."""
    values = {v["name"]: f"placeholder_{v['name']}" for v in variables(d)}
    return expand(expr, {**values, **LINT_VALUES})


def _promtool_errors(exprs: list[tuple[str, str]], tmp_path: Path) -> list[str]:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian package prometheus) is not installed")
    groups = [{"name": f"{i}: {label}", "rules": [{"record": "kvwatt_dashboard_query", "expr": expr}]}
              for i, (label, expr) in enumerate(exprs)]
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False), encoding="utf-8")
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    if proc.returncode == 0:
        return []
    return [line for line in (proc.stdout + proc.stderr).splitlines() if "group" in line] or [proc.stderr]


def _all_queries(d: Dashboard, name: str) -> list[tuple[str, str]]:
    out = [(f"{name} {where(p, t)}", _lint_expand(t["expr"], d)) for p, t in targets(d)]
    for v in variables(d):
        m = LABEL_VALUES.match(v.get("query") or "")
        if v.get("type") == "query" and m:
            out.append((f"{name} variable {v['name']}", _lint_expand(m.group(2), d)))
    return out


@pytest.mark.prom
def test_target_promql_rule(tmp_path: Path):
    """target-promql-rule and the PromQL half of template-label-promql-rule, by promtool's parser."""
    exprs = [q for name, d in DASHBOARDS.items() for q in _all_queries(d, name)]
    assert len(exprs) > 40
    errors = _promtool_errors(exprs, tmp_path)
    assert not errors, "\n".join(errors)


@pytest.mark.prom
def test_target_promql_rule_fails_on_bad_promql(tmp_path: Path):
    d = copy.deepcopy(DASHBOARDS["kvwatt-overview.json"])
    _replace_expr(d, "Regime now", "max by (server) (", "max by (server) ((")
    errors = _promtool_errors(_all_queries(d, "mutated"), tmp_path)
    assert len(errors) == 1 and "Regime now" in errors[0], errors


# --- generator: --check --------------------------------------------------------------------------------

def _generate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(GENERATOR), *args], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)


def test_committed_json_is_up_to_date():
    proc = _generate("--check")
    assert proc.returncode == 0, "dashboards are stale; run python dashboards/generate.py\n" + proc.stderr


def test_check_fails_when_json_is_stale(tmp_path: Path):
    for name in EXPECTED_UIDS:
        shutil.copy(DASHBOARD_DIR / name, tmp_path / name)
    assert _generate("--check", "--dir", str(tmp_path)).returncode == 0
    path = tmp_path / "kvwatt-experiment.json"
    path.write_text(path.read_text().replace('"editable": false', '"editable": true'))
    proc = _generate("--check", "--dir", str(tmp_path))
    assert proc.returncode == 1 and "kvwatt-experiment.json" in proc.stderr
    path.unlink()
    assert _generate("--check", "--dir", str(tmp_path)).returncode == 1


def test_generator_writes_what_check_accepts(tmp_path: Path):
    assert _generate("--dir", str(tmp_path)).returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(EXPECTED_UIDS)
    assert _generate("--check", "--dir", str(tmp_path)).returncode == 0


def test_generator_refuses_a_series_outside_the_catalogs():
    spec = importlib.util.spec_from_file_location("kvwatt_dashboards_generate", GENERATOR)
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gen  # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(gen)
    finally:
        sys.modules.pop(spec.name, None)
    with pytest.raises(KeyError):
        gen.kv("kvwatt_not_a_series")
    with pytest.raises(KeyError):
        gen.vl("vllm:num_preemptions")  # llm-d's bug: the wire name is vllm:num_preemptions_total
    with pytest.raises(ValueError):
        gen.kv("kvwatt_gpu_power_watts", scope="gpu")  # no such label


# --- provisioning --------------------------------------------------------------------------------------

PROVISIONING = DASHBOARD_DIR / "provisioning"


def test_datasource_provisioning_matches_the_dashboards():
    doc = yaml.safe_load((PROVISIONING / "datasource.yaml").read_text())
    assert doc["apiVersion"] == 1
    (ds,) = doc["datasources"]
    assert ds["type"] == "prometheus" and ds["access"] == "proxy" and ds["url"].startswith("http")
    for name, d in DASHBOARDS.items():
        current = _var(d, "datasource")["current"]
        assert current["value"] == ds["uid"] and current["text"] == ds["name"], name


def test_dashboard_provider_is_a_read_only_file_provider():
    doc = yaml.safe_load((PROVISIONING / "dashboards.yaml").read_text())
    assert doc["apiVersion"] == 1
    (provider,) = doc["providers"]
    assert provider["type"] == "file"
    assert provider["allowUiUpdates"] is False
    assert provider["options"]["path"].startswith("/")
    readme = (DASHBOARD_DIR / "README.md").read_text()
    assert provider["options"]["path"] in readme, "README must document the mount path"


# --- one configuration (exporter/rules/__init__.py) -----------------------------------------------------------------

@pytest.mark.parametrize("title, rule_key", [
    ("Preemptions per minute", "preemption_onset_per_minute"),
    ("Offload buffer residency", "p99_tool_latency"),
])
def test_reference_lines_are_the_daemons_defaults(title: str, rule_key: str):
    """A dashed reference line is the rule's default in exporter/rules/__init__.py, and its description says so."""
    from exporter import rules
    default = rules.RULES[rule_key].default
    panel = _panel(DASHBOARDS["kvwatt-overview.json"], title)
    steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [s["value"] for s in steps if s["value"] is not None] == [default]
    assert f"{default:g}" in panel["description"]
