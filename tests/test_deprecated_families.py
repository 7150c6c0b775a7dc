"""A renamed family is served one release under its old name, marked deprecated in its HELP and in its declaration
(MetricDef.deprecated, kube-state-metrics style); nothing kvwatt ships reads the old name (issue 40 item 6)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from exporter import catalog
from exporter.catalog.declare import MetricDef, deprecation_help, per_window

ROOT = Path(__file__).resolve().parent.parent
DEPRECATED = [m for m in catalog.METRICS if m.deprecated]
SHIPPED = [*ROOT.glob("alerts/*.yaml"), *ROOT.glob("dashboards/*.json"), *ROOT.glob("deploy/**/*.yaml"),
           ROOT / "exporter/serve/web.py", ROOT / "exporter/serve/page.py"]


def test_the_regime_is_served_under_a_name_that_says_what_it_measures():
    old = catalog.get("kvwatt_kv_pressure_above_threshold")
    new = catalog.get("kvwatt_kv_pressure_regime_above")
    assert old.deprecated == new.name and new.deprecated is None
    assert old.help.startswith("Deprecated: use kvwatt_kv_pressure_regime_above; removed in the next release.")
    assert new.computes == old.computes and new.labels == old.labels and new.bounds == old.bounds
    assert new.status.key == "above_threshold"  # /api/status unchanged: the new family owns its key


@pytest.mark.parametrize("m", DEPRECATED, ids=lambda m: m.name)
def test_a_deprecated_family_names_a_live_replacement_in_its_help(m):
    replacement = catalog.get(m.deprecated)
    assert replacement.deprecated is None and replacement.type == m.type and replacement.labels == m.labels
    assert m.help.startswith(deprecation_help(m.deprecated))


def test_a_declaration_cannot_be_deprecated_without_saying_so_in_its_help():
    with pytest.raises(ValueError, match="Deprecated: use kvwatt_x; removed in the next release"):
        MetricDef(name="kvwatt_y", type="gauge", labels=("server", "window"), help="The y.", computes="derive.x",
                  section="s", fill=per_window(lambda w: None), deprecated="kvwatt_x")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_shipped_reads_a_deprecated_family(path):
    text = path.read_text()
    for m in DEPRECATED:
        assert not re.search(rf"\b{m.name}\b", text), (path, m.name)


def test_the_deprecated_twin_serves_the_same_samples():
    golden = (ROOT / "tests/data/golden/metrics.prom").read_text()
    for m in DEPRECATED:
        old = sorted(re.findall(rf"^{m.name}(\{{.*\}}) (\S+)$", golden, re.M))
        new = sorted(re.findall(rf"^{m.deprecated}(\{{.*\}}) (\S+)$", golden, re.M))
        assert old and old == new, m.name
