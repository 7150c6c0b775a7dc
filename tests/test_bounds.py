"""The declared bounds (exporter/catalog/bounds.py, ``bounds=`` in exporter.catalog) and the one check that holds the
typed
figures to them before anything is served: a violation of each kind of bound becomes unknown in /metrics, in
/api/status and on the page alike, with its reason, counted and logged once per change."""

from __future__ import annotations

import logging
import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter import catalog
from exporter.catalog import bounds
from exporter.catalog.bounds import BoundsCheck
from exporter.derive.energy import EnergyPerToken
from exporter.figures import CostFigure, EnergyFigure, PriceFigure, SavingFigure, ServerFigures, Snapshot, WindowFigures
from exporter.samples import SourceStatus
from exporter.serve import page
from exporter.serve.collector import render
from exporter.serve.web import status_json

PRICE, INTENSITY = 0.2, 400.0
# 60 s with 600 W above idle: E 60 kJ, P_idle*dt 24 kJ -> marginal 600 W, 36 kJ over 12,000 tokens = 3 J/token
BASIS = EnergyPerToken("gpu", 60_000.0, 24_000.0, 12_000.0, 60.0, 60.0)
MARGINAL_W = 600.0


def day(watts: float, price: float) -> float:
    return watts * bounds.DAY_KWH_PER_WATT * price


def costs(**kw) -> CostFigure:
    base = dict(scope="gpu", marginal_watts=MARGINAL_W, money_per_million_tokens=3.0 * 1e6 / 3.6e6 * PRICE,
                co2e_grams_per_thousand_tokens=3.0 * 1e3 / 3.6e6 * INTENSITY,
                money_per_day=day(MARGINAL_W, PRICE), co2e_grams_per_day=day(MARGINAL_W, INTENSITY), currency="EUR",
                recompute_tax_money_per_day=day(60.0, PRICE), recompute_tax_co2e_grams_per_day=day(60.0, INTENSITY),
                offload_saved_money_per_day=day(30.0, PRICE), offload_saved_co2e_grams_per_day=day(30.0, INTENSITY))
    return CostFigure(**(base | kw))


def window(**kw) -> WindowFigures:
    base = dict(window="1m", seconds=60.0, covered_seconds=60.0, kv_usage_p95=0.5, kv_usage_max=0.6,
                generation_tokens_per_second=200.0, token_shares={"local_compute": 0.5, "local_cache_hit": 0.3,
                                                                  "external_kv_transfer": 0.2},
                recompute_tax=0.1, energy=(EnergyFigure("gpu", BASIS, 5.0, 3.0),),
                savings=(SavingFigure(baseline="estimated", energy_saving=0.2, energy_saving_stderr=0.01, windows=5),
                         SavingFigure(baseline="paired", energy_saving=0.1, energy_saving_stderr=0.02, windows=5,
                                      reference_windows=5, note="", throughput_gain=0.05, throughput_gain_stderr=0.01,
                                      has_throughput=True)),
                recompute_tax_watts={"gpu": 60.0}, offload_saved_watts={"gpu": 30.0},
                recompute_energy_share={"gpu": 0.1}, costs=(costs(),))
    return WindowFigures(**(base | kw))


def snapshot(t: float = 1.0, **kw) -> Snapshot:
    server = ServerFigures("s", "http://s:8000", SourceStatus(source="vllm", server="s",
                                                              up=True), None, 0.9, 0.04, "configured",
                           (window(**kw),))
    return Snapshot(t, 1.75e9, (server,), prices=(PriceFigure(quantity="electricity_price", value=PRICE,
                                                              source="configured", currency="EUR"),
                                                  PriceFigure(quantity="carbon_intensity", value=INTENSITY,
                                                              source="configured")))


def served(snap: Snapshot) -> tuple[dict, dict, str]:
    """(/metrics samples by (name, labels), the /api/status dict, the page) of a checked snapshot."""
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(render(snap).decode()) for s in f.samples}
    js = status_json(snap)
    return samples, js, page.render(js)


def test_every_family_declares_its_bound():
    missing = [m.name for m in catalog.METRICS if not isinstance(m.bounds, bounds.Bound)]
    assert not missing, f"families without a declared bound: {missing}"
    assert {m.bounds.kind for m in catalog.METRICS} <= set(bounds.KINDS)


