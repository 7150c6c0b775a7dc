"""exporter/rules.py is the one definition of every shared threshold, window and rate: the daemon's Config, the
alert settings, the dashboards and the lab read it, and exporter/rulecopies.py (each generator's --check)
refuses a literal copy of a rule in the modules that use them."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from exporter import config, rulecopies, rules

REPO = Path(__file__).resolve().parents[1]


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ALERTS_GEN = _load(REPO / "alerts" / "generate.py", "kvwatt_alerts_generate_rules")


def test_every_rule_says_its_unit_meaning_and_section():
    for key, rule in rules.RULES.items():
        assert rule.key == key and rule.unit and rule.meaning
        assert rule.section.startswith("s"), key  # a docs/methods.md section


def test_config_defaults_are_the_rules():
    cfg = config.Config()
    for rule in rules.RULES.values():
        if rule.key in config.KEYS:
            assert config.KEYS[rule.key][0] == rule.attribute
            assert getattr(cfg, rule.attribute) == rule.default, rule.key


def test_alert_settings_default_to_the_rules():
    shared = {k: rules.RULES[k] for k in ALERTS_GEN.SETTINGS if k in rules.RULES}
    assert set(shared) >= {"kv_pressure_threshold", "preemption_onset_per_minute", "collapse_throughput_drop_ratio",
                           "collapse_power_near_idle_ratio", "recompute_tax_threshold"}
    for key, rule in shared.items():
        assert ALERTS_GEN.SETTINGS[key].default == rule.default, key
    # one collapse (methods.md s5) for the daemon and the alert: 0.35 and 2.0, which cover the study's collapsed
    # runs (17-23 % of the output, ~1.4-1.8x idle power), not the daemon's old 0.2 and 1.5, which sat inside them
    daemon = config.Config()
    assert ALERTS_GEN.SETTINGS["collapse_throughput_drop_ratio"].default == daemon.collapse_throughput_drop_ratio == 0.35
    assert ALERTS_GEN.SETTINGS["collapse_power_near_idle_ratio"].default == daemon.collapse_power_near_idle_ratio == 2.0
    assert ALERTS_GEN.SETTINGS["kvwatt_window"].default == config.format_window(max(config.Config().windows_seconds))


def test_lab_plan_and_derive_read_the_rules():
    from exporter.derive import collapse, threshold
    from kvwatt_lab.experiment import plan
    assert threshold.ONSET_PER_MINUTE == rules.PREEMPTION_ONSET_PER_MINUTE.default
    assert collapse.CollapseThresholds().throughput_drop_ratio == rules.COLLAPSE_THROUGHPUT_DROP_RATIO.default
    assert plan.EnergySpec().min_load_seconds == rules.MIN_LOAD_DURATION.default
    assert "rules.KV_PRESSURE_THRESHOLD.default" in Path(plan.__file__).read_text()


# --- the copy check ----------------------------------------------------------------------------------------

def test_no_module_copies_a_rule():
    assert rulecopies.find_copies() == []


def test_scan_covers_the_generators_derive_and_lab():
    scanned = {str(p.relative_to(REPO)) for p in rulecopies.scanned_files(REPO)}
    assert {"alerts/generate.py", "dashboards/generate.py", "exporter/config/schema.py", "exporter/config/settings.py",
            "exporter/derive/threshold.py",
            "exporter/derive/collapse.py", "lab/kvwatt_lab/experiment/plan.py"} <= scanned


@pytest.mark.parametrize("source, rule", [
    ('SETTINGS = {"collapse_throughput_drop_ratio": Setting(0.35, "ratio", "fallback")}',
     "collapse_throughput_drop_ratio"),
    ('SETTINGS = {"kv_pressure_threshold": Setting(0.9, "ratio", "p95 above this")}', "kv_pressure_threshold"),
    ("kv_pressure_threshold_ratio: float = 0.90", "kv_pressure_threshold"),
    ('threshold = values.ratio(data.get("kv_pressure_threshold", 0.90), "kv_pressure_threshold")',
     "kv_pressure_threshold"),
    ("ONSET_PER_MINUTE = 0.5", "preemption_onset_per_minute"),
    ("def f(p, onset_per_minute=0.5): pass", "preemption_onset_per_minute"),
    ("Panel(w=6, threshold_line=0.5)", "preemption_onset_per_minute"),
    ("power_near_idle_ratio: float = 2.0", "collapse_power_near_idle_ratio"),
    ("if share > 0 and recompute_tax_threshold > 0.1: pass", "recompute_tax_threshold"),
])
def test_a_literal_copy_is_found(source, rule):
    found = rulecopies.copies_in(source)
    assert [c.rule for c in found] == [rule]


@pytest.mark.parametrize("source", [
    "threshold_line=0", "QUANTILES = (0.5, 0.99)", "per_minute = per_second * 60.0",
    "if tool_latency_seconds > 0: pass",
    "x = rules.KV_PRESSURE_THRESHOLD.default", "MIN_COVERAGE_RATIO = 0.5", "windows_seconds[0]",
])
def test_not_a_copy(source):
    assert rulecopies.copies_in(source) == []


def _checkout_copy(tmp_path: Path) -> Path:
    """The generators, their outputs and the scanned modules in a scratch tree (the generators import exporter
    from the directory above them)."""
    ignore = shutil.ignore_patterns("__pycache__")
    for d in ("alerts", "dashboards", "exporter", "lab/kvwatt_lab/experiment"):
        shutil.copytree(REPO / d, tmp_path / d, ignore=ignore)
    return tmp_path


def _reintroduce(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new), encoding="utf-8")


@pytest.mark.parametrize("generator", ["alerts/generate.py", "dashboards/generate.py"])
@pytest.mark.parametrize("path, old, new", [
    # a literal copy in the alert settings (here the daemon's old 0.2)
    ("alerts/generate.py", '"collapse_throughput_drop_ratio": shared(rules.COLLAPSE_THROUGHPUT_DROP_RATIO, "ratio")',
     '"collapse_throughput_drop_ratio": Setting(0.2, "ratio", "fallback: collapsed below this share")'),
    # 0.9 for the pressure threshold, in the lab's plan default
    ("lab/kvwatt_lab/experiment/plan.py", 'data.get("kv_pressure_threshold", rules.KV_PRESSURE_THRESHOLD.default)',
     'data.get("kv_pressure_threshold", 0.9)'),
    # ... and in the daemon's Config
    ("exporter/config/schema.py", "kv_pressure_threshold_ratio: float = rules.KV_PRESSURE_THRESHOLD.default",
     "kv_pressure_threshold_ratio: float = 0.9"),
])
def test_generator_check_fails_on_a_reintroduced_copy(tmp_path, generator, path, old, new):
    root = _checkout_copy(tmp_path)
    check = [sys.executable, str(root / generator), "--check"]
    before = subprocess.run(check, capture_output=True, text=True, timeout=120, cwd=root)
    assert before.returncode == 0, before.stderr
    _reintroduce(root / path, old, new)
    after = subprocess.run(check, capture_output=True, text=True, timeout=120, cwd=root)
    assert after.returncode == 1
    assert f"{path}:" in after.stderr and "literal copy of rule" in after.stderr
