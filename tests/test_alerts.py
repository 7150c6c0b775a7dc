"""kvwatt's alert and recording rules (alerts/), offline: promtool, amtool, the generator, the runbook.

- ``promtool check rules`` on both generated files and ``promtool test rules`` on every tests/alerts/*.yaml
  (each alert fires on its signature, stays silent on near misses and healthy series, is pending before its
  ``for:``; annotations exact; recording rules by promql_expr_test);
- every series a rule or a unit test names is one vLLM puts on the wire (exporter.sources.vllm_names.WIRE_SERIES),
  one kvwatt exports (exporter.catalog), one of our recording rules, or ``up``;
- ``amtool check-config`` and ``amtool config routes test`` for the receiver of every alert;
- ``alerts/generate.py --check`` and its settings; the runbook has a section for every alert and mentions
  every setting.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from exporter.catalog import BY_NAME
from exporter.sources.vllm_names import WIRE_SERIES
from tests.support.prom import missing_binaries

REPO = Path(__file__).resolve().parents[1]
ALERTS = REPO / "alerts"
RULES_PATH = ALERTS / "kvwatt-rules.yaml"
PROMRULE_PATH = ALERTS / "kvwatt-prometheusrule.yaml"
AM_PATH = ALERTS / "alertmanager.yml"
RUNBOOK = ALERTS / "RUNBOOK.md"
UNIT_TESTS = sorted((REPO / "tests" / "alerts").glob("*.yaml"))
CRD_SCHEMA = REPO / "tests" / "data" / "prometheus-operator" / "prometheusrule-v1.json"


def _load_generator():
    spec = importlib.util.spec_from_file_location("kvwatt_alerts_generate", ALERTS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


GEN = _load_generator()
RULES = yaml.safe_load(RULES_PATH.read_text(encoding="utf-8"))
ALERT_RULES = [r for g in RULES["groups"] for r in g["rules"] if "alert" in r]
RECORDING_RULES = [r for g in RULES["groups"] for r in g["rules"] if "record" in r]
RECORDED = {r["record"] for r in RECORDING_RULES}
AM = yaml.safe_load(AM_PATH.read_text(encoding="utf-8"))


def run(*cmd: str | Path, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=120)


def need(tool: str) -> None:
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} not installed ({', '.join(missing_binaries())} missing): scripts/install-deps.sh")


# --- series names ------------------------------------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_SELECTOR_LABELS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NAME = re.compile(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])(?!\s*\()")
_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "offset",
             "bool", "inf", "nan", "atan2"}
STANDARD = {"up"}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (not functions, keywords, labels, strings or durations)."""
    text = _STRING.sub('""', expr)
    text = _SELECTOR_LABELS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    return {n for n in _NAME.findall(text) if n.lower() not in _KEYWORDS}


def kvwatt_selector_labels(expr: str) -> list[tuple[str, str]]:
    """(series, label) for every label matcher on a kvwatt_ series."""
    out = []
    for name, body in re.findall(r"\b(kvwatt_\w+)\s*\{([^}]*)\}", expr):
        out += [(name, label) for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", _STRING.sub('""', body))]
    return out


def unknown_series(expr: str, known: set[str]) -> set[str]:
    return metric_names(expr) - known


KNOWN_INPUTS = set(WIRE_SERIES) | set(BY_NAME) | STANDARD
KNOWN = KNOWN_INPUTS | RECORDED


def test_the_name_check_catches_the_llm_d_bug():
    """The check must not pass vacuously: the series llm-d alerted on does not exist; the real one does."""
    assert unknown_series("sum by (server) (rate(vllm:num_preemptions[5m])) > 0", KNOWN) == {"vllm:num_preemptions"}
    assert unknown_series("rate(vllm:num_preemptions_total[5m])", KNOWN) == set()
    assert metric_names('label_replace(max by (server) (kvwatt_x{a="b c"}) == 1, "d", "e", "", "") '
                        "or on (server) group_left () :f:g offset 1h") == {"kvwatt_x", ":f:g"}


@pytest.mark.parametrize("rule", RECORDING_RULES + ALERT_RULES, ids=lambda r: r.get("record") or r["alert"])
def test_rule_names_only_exported_series(rule):
    names = metric_names(rule["expr"])
    assert names or rule.get("alert") == "Watchdog", "the parser found no series at all"
    assert not names - KNOWN, f"not exported by vLLM or kvwatt, nor recorded here: {sorted(names - KNOWN)}"


@pytest.mark.parametrize("rule", RECORDING_RULES + ALERT_RULES, ids=lambda r: r.get("record") or r["alert"])
def test_kvwatt_selectors_use_catalog_labels(rule):
    for name, label in kvwatt_selector_labels(rule["expr"]):
        allowed = set(BY_NAME[name].labels) | {"job", "instance"}
        assert label in allowed, f"{name} has no label {label!r} (catalog: {sorted(allowed)})"


@pytest.mark.parametrize("path", UNIT_TESTS, ids=lambda p: p.name)
def test_unit_tests_use_real_series(path):
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    inputs = {s["series"].split("{")[0] for t in doc["tests"] for s in t.get("input_series", [])}
    assert not inputs - KNOWN_INPUTS, f"input series neither vLLM nor kvwatt export: {sorted(inputs - KNOWN_INPUTS)}"


# --- promtool ----------------------------------------------------------------------------------------------

@pytest.mark.prom
def test_promtool_check_rules():
    need("promtool")
    out = run("promtool", "check", "rules", RULES_PATH)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(RECORDING_RULES) + len(ALERT_RULES)} rules found" in out.stdout


