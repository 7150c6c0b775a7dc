"""The README's configuration and metric reference stay in step with the code."""

import re

from exporter import catalog, config, rules
from exporter.tooling import readme_tables
from tests.conftest import REPO


def test_readme_reference_sections_are_current():
    readme = (REPO / "README.md").read_text()
    assert readme_tables.render(readme) == readme, "run: python -m exporter.tooling.readme_tables --write"


def test_every_config_key_is_documented_and_nothing_else():
    # each key documented once: a shared rule in exporter/rules/__init__.py, any other key in CONFIG_DOCS
    # (a rule may be the alerts' only, e.g. recompute_tax_threshold: not a configuration key)
    assert set(readme_tables.CONFIG_DOCS) | (set(rules.RULES) & set(config.KEYS)) == set(config.KEYS)
    assert set(readme_tables.CONFIG_DOCS) <= set(config.KEYS)
    assert set(readme_tables.CONFIG_DOCS) & set(rules.RULES) == set()


def test_config_table_defaults_come_from_the_rules(monkeypatch):
    """No default is typed in the table: change a rule's default and the README's row follows."""
    assert readme_tables.config_row("kv_pressure_threshold") == ("`0.9`", rules.KV_PRESSURE_THRESHOLD.meaning)
    assert readme_tables.config_row("collapse_reference_window")[0] == "`10m`"
    assert readme_tables.config_row("windows")[0] == "`[1m, 5m]`"
    monkeypatch.setattr(config.Config, "__init__", _config_init_with(kv_pressure_threshold_ratio=0.85))
    assert readme_tables.config_row("kv_pressure_threshold")[0] == "`0.85`"


def _config_init_with(**kw):
    original = config.Config.__init__

    def init(self, *args, **given):
        original(self, *args, **{**kw, **given})
    return init


def test_every_kvwatt_name_in_the_docs_is_exported():
    names = set()
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        # not inside a recording-rule name (level:metric:operations)
        names |= set(re.findall(r"(?<![:\w])kvwatt_[a-z0-9_]+(?![:\w])", path.read_text()))
    names.discard("kvwatt_lab")  # the lab's Python package (lab/), not a series
    names.discard("kvwatt_link_gib_per_second")  # the lab's offloading tier's key in vLLM's kv_connector_extra_config
    names.discard("kvwatt_disk_gib_per_second")  # the lab's tiered engine's disk model, the same place
    # a prefix of real names is allowed (e.g. "grep kvwatt_source")
    unknown = {n for n in names if n not in catalog.BY_NAME and not any(m.startswith(n + "_") for m in catalog.BY_NAME)}
    assert unknown == set()


def resolve(where: str):
    """exporter.<module>[.<Class>].<function> -> the object (the longest importable module prefix first)."""
    import importlib
    parts = where.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module("exporter." + ".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise AssertionError(f"no module in {where}")


def test_every_cataloged_metric_names_an_existing_function():
    for m in catalog.METRICS:
        for where in m.wheres:
            assert callable(resolve(where)), (m.name, where)
