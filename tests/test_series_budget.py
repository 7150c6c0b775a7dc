"""The series budget (docs/fleet.md "Series budget"): how many series one watched server puts into Prometheus
with the default configuration, measured on the golden scenario (tests/test_golden.py: every figure kvwatt can
give is known there, so its fullest server is the most one server exports), against the numbers docs/fleet.md
states. A change that exports more by default fails here until the budget in docs/fleet.md says so; an opt-in
family (exporter/rules/optin.py) must not be one that an alert rule or a dashboard reads."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from exporter import catalog
from exporter.config import ConfigError, from_mapping
from exporter.model import Model
from exporter.rules import optin
from exporter.runtime.daemon import Daemon
from exporter.runtime.sampler import Sampler
from tests.test_golden import WALL, Scenario, config_mapping, samples

REPO = Path(__file__).resolve().parents[1]
FLEET = REPO / "docs" / "fleet.md"
BUDGET = re.compile(r"at most \*\*(\d+) series per server\*\* \((\d+) of the server and (\d+) per window\)")


def exposition(tmp_path, opt_in: list[str] | None) -> str:
    mapping = config_mapping(tmp_path)
    mapping.pop("metrics_opt_in")
    if opt_in is not None:
        mapping["metrics_opt_in"] = opt_in
    sc = Scenario(tmp_path, mapping=mapping)
    daemon = Daemon(sc.cfg, sampler=Sampler(sc.cfg, energy=False), model=Model(sc.cfg, wall_clock=lambda: WALL))
    for t in range(1, 91):
        daemon.step(sc.tick(t))
    return daemon.published.exposition.decode()


def per_server(text: str, windows: int) -> dict[str, tuple[int, int]]:
    """server -> (its series without a window label, its series per window)."""
    own, windowed = Counter(), Counter()
    for name, labels in samples(text):
        labels = dict(labels)
        if name.startswith("kvwatt_") and labels.get("server"):  # "": the host-wide sources
            (windowed if "window" in labels else own)[labels["server"]] += 1
    return {s: (own[s], windowed[s] // windows) for s in own}


@pytest.fixture(scope="module")
def default_text(tmp_path_factory):
    return exposition(tmp_path_factory.mktemp("budget"), None)


def test_the_fullest_server_exports_the_documented_budget(default_text):
    m = BUDGET.search(FLEET.read_text())
    assert m, f"{FLEET.name} must state 'at most **N series per server** (S of the server and W per window)'"
    total, own_budget, window_budget = map(int, m.groups())
    counts = per_server(default_text, windows=2)
    own, per_window = max(counts.values(), key=lambda c: c[0] + 2 * c[1])
    assert max(c[0] for c in counts.values()) == own and max(c[1] for c in counts.values()) == per_window
    assert (own, per_window) == (own_budget, window_budget), (
        f"the default exposition's fullest server exports {own} series of its own and {per_window} per window "
        f"(golden scenario, {sorted(counts.items())}); docs/fleet.md says {own_budget} and {window_budget}: "
        "update the budget there (and its fleet figures) or make the new family opt-in (exporter/rules/optin.py)")
    assert total == own_budget + 2 * window_budget  # two windows, the default configuration's


def test_no_opt_in_family_by_default_and_each_when_asked(default_text, tmp_path):
    names = {n for n, _ in samples(default_text)}
    assert not names & set(optin.OPT_IN_FAMILIES)
    every = {n for n, _ in samples(exposition(tmp_path, ["all"]))}
    assert set(optin.OPT_IN_FAMILIES) <= every  # the golden scenario fills each of them
    one = {n for n, _ in samples(exposition(tmp_path / "one", ["kvwatt_server_capability"]))}
    assert one & set(optin.OPT_IN_FAMILIES) == {"kvwatt_server_capability"}


def test_opt_in_families_are_catalog_families_no_alert_or_dashboard_reads():
    declared = {d.name for d in catalog.METRICS}
    assert set(optin.OPT_IN_FAMILIES) <= declared
    # what reads /metrics by default: the alert and recording rules (cluster and fleet), the dashboards (node
    # and fleet), the federation and remote-write configurations, the runbook the alerts link to (it names
    # series to query) and the page (it reads /api/status today; a family it came to name would be read here)
    readers = [*REPO.glob("alerts/*.yaml"), *REPO.glob("dashboards/*.json"), *REPO.glob("deploy/**/*.yaml"),
               *REPO.glob("deploy/**/*.yml"), *REPO.glob("deploy/**/*.json"), REPO / "alerts" / "RUNBOOK.md",
               *REPO.glob("exporter/serve/page*.py")]
    assert len(readers) >= 8
    assert {"kvwatt-rules.yaml", "kvwatt-overview.json", "kvwatt-fleet-rules.yaml", "kvwatt-fleet.json",
            "RUNBOOK.md", "page.py"} <= {
        p.name for p in readers}
    for path in readers:
        text = path.read_text()
        read = {n for n in optin.OPT_IN_FAMILIES if re.search(re.escape(n) + r"(?![a-z_])", text)}
        assert not read, f"{path.relative_to(REPO)} reads opt-in families {sorted(read)}: export them by default"


def test_an_unknown_opt_in_family_is_one_line():
    with pytest.raises(ConfigError, match=r"^metrics_opt_in\[0\]: 'kvwatt_nope' is not an opt-in family"):
        from_mapping({"metrics_opt_in": ["kvwatt_nope"]})
    with pytest.raises(ConfigError, match=r"^metrics_opt_in: expected a list"):
        from_mapping({"metrics_opt_in": "all"})