@pytest.mark.prom
def test_promtool_check_rules_of_the_prometheusrule(tmp_path):
    need("promtool")
    spec = yaml.safe_load(PROMRULE_PATH.read_text(encoding="utf-8"))["spec"]
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    out = run("promtool", "check", "rules", tmp_path / "spec.yaml")
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.prom
@pytest.mark.parametrize("path", UNIT_TESTS, ids=lambda p: p.name)
def test_promtool_unit_tests(path):
    need("promtool")
    out = run("promtool", "test", "rules", path)
    assert out.returncode == 0, out.stdout + out.stderr


def _alert_tests() -> dict[str, list[dict]]:
    by_alert: dict[str, list[dict]] = {}
    for path in UNIT_TESTS:
        for group in yaml.safe_load(path.read_text(encoding="utf-8"))["tests"]:
            for case in group.get("alert_rule_test", []):
                by_alert.setdefault(case["alertname"], []).append(case)
    return by_alert


def _duration_seconds(text: str) -> int:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    return int(sum(int(n) * units[u] for n, u in re.findall(r"(\d+)(ms|s|m|h|d|w|y)", text)))


@pytest.mark.parametrize("rule", ALERT_RULES, ids=lambda r: r["alert"])
def test_every_alert_is_unit_tested_firing_and_pending(rule):
    """A firing case with exact annotations, and an earlier silent case in the same test (pending or before)."""
    cases = _alert_tests().get(rule["alert"], [])
    firing = [c for c in cases if c["exp_alerts"]]
    assert firing, f"no unit test expects {rule['alert']} to fire"
    for c in firing:
        for a in c["exp_alerts"]:
            assert set(a["exp_annotations"]) == {"summary", "description", "runbook_url"}
    first = min(_duration_seconds(c["eval_time"]) for c in firing)
    silent_before = [c for c in cases if not c["exp_alerts"] and _duration_seconds(c["eval_time"]) < first]
    assert silent_before, f"no unit test shows {rule['alert']} silent (pending) before it fires"


def test_every_recording_rule_is_checked_by_promql_expr_test():
    exprs = " ".join(t["expr"] for path in UNIT_TESTS
                     for g in yaml.safe_load(path.read_text(encoding="utf-8"))["tests"]
                     for t in g.get("promql_expr_test", []))
    unchecked = RECORDED - metric_names(exprs)
    assert not unchecked, f"recording rules without a promql_expr_test: {sorted(unchecked)}"


# --- conventions -------------------------------------------------------------------------------------------

SEVERITIES = {"critical", "warning", "info", "none"}


@pytest.mark.parametrize("rule", ALERT_RULES, ids=lambda r: r["alert"])
def test_alert_conventions(rule):
    assert re.fullmatch(r"(KV|Kvwatt)[A-Z][A-Za-z]+|Watchdog", rule["alert"])
    assert rule["labels"]["severity"] in SEVERITIES
    assert rule.get("for"), "every alert has a for:"
    ann = rule["annotations"]
    assert "{{" not in ann["summary"] and ann["summary"][0].isupper() and ann["summary"].endswith(".")
    assert "{{" in ann["description"] and "$value" in ann["description"]
    if rule["alert"] != "Watchdog":
        assert "$labels." in ann["description"]


def github_anchors(markdown: str) -> set[str]:
    anchors = set()
    for heading in re.findall(r"^#+\s+(.+?)\s*$", markdown, flags=re.M):
        anchors.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("rule", ALERT_RULES, ids=lambda r: r["alert"])
