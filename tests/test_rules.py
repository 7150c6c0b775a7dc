"""exporter/rules/__init__.py is the one definition of every shared threshold, window and rate: the daemon's Config, the
alert settings, the dashboards and the lab read it, and exporter/tooling/rulecopies.py (each generator's --check)
refuses a literal copy of a rule in the modules that use them."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from exporter import config, rules
from exporter.tooling import rulecopies

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
    assert (ALERTS_GEN.SETTINGS["collapse_throughput_drop_ratio"].default == daemon.collapse_throughput_drop_ratio
            == 0.35)
    assert ALERTS_GEN.SETTINGS["collapse_power_near_idle_ratio"].default == daemon.collapse_power_near_idle_ratio == 2.0
    assert ALERTS_GEN.SETTINGS["kvwatt_window"].default == config.format_window(max(config.Config().windows_seconds))


def test_lab_plan_and_derive_read_the_rules():
    from kvwatt_lab.experiment import plan

    from exporter.derive import collapse, threshold
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
    for d in ("alerts", "dashboards", "deploy/fleet", "exporter", "lab/kvwatt_lab/experiment"):
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


# --- method constants (rules.METHODS, issue 40 item 8) -------------------------------------------------------

def test_method_constants_are_read_not_retyped():
    """Each method constant is defined once (rules.METHODS, outside the configuration's RULES) and the modules
    that state it read it: the one coverage rule for the onset, the tax and the evidence windows."""
    from exporter.derive import residency
    assert not set(rules.METHODS) & set(rules.RULES)
    for key, m in rules.METHODS.items():
        assert m.key == key and m.unit and m.meaning and m.words and m.section.startswith("s"), key
    assert rules.SUSTAINED_MIN_COVERED.default == 0.8 and rules.REPEAT_MIN_COVERED.default == 0.9
    for gone in ("PRESSURE_EVICTIONS_PER_PROMPT_BLOCK", "LOW_PRESSURE_EVICTIONS_PER_PROMPT_BLOCK", "MIN_REUSE_SAMPLES"):
        assert not hasattr(residency, gone), gone


@pytest.mark.parametrize("source, rule", [
    ("MIN_COVERAGE_RATIO = 0.9  # a window counts when samples cover 90 % of it", "repeat_min_covered"),
    ("MIN_COVERED = 0.8", "sustained_min_covered"),
    ("MIN_COVERED_SHARE = 0.8", "sustained_min_covered"),
    ("if per_minute is None or covered < 0.8 * window_seconds: pass", "sustained_min_covered"),
    ("CAPACITY_SUSTAINED = 0.5", "capacity_sustained"),
    ("ok = (w.requests_waiting_for_kv_capacity_share or 0.0) >= 0.5", "capacity_sustained"),
    ("PRESSURE_EVICTIONS_PER_PROMPT_BLOCK = 0.25", "pressure_evictions_per_prompt_block"),
    ("if ratio <= 0.1 and low_evictions_per_prompt_block: pass", None),  # the name is compared, not the number
    ("MIN_REUSE_SAMPLES = 10", "min_reuse_gaps"),
])
def test_a_literal_copy_of_a_method_constant_is_found(source, rule):
    found = rulecopies.copies_in(source)
    assert [c.rule for c in found] == ([rule] if rule else [])


@pytest.mark.parametrize("source", [
    "MIN_COVERAGE_RATIO = 0.5", "MIN_BELOW_COVERAGE = 0.5", "recovered = 0.8", "covered_seconds = 0.0",
    "DEFAULT_BANDS = ((0.0, 0.8), (0.8, 0.9), (0.9, 0.95))", "BEFORE_REUSE_SHARE = 0.5",
    "MIN_COVERAGE_RATIO = rules.REPEAT_MIN_COVERED.default",
])
def test_not_a_copy_of_a_method_constant(source):
    assert rulecopies.copies_in(source) == []


@pytest.mark.parametrize("text, rule", [
    ('help="an evidence window at least 80 % covered"', "sustained_min_covered"),
    ('help="windows whose samples cover 90% of them"', "repeat_min_covered"),
    ('help="in most samples (>= 0.5) it is known pressure"', "capacity_sustained"),
    ('help="1 = pressure (evictions per prompt block >= 0.25)"', "pressure_evictions_per_prompt_block"),
    ('help=f"default {rules.BUFFER_HEADROOM.default:g}, above 0.35 of it"', "collapse_throughput_drop_ratio"),
])
def test_a_ratio_typed_in_a_catalog_text_is_found(text, rule):
    found = rulecopies.text_copies_in(text)
    assert [c.rule for c in found] == [rule]
    assert f"rules.{rulecopies._python_name(rule)}.default" in str(found[0])


@pytest.mark.parametrize("text", [
    'help="vLLM 0.20+; sglang 0.9.2 renamed it"', 'help="0.26 = 26 % less energy per token"',
    'help="the ~95 % order-statistic interval"', 'help=f"(>= {rules.CAPACITY_SUSTAINED.default:g})"',
    'help=f"{x:.1f} s"', 'help="vLLM < 0.16: estimated"',
])
def test_not_a_ratio_copy_in_a_text(text):
    assert rulecopies.text_copies_in(text) == []


def test_the_scan_covers_the_pressure_learners_and_the_catalog_texts():
    scanned = {str(p.relative_to(REPO)) for p in rulecopies.scanned_files(REPO)}
    texts = {str(p.relative_to(REPO)) for p in rulecopies.scanned_files(REPO, rulecopies.TEXTS_SCANNED)}
    assert "exporter/model/pressure/regime_signs.py" in scanned and "exporter/catalog/pressure.py" in texts


@pytest.mark.parametrize("path, old, new", [
    # the evidence window's coverage typed again in the learner
    ("exporter/model/pressure/learner.py", "agg.covered_seconds < rules.SUSTAINED_MIN_COVERED.default * self.width",
     "agg.covered_seconds < 0.8 * self.width"),
    # the residency level typed again in its metric's HELP
    ("exporter/catalog/pressure.py", 'f"s11): >= {rules.PRESSURE_EVICTIONS_PER_PROMPT_BLOCK.default:g} with',
     '"s11): >= 0.25 with'),
    # the capacity cut-off typed again in the advice
    ("exporter/model/advice.py", ">= rules.CAPACITY_SUSTAINED.default), None)", ">= 0.5), None)"),
])
def test_a_planted_copy_of_a_method_constant_is_found_in_the_tree(tmp_path, path, old, new):
    shutil.copytree(REPO / "exporter", tmp_path / "exporter", ignore=shutil.ignore_patterns("__pycache__"))
    assert rulecopies.find_copies(tmp_path) == []
    _reintroduce(tmp_path / path, old, new)
    found = rulecopies.find_copies(tmp_path)
    assert [c.path for c in found] == [path], [str(c) for c in found]