def test_a_plausible_snapshot_passes_untouched():
    snap = snapshot()
    checked = BoundsCheck(catalog.METRICS).apply(snap)
    assert checked.implausible == () and checked.servers == snap.servers


# (what is broken, the family that must be rejected, its labels, the bound kind); each a violation of one kind
CASES = [
    ("share", dict(recompute_energy_share={"gpu": 2.616}), "kvwatt_recompute_energy_share_ratio",
     {"server": "s", "scope": "gpu", "window": "1m"}, "share"),
    ("share of tokens", dict(token_shares={"local_compute": 1.4, "local_cache_hit": 0.0,
                                           "external_kv_transfer": 0.0}),
     "kvwatt_prompt_token_share_ratio", {"server": "s", "source": "local_compute", "window": "1m"}, "share"),
    ("difference of shares", dict(recompute_tax=1.5), "kvwatt_recompute_tax_ratio", {"server": "s", "window": "1m"},
     "share_difference"),
    ("dE above 1", dict(savings=(SavingFigure(baseline="paired", energy_saving=3.61, energy_saving_stderr=0.1,
                                              windows=5, reference_windows=5),)), "kvwatt_energy_saving_ratio",
     {"server": "s", "baseline": "paired", "window": "1m"}, "saving"),
    ("dTPS below -1", dict(savings=(SavingFigure(baseline="paired", energy_saving=0.1, energy_saving_stderr=0.01,
                                                 windows=5, reference_windows=5, note="", throughput_gain=-1.5,
                                                 throughput_gain_stderr=0.1, has_throughput=True),)),
     "kvwatt_throughput_gain_ratio", {"server": "s", "baseline": "paired", "window": "1m"}, "gain"),
    ("tax beyond the power", dict(recompute_tax_watts={"gpu": 1721.0}, recompute_energy_share={"gpu": 0.5}),
     "kvwatt_recompute_tax_watts", {"server": "s", "scope": "gpu", "window": "1m"}, "power_part"),
    ("saving beyond the power", dict(offload_saved_watts={"gpu": 1343.0}), "kvwatt_offload_saved_watts",
     {"server": "s", "scope": "gpu", "window": "1m"}, "saved_power"),
    ("negative J/token", dict(energy=(EnergyFigure("gpu", BASIS, 5.0, -0.4),), costs=()),
     "kvwatt_marginal_energy_per_token_joules", {"server": "s", "scope": "gpu", "window": "1m"}, "joules_per_token"),
    ("tokens/s beyond any engine", dict(generation_tokens_per_second=1.95e8), "kvwatt_generation_tokens_per_second",
     {"server": "s", "window": "1m"}, "token_rate"),
    ("negative rate", dict(preemptions_per_minute=-3.0), "kvwatt_preemptions_per_minute",
     {"server": "s", "window": "1m"}, "non_negative"),
    ("money not the watts it prices", dict(costs=(costs(recompute_tax_money_per_day=3.80),)),
     "kvwatt_recompute_tax_cost_per_day", {"server": "s", "scope": "gpu", "window": "1m", "currency": "EUR"},
     "priced"),
    ("money per day infinite", dict(costs=(costs(money_per_day=math.inf),)), "kvwatt_marginal_energy_cost_per_day",
     {"server": "s", "scope": "gpu", "window": "1m", "currency": "EUR"}, "priced"),
    ("boolean 2", dict(above_threshold=2), "kvwatt_kv_pressure_above_threshold", {"server": "s", "window": "1m"},
     "boolean"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_one_check_rejects_each_kind_of_violation(case, caplog):
    _, broken, figure, labels, kind = case
    check = BoundsCheck(catalog.METRICS)
    raw = snapshot(**broken)
    key = (figure, tuple(sorted(labels.items())))
    assert key in served(raw)[0], "the unchecked snapshot serves the impossible figure"
    with caplog.at_level(logging.WARNING, logger="kvwatt.bounds"):
        snap = check.apply(raw)
    assert any(r.figure == figure and dict(r.labels) == labels and r.kind == kind for r in snap.implausible)
    samples, js, html = served(snap)
    assert key not in samples  # /metrics: absent (unknown)
    rejected = [r for r in js["implausible"] if r["figure"] == figure]
    assert rejected and rejected[0]["reason"].startswith(f"implausible: {figure}")
    assert rejected[0]["labels"] == labels and rejected[0]["bound"] == kind
    assert f'data-figure="{figure}"' in html  # the page lists it with its reason
    assert samples[("kvwatt_figures_rejected_total", (("figure", figure), ("reason", kind)))] >= 1.0
    # once for the figure itself (its dependents' lines name it as their reason, and figures that contradict it
    # have their own "inconsistent: ..." lines: methods.md s13)
    assert sum(f"unknown: implausible: {figure}" in r.getMessage() for r in caplog.records) == 1
    for again in (2.0, 3.0):  # logged once per change, counted once per tick
        caplog.clear()
        snap = check.apply(snapshot(t=again, **broken))
        assert not any(figure in r.getMessage() for r in caplog.records)
    assert check.counts[(figure, kind)] == 3.0
    with caplog.at_level(logging.INFO, logger="kvwatt.bounds"):
        check.apply(snapshot(t=4.0))
    assert sum("within its bounds again" in r.getMessage() for r in caplog.records) >= 1


def test_the_json_and_the_page_say_unknown_where_metrics_omits():
    snap = BoundsCheck(catalog.METRICS).apply(snapshot(recompute_energy_share={"gpu": 2.616}))
    samples, js, html = served(snap)
    w = js["servers"][0]["windows"]["1m"]
    assert w["recompute_energy_share"] == {"gpu": None}
    assert "261.6" not in html and "2.616" not in str(samples)
    reason = js["implausible"][0]["reason"]
    assert "2.616 outside [0, 1]" in reason


def test_a_tax_beyond_the_power_names_its_inputs():
    snap = BoundsCheck(catalog.METRICS).apply(snapshot(recompute_tax_watts={"gpu": 1721.0},
                                                       recompute_energy_share={"gpu": 0.5}))
    reasons = {r.figure: r.reason for r in snap.implausible}
    assert "1721 W > the gpu marginal power 600 W = (E 6e+04 J - P_idle*dt 2.4e+04 J) / 60 s" in \
        reasons["kvwatt_recompute_tax_watts"]
    # the money priced from the rejected watts goes with them
    assert "kvwatt_recompute_tax_cost_per_day" in reasons
    assert snap.servers[0].windows[0].costs[0].recompute_tax_money_per_day is None


def test_every_kind_in_use_is_proven_by_a_case():
    """Each kind of bound a family declares has a case above that the one check rejects (info series are
    built 1 by their fills: their bound is checked on the value itself)."""
    used = {m.bounds.kind for m in catalog.METRICS}
    proven = {c[-1] for c in CASES}
    assert used - proven <= {"info"}, used - proven
    where = bounds.Where("kvwatt_server_info", {}, snapshot())
    assert bounds.INFO.violation(0.5, where) and bounds.INFO.violation(1.0, where) is None
    assert bounds.UNBOUNDED_RATIO.violation(float("inf"), where) is None  # kappa's documented +Inf
    assert bounds.NON_NEGATIVE.violation(float("inf"), where)
    assert all(m.bounds.violation(float("nan"), where) for m in catalog.METRICS)



def test_a_value_within_by_its_value_alone_is_never_one_the_bound_rejects_or_clamps():
    """Bound.within skips the full check of a sample (issue 39: the tick's cost): whatever it passes, the full
    check passes too and clamps nothing; the edges (ulps outside a range, -0.0, NaN, the infinities) included."""
    import math

    from exporter.catalog import bounds as b

    edges = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0, 1e300, -1e-300, math.inf, -math.inf, math.nan,
             math.nextafter(1.0, 2.0), math.nextafter(0.0, -1.0), math.nextafter(-1.0, -2.0), 1.0 + 1e-12]
    fast = [x for x in vars(b).values() if isinstance(x, b.Bound) and x.within is not None]
    assert {x.kind for x in fast} >= {"share", "share_difference", "boolean", "info", "non_negative"}
    for bound in fast:
        for v in edges:
            if bound.within(v):
                assert bound.violation(v, None) is None and bound.clamped(v) is None, (bound.kind, v)
    assert not b.NON_NEGATIVE.within(math.inf) and b.UNBOUNDED_RATIO.within(math.inf)
    assert not b.SHARE.within(math.nextafter(1.0, 2.0))  # a few ulps outside: the full check clamps it
