"""One verdict everywhere: the regime (with the threshold in use), the recompute tax and collapse read the same
on /metrics, /api/status, the landing page, the alerts and the dashboards' first row.

The prom test drives one scenario through all of them, on loopback:
- a simulated vLLM (tests/support/loopback.py FakeVllm over vllm_sim) at KV usage ~0.70 with preemptions and a
  local_compute share of 0.30, offloading on, its GPU the NVML double;
- a real ``kvwatt run`` watching it, whose state directory already holds this server's evidence windows (clean
  up to p95 0.55, preempting from 0.65: the threshold is located at ~0.60, model/evidence_book.py) and a
  configured reference share of 0.04 (tax ~0.26);
- the Debian ``prometheus`` scraping kvwatt and the double, with a test copy of alerts/kvwatt-rules.yaml
  generated for a 10 s kvwatt window and ``for: 0s``.
p95 ~0.70 is below the configured 0.90 and above the located ~0.60: a place that compared the p95 against 0.9
itself would read "below" and disagree.

The fast tests check the dashboards' side statically: the first row reads kvwatt's verdict series, and no query
compares a KV usage p95 with a number of its own.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from exporter import rules
from tests.support import prom, vllm_sim
from tests.support.daemon import KvwattDaemon
from tests.support.fake_gpus import FakeGpus
from tests.support.grafana import displayed, expand, load_dashboards, panels
from tests.support.loopback import FakeVllm
from tests.test_dashboards_queries import resolve_variables

REPO = Path(__file__).resolve().parents[1]
SERVER, WINDOW, GPU = "box", "10s", "GPU-00000000-kvwatt-verdict"
FIRST_ROW = "Is offloading paying right now?"
REGIME_PANEL, THRESHOLD_PANEL, TAX_PANEL = "KV pressure regime now", "Regime threshold in use", "Recompute tax now"
REFERENCE_SHARE = 0.04
# alerts/generate.py --set: the kvwatt window the rules read is the daemon's one window, no waiting in for:
RULE_SETTINGS = {"window": WINDOW, "kvwatt_window": WINDOW, "kv_pressure_for": "0s", "recompute_for": "0s",
                 "preemption_for": "0s", "collapse_for": "0s"}
BUDGET_SECONDS = 60  # from the stack's start until every place has read the verdict


def first_row_panels(dashboard: dict) -> list[dict]:
    out, inside = [], False
    for p in panels(dashboard):
        if p["type"] == "row":
            if inside:
                break
            inside = p["title"] == FIRST_ROW
            continue
        if inside:
            out.append(p)
    return out


# --- the dashboards, statically ----------------------------------------------------------------------------

def test_first_row_reads_kvwatts_verdict_series():
    row = {p["title"]: p for p in first_row_panels(load_dashboards()["kvwatt-overview.json"])}
    regime, threshold, tax = row[REGIME_PANEL], row[THRESHOLD_PANEL], row[TAX_PANEL]
    assert "kvwatt_kv_pressure_regime_above{" in regime["targets"][0]["expr"]
    assert "kvwatt_kv_pressure_threshold_in_use_ratio{" in threshold["targets"][0]["expr"]
    assert "{{source}}" in threshold["targets"][0]["legendFormat"]  # located or configured, said
    assert "kvwatt_recompute_tax_ratio{" in tax["targets"][0]["expr"]
    assert displayed(regime, "1") == "above" and displayed(regime, "0") == "below"
    assert displayed(regime, "NaN") == "unknown" and displayed(tax, "NaN") == "unknown"
    steps = tax["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert steps[-1]["value"] == rules.RECOMPUTE_TAX_THRESHOLD.default  # the alert's default, from rules.py
    collapse = next(t for p in row.values() for t in p["targets"] if "kvwatt_collapse_signature{" in t["expr"])
    assert collapse["instant"]


P95_SERIES = re.compile(r"kvwatt_kv_cache_usage_p95_ratio|vllm:kv_cache_usage_perc")
COMPARED = re.compile(r"(?<![=!])[<>]=?\s*[0-9.]")


def test_no_dashboard_query_decides_the_regime_itself():
    """The regime is kvwatt's verdict (its threshold in use, with hysteresis): a query that compares a KV usage
    figure with a number of its own (``p95 > 0.9``) would disagree wherever the threshold was located."""
    own = [(name, p["title"], t["expr"]) for name, d in load_dashboards().items() for p in panels(d)
           for t in p.get("targets", []) if P95_SERIES.search(t["expr"]) and COMPARED.search(t["expr"])]
    assert not own, own


# --- one scenario through every place ----------------------------------------------------------------------

def scenario() -> vllm_sim.Scenario:
    """undersized_buffer_on's load (preemptions 6/min, offloading on) at KV usage ~0.70 and 30 % recomputed."""
    base = vllm_sim.undersized_buffer_on()
    phase = dataclasses.replace(base.timeline[0], kv_usage_ratio=0.70, kv_usage_jitter_ratio=0.01,
                                local_compute_share=0.30)
    return dataclasses.replace(base, timeline=(phase,))


