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
from exporter.vllm_names import WIRE_SERIES
from tests.support.grafana import (DASHBOARD_DIR, QUERY_PANEL_TYPES, ROOT, Selector, expand, load_dashboards,
                                   panels, ranges, referenced_variables, selectors, targets, variables)

Dashboard = dict[str, Any]
Rule = Callable[[Dashboard], list[str]]

GENERATOR = DASHBOARD_DIR / "generate.py"
EXPECTED_UIDS = {"kvwatt-overview.json": "kvwatt-overview", "kvwatt-experiment.json": "kvwatt-experiment"}
DS_UIDS = {"$datasource", "${datasource}"}
SERVER_VARS = {"server", "server_on", "server_off"}
GRAFANA_GLOBALS = {"__rate_interval", "__interval", "__range", "__all"}
# Labels vLLM puts on its series (vllm-metrics.md) plus what Prometheus adds.
VLLM_LABELS = {"job", "instance", "model_name", "engine", "le", "source", "reason", "transfer_type", "tier"}
SCRAPE_LABELS = {"job", "instance"}
# ALERTS carry the labels their alert rule keeps, not the scrape's: no job matcher is required (a rule that
# aggregates job away would otherwise vanish from the panel). Documented in dashboards/README.md.
JOB_EXEMPT = {"ALERTS"}
# Grafana unit ids (the linter's list, grafana-data valueFormats categories), restricted to families we may use.
VALID_UNITS = {
    "none", "string", "short", "percent", "percentunit", "sci", "locale",
    "bytes", "decbytes", "bits", "decbits", "kbytes", "mbytes", "gbytes",
    "pps", "binBps", "Bps", "binbps", "bps", "KiBs", "KBs", "MiBs", "MBs", "GiBs", "GBs",
    "watt", "kwatt", "mwatt", "watth", "kwatth", "joule", "ev", "volt", "amp",
    "flops", "mflops", "gflops", "tflops", "pflops",
    "hertz", "ns", "µs", "ms", "s", "m", "h", "d", "dtdurationms", "dtdurations",
    "cps", "ops", "reqps", "rps", "wps", "iops", "cpm", "opm", "rpm", "wpm",
    "bool", "bool_yes_no", "bool_on_off", "celsius",
}
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
    """template-instance-rule (instance of the vLLM series)."""
    return _check_template(d, "instance")


def template_server_model_rule(d: Dashboard) -> list[str]:
    """kvwatt convention: `server` and `model_name` follow the same rules as `job`."""
    return _check_template(d, "server") + _check_template(d, "model_name")


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


def panel_units_rule(d: Dashboard) -> list[str]:
    """panel-units-rule, for every panel with queries (stricter: state-timeline too)."""
    errors = []
    for p in query_panels(d):
        unit = ((p.get("fieldConfig") or {}).get("defaults") or {}).get("unit", "")
        if unit not in VALID_UNITS:
            errors.append(f"{where(p)} has no or invalid units defined: {unit!r}")
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
    """target-job-rule: every selector has job=~"$job" (ALERTS exempt, see JOB_EXEMPT)."""
    return [f"{where(p, t)}: selector {s.name} has no job=~\"$job\" matcher"
            for p, t in targets(d) for s in selectors(t["expr"])
            if s.name not in JOB_EXEMPT and not _matcher_is(s, "job", "$job")]


def target_labels_rule(d: Dashboard) -> list[str]:
    """kvwatt: each selector filters by the variables its series' labels allow and by no label it lacks.

    kvwatt_* (labels from exporter.catalog): server=~"$server" (or $server_on/$server_off) when it has a
    server label, window=~"$window" when it has a window label. vllm:* : model_name=~"$model_name" and
    instance=~"$instance"; never server.
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
        if "server" in labels:
            m = s.matcher("server")
            if m is None or m.op != "=~" or not referenced_variables(m.value) & SERVER_VARS:
                errors.append(f"{name} is not filtered by a server variable")
        if "window" in labels and not _matcher_is(s, "window", "$window"):
            errors.append(f'{name} is not filtered by window=~"$window"')
        return errors
    if name in WIRE_SERIES:
        errors = [f"{name} has no label {lab!r}" for lab in sorted(used - VLLM_LABELS)]
        errors += [f'{name} is not filtered by {lab}=~"${lab}"' for lab in ("model_name", "instance")
                   if not _matcher_is(s, lab, f"${lab}")]
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
    "template-server-model-rule": template_server_model_rule,
    "template-label-promql-rule": template_label_promql_rule,
    "template-on-time-change-reload-rule": template_on_time_change_reload_rule,
    "template-variables-used-rule": template_variables_used_rule,
    "panel-datasource-rule": panel_datasource_rule,
    "panel-title-description-rule": panel_title_description_rule,
    "panel-units-rule": panel_units_rule,
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
    ("template-server-model-rule", "server allValue", lambda d: _set(_var(d, "server"), "allValue", ".*")),
    ("template-server-model-rule", "model_name missing",
     lambda d: d["templating"]["list"].remove(_var(d, "model_name"))),
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
    ("panel-no-targets-rule", "no targets", lambda d: _set(_panel(d, "Regime now"), "targets", [])),
    ("target-rate-interval-rule", "fixed range",
     lambda d: _replace_expr(d, "Time to first token", "[$__rate_interval]", "[5m]")),
    ("target-job-rule", "no job matcher", lambda d: _replace_expr(d, "Regime now", 'job=~"$job", ', "")),
    ("target-job-rule", "job equality", lambda d: _replace_expr(d, "Regime now", 'job=~"$job"', 'job="$job"')),
    ("target-labels-rule", "server on a vLLM series",
     lambda d: _replace_expr(d, "Time to first token", 'model_name=~"$model_name"', 'server=~"$server"')),
    ("target-labels-rule", "model_name on a kvwatt series",
     lambda d: _replace_expr(d, "Regime now", 'server=~"$server"', 'model_name=~"$model_name"')),
    ("target-labels-rule", "no window",
     lambda d: _replace_expr(d, "Regime now", ', window=~"$window"', "")),
    ("series-exist-rule", "llm-d's vllm:num_preemptions",
     lambda d: _replace_expr(d, "Preemptions per minute", "kvwatt_preemptions_per_minute", "vllm:num_preemptions")),
    ("series-exist-rule", "unknown kvwatt series",
     lambda d: _replace_expr(d, "Regime now", "kvwatt_kv_pressure_above_threshold", "kvwatt_regime")),
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