def test_runbook_url_points_at_a_runbook_section(rule):
    """The default link: the /runbook of a kvwatt target Prometheus scrapes, at the alert's own section."""
    url = rule["annotations"]["runbook_url"]
    m = re.search(r"\}\}http://\{\{ \.Labels\.instance \}\}/runbook#([^{}]+)\{\{ end \}\}", url)
    assert m, url
    assert m.group(1) == GEN.anchor(rule["alert"])
    assert m.group(1) in github_anchors(RUNBOOK.read_text(encoding="utf-8"))


@pytest.mark.parametrize("alert", [a.name for a in GEN.ALERTS])
def test_runbook_section_covers_meaning_confirmation_action_false_alarms(alert):
    text = RUNBOOK.read_text(encoding="utf-8")
    section = re.search(rf"^## {alert}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert section, f"no '## {alert}' section"
    for part in ("Meaning", "Confirm", "Action", "False alarms"):
        assert re.search(rf"^\*\*{part}", section.group(1), flags=re.M), f"{alert}: no **{part}** paragraph"


def test_runbook_justifies_every_setting():
    text = RUNBOOK.read_text(encoding="utf-8")
    missing = [k for k in GEN.SETTINGS if f"`{k}`" not in text]
    assert not missing, f"settings without a justification in RUNBOOK.md: {missing}"


def test_recording_rule_names_are_level_metric_operations():
    for name in RECORDED:
        assert re.fullmatch(r"[a-z_]*:[a-z0-9_]+:[a-z0-9_]+", name), name


def test_prometheusrule_has_the_same_groups_and_a_valid_schema():
    doc = yaml.safe_load(PROMRULE_PATH.read_text(encoding="utf-8"))
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] == "PrometheusRule"
    assert doc["spec"] == RULES
    schema = json.loads(CRD_SCHEMA.read_text(encoding="utf-8"))
    schema.pop("x-source", None)
    errors = [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(doc)]
    assert not errors, errors


# --- the generator -----------------------------------------------------------------------------------------