def seed_evidence(state_dir: Path, now: float) -> None:
    """This server's evidence windows, as a kvwatt run before this one persisted them: located at ~0.60."""
    clean = [(p, 0.0) for p in (0.30, 0.35, 0.40, 0.45, 0.50, 0.55)]
    pressured = [(p, 3.0) for p in (0.65, 0.70, 0.75, 0.80)]
    windows = [{"p95": p, "low": p - 0.01, "high": p + 0.01, "max": p + 0.02, "preemptions_per_minute": pre,
                "tax": None, "tax_se": None, "weight": 1.0, "at": now - 60 * (10 - i), "capacity_share": 0.0}
               for i, (p, pre) in enumerate(clean + pressured)]
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "evidence-windows.json").write_text(json.dumps({"version": 2, "servers": {SERVER: {
        # the same engine as the scenario's (an epoch without engine facts would match any engine: refused)
        "epoch": {"started": now - 700, "cause": "first reading",
                  "engine": {"model_name": scenario().model_name}}, "windows": windows}}}))


def test_rules(tmp: Path) -> Path:
    sets = [a for k, v in RULE_SETTINGS.items() for a in ("--set", f"{k}={v}")]
    out = subprocess.run([sys.executable, str(REPO / "alerts" / "generate.py"), "--out-dir", str(tmp), *sets],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return tmp / "kvwatt-rules.yaml"


test_rules.__test__ = False  # a helper, not a test


def metrics_verdict(d: KvwattDaemon) -> dict:
    m = d.metrics()

    def one(name, **labels):
        hits = [(dict(lab), v) for (n, lab), v in m.items() if n == name and set(labels.items()) <= lab]
        return hits[0] if len(hits) == 1 else (None, None)

    th_labels, th = one("kvwatt_kv_pressure_threshold_in_use_ratio", server=SERVER)
    return {"above": one("kvwatt_kv_pressure_regime_above", server=SERVER, window=WINDOW)[1],
            "threshold": th, "threshold_source": (th_labels or {}).get("source"),
            "tax": one("kvwatt_recompute_tax_ratio", server=SERVER, window=WINDOW)[1],
            "collapse": one("kvwatt_collapse_signature", server=SERVER)[1]}


def first_row_shown(p: prom.Prometheus, dashboard: dict, values: dict) -> dict[str, tuple[str, float]]:
    """First-row panel title -> (what Grafana shows, the raw value) for this server's series."""
    shown = {}
    for panel in first_row_panels(dashboard):
        for t in panel["targets"]:
            for s in p.query(expand(t["expr"], values)):
                if s["metric"].get("server") == SERVER:
                    key = panel["title"] + ("" if "collapse" not in t["legendFormat"] else ": collapse")
                    shown[key] = (displayed(panel, s["value"][1]), float(s["value"][1]))
    return shown


@pytest.mark.prom
def test_one_scenario_reads_the_same_verdict_everywhere(tmp_path: Path):
    prom.require_binaries()
    rules_file = test_rules(tmp_path / "rules")
    gpus = FakeGpus(tmp_path / "gpus.json")
    overview = load_dashboards()["kvwatt-overview.json"]
    with FakeVllm(scenario()) as fv:
        fv.attach_gpu(gpus, GPU)
        servers = {SERVER: {"url": fv.url, "gpus": [GPU], "reference_local_compute_share": REFERENCE_SHARE}}
        config = {"windows": [WINDOW], "min_load_duration": "3s", "collapse_reference_window": "20s",
                  "idle_power_watts": {GPU: vllm_sim.IDLE_WATTS}}
        daemon = KvwattDaemon(servers=servers, config=config, env=gpus.env())
        seed_evidence(Path(daemon.tmp.name) / "state", time.time())
        with daemon, prom.Prometheus(tmp_path, {"kvwatt": [daemon.url.removeprefix("http://")],
                                                "vllm": {"targets": [fv.url.removeprefix("http://")],
                                                         "labels": {"server": SERVER}}},
                                     rule_files=[rules_file]) as p:
            started = time.monotonic()

            def everyone_has_read() -> bool:
                mv = metrics_verdict(daemon)
                alerts = {a["labels"]["alertname"] for a in p.alerts() if a["labels"].get("server") == SERVER}
                shown = first_row_shown(p, overview, resolve_variables(p, overview, {}, True, []))
                return (None not in mv.values() and {"KVPressureAboveThreshold", "KVRecomputeTaxHigh"} <= alerts
                        and {REGIME_PANEL, THRESHOLD_PANEL, TAX_PANEL, "Failure signatures now: collapse"}
                        <= set(shown))

            p.wait_for(everyone_has_read, timeout=BUDGET_SECONDS, what="the verdict in every place")
            # read every place back to back (one window = 10 s; the scenario is steady)
            mv = metrics_verdict(daemon)
            status = next(s for s in daemon.status()["servers"] if s["server"] == SERVER)
            page = daemon.get("/", headers={"Accept": "text/html"}).text
            alerts = {a["labels"]["alertname"]: a for a in p.alerts() if a["labels"].get("server") == SERVER}
            shown = first_row_shown(p, overview, resolve_variables(p, overview, {}, True, []))
            elapsed = time.monotonic() - started

    # the scenario is the one meant: the threshold was located below the p95, which is below the configured 0.9
    p95 = status["windows"][WINDOW]["kv_usage_p95"]
    assert mv["threshold_source"] == "located" and 0.55 <= mv["threshold"] <= 0.65, mv
    assert mv["threshold"] < p95 < rules.KV_PRESSURE_THRESHOLD.default, (mv, p95)
    # regime: above, with the located threshold, everywhere
    assert mv["above"] == 1.0
    assert status["regime"] == "above" and status["regime_window"] == WINDOW
    assert status["windows"][WINDOW]["above_threshold"] is True
    assert status["threshold_in_use"] == pytest.approx(mv["threshold"]) and status["threshold_source"] == "located"
    pressure = re.search(r'<p data-field="pressure" data-regime="(\w+)" data-state="(\w+)">(.*?)</p>', page, re.S)
    assert pressure and pressure.group(1) == "above", page[:2000]
    assert pressure.group(2) == status["regime_state"]  # the state the page shows is the JSON's
    words = pressure.group(3)
    assert "<b>above</b>" in words and "this server's own, located at" in words
    assert f"{round(100 * mv['threshold'])}" in words  # the same threshold, in words
    pa = alerts["KVPressureAboveThreshold"]
    assert pa["state"] in ("pending", "firing") and pa["labels"]["detector"] == "kvwatt", pa
    assert float(pa["value"]) == pytest.approx(p95, abs=0.05)
    assert shown[REGIME_PANEL] == ("above", 1.0)
    assert shown[THRESHOLD_PANEL][1] == pytest.approx(mv["threshold"])
    # the tax: one figure, over the one threshold the alert and the stat's colour share
    assert mv["tax"] == pytest.approx(status["windows"][WINDOW]["recompute_tax"])
    assert mv["tax"] > rules.RECOMPUTE_TAX_THRESHOLD.default
    assert float(alerts["KVRecomputeTaxHigh"]["value"]) == pytest.approx(mv["tax"], abs=0.03)  # kvwatt's tax
    assert shown[TAX_PANEL][1] == pytest.approx(mv["tax"], abs=0.03)
    # collapse: clear everywhere (known: GPU power is read), and no collapse alert
    assert mv["collapse"] == 0.0 and status["collapse"]["signature"] is False
    assert shown["Failure signatures now: collapse"][0] == "clear"
    assert "KVOffloadCollapse" not in alerts
    assert elapsed < BUDGET_SECONDS