def generate(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return run(sys.executable, ALERTS / "generate.py", *args)


def test_committed_files_are_current():
    out = generate("--check")
    assert out.returncode == 0, out.stderr


def test_check_fails_on_a_stale_or_missing_file(tmp_path):
    assert generate("--out-dir", tmp_path).returncode == 0
    assert generate("--check", "--out-dir", tmp_path).returncode == 0
    rules = tmp_path / GEN.RULES_FILE
    rules.write_text(rules.read_text().replace("0.9", "0.8", 1))
    out = generate("--check", "--out-dir", tmp_path)
    assert out.returncode == 1 and GEN.RULES_FILE in out.stderr
    rules.unlink()
    (tmp_path / GEN.PROMETHEUSRULE_FILE).write_text("stale\n")
    out = generate("--check", "--out-dir", tmp_path)
    assert out.returncode == 1
    assert GEN.RULES_FILE in out.stderr and GEN.PROMETHEUSRULE_FILE in out.stderr


def _alert(doc: dict, name: str) -> dict:
    return next(r for g in doc["groups"] for r in g["rules"] if r.get("alert") == name)


@pytest.mark.prom
def test_settings_change_thresholds_windows_and_for(tmp_path):
    overrides = tmp_path / "site.yaml"
    overrides.write_text("kv_pressure_threshold: 0.85\nwindow: 2m\n")
    out = generate("--overrides", overrides, "--set", "collapse_for=30s", "--set", "kvwatt_window=1m",
                   "--out-dir", tmp_path)
    assert out.returncode == 0, out.stderr
    doc = yaml.safe_load((tmp_path / GEN.RULES_FILE).read_text())
    pressure = _alert(doc, "KVPressureAboveThreshold")
    assert "> 0.85" in pressure["expr"] and "> 0.9" not in pressure["expr"]
    assert "above the 85% threshold" in pressure["annotations"]["description"]
    assert _alert(doc, "KVOffloadCollapse")["for"] == "30s"
    records = {r["record"]: r["expr"] for g in doc["groups"] for r in g["rules"] if "record" in r}
    assert "rate(vllm:generation_tokens_total[2m])" in records["server:vllm_generation_tokens:rate2m"]
    assert 'window="1m"' in records["server:kvwatt_generation_tokens:rate_window1m"]
    if shutil.which("promtool"):
        check = run("promtool", "check", "rules", tmp_path / GEN.RULES_FILE)
        assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("arg, words", [
    ("kv_pressure_treshold=0.8", "unknown setting"),
    ("kv_pressure_threshold=1.5", "out of range"),
    ("collapse_for=5 minutes", "duration"),
    ("node_label=no-dash", "label name"),
    ("window", "KEY=VALUE"),
])
def test_bad_settings_exit_2_with_one_line(tmp_path, arg, words):
    out = generate("--set", arg, "--out-dir", tmp_path)
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1 and words in out.stderr
    assert not list(tmp_path.iterdir()), "nothing is written on bad input"


# --- Alertmanager ------------------------------------------------------------------------------------------

@pytest.mark.prom
def test_amtool_check_config():
    need("amtool")
    out = run("amtool", "check-config", AM_PATH)
    assert out.returncode == 0, out.stdout + out.stderr


def expected_receiver(rule: dict) -> str:
    """The routing this project promises: Watchdog -> heartbeat, critical pages, everything else does not."""
    if rule["alert"] == "Watchdog":
        return "heartbeat"
    return "pagerduty-critical" if rule["labels"]["severity"] == "critical" else "kvwatt-warnings"


@pytest.mark.prom
@pytest.mark.parametrize("rule", ALERT_RULES, ids=lambda r: r["alert"])
def test_amtool_routes_each_alert_to_its_receiver(rule):
    need("amtool")
    labels = {"alertname": rule["alert"], "server": "a", **rule["labels"]}
    out = run("amtool", "config", "routes", "test", f"--config.file={AM_PATH}",
              f"--verify.receivers={expected_receiver(rule)}", *(f"{k}={v}" for k, v in labels.items()))
    assert out.returncode == 0, f"{rule['alert']} routes to {out.stdout.strip()!r}"


def test_pagerduty_receivers_read_the_key_from_a_file():
    text = AM_PATH.read_text(encoding="utf-8")
    assert not re.search(r"^\s*(routing_key|service_key)\s*:", text, flags=re.M), "a key inline in the YAML"
    configs = [c for r in AM["receivers"] for c in r.get("pagerduty_configs", [])]
    assert configs and all(c.get("routing_key_file") for c in configs)
    for c in configs:
        for sev in ("critical", "error", "warning", "info"):
            assert sev in c["severity"]
        assert {"class", "component", "group", "details", "links"} <= set(c)
        assert any("runbook_url" in link["href"] for link in c["links"])
        assert c.get("send_resolved") is True


def test_grouping_and_inhibition():
    assert AM["route"]["group_by"] == ["alertname", "server"]
    (inhibit,) = AM["inhibit_rules"]
    assert inhibit["source_matchers"] == ['alertname="KVOffloadCollapse"']
    assert inhibit["equal"] == ["server"]
    collapse = next(r for r in ALERT_RULES if r["alert"] == "KVOffloadCollapse")
    assert collapse["labels"]["severity"] == "critical"
    target = re.fullmatch(r'severity=~"(.+)"', inhibit["target_matchers"][0]).group(1).split("|")
    warnings = {r["labels"]["severity"] for r in ALERT_RULES} - {"critical", "none"}
    assert warnings <= set(target), "some non-critical alert would not be inhibited"


# --- one configuration (exporter/rules/__init__.py) -----------------------------------------------------------------

def test_fallbacks_use_the_daemons_thresholds():
    """The PromQL fallbacks compare with the daemon's defaults: one definition of collapse (methods.md s5),
    of the regime threshold (s3) and of the onset rate (s3)."""
    from exporter import rules
    collapse = _alert(RULES, "KVOffloadCollapse")["expr"]
    assert f"< {rules.COLLAPSE_THROUGHPUT_DROP_RATIO.default:g}\n" in collapse and "< 0.2\n" not in collapse
    assert f"< {rules.COLLAPSE_POWER_NEAR_IDLE_RATIO.default:g})" in collapse
    pressure = _alert(RULES, "KVPressureAboveThreshold")["expr"]
    assert f"> {rules.KV_PRESSURE_THRESHOLD.default:g}\n" in pressure
    assert f">= {rules.PREEMPTION_ONSET_PER_MINUTE.default:g}\n" in _alert(RULES, "KVPreemptionOnset")["expr"]


@pytest.mark.parametrize("alert, verdict", [
    ("KVPressureAboveThreshold", "kvwatt_kv_pressure_regime_above{window=\"5m\"}) == 1"),
    ("KVPreemptionOnset", "kvwatt_preemption_onset{window=\"5m\"}) == 1"),
    ("KVRecomputeTaxHigh", "kvwatt_recompute_tax_ratio{window=\"5m\"}"),
    ("KVOffloadCollapse", "kvwatt_collapse_signature) == 1"),
])
def test_alerts_read_kvwatts_verdict_and_fall_back_only_where_kvwatt_does_not_watch(alert, verdict):
    expr = _alert(RULES, alert)["expr"]
    assert verdict in expr
    assert "unless on (server) (kvwatt_server_info or " in re.sub(r"\s+", " ", expr)
