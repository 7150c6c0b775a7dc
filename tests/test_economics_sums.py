"""dE as the study computes it (methods.md s2, issue 37): over a window, total energy over total tokens on each side
(a ratio of sums over the repeat windows), its SE the jackknife over the repeat windows; the estimated and
potential kinds priced from the same tokens, seconds and energy as the recomputation tax and the saving
(derive/energy.tax_in_energy), so that potential dE = (1 - J_r/J_c) x kvwatt_recompute_energy_share_ratio and
estimated dE = S / (P + S) (S = kvwatt_offload_saved_watts, P the marginal power), exactly.

Before: dE was the unweighted mean of the per-window ratios, so a window in which the load starts (few tokens, a
high J/token) weighed as much as a full one; on the demo the potential dE read under half of the tax it prices
(70 of 70 reads)."""

from __future__ import annotations

import math

import pytest

from exporter.derive import economics as E
from exporter.derive import energy as derive_energy
from exporter.derive import phase_energy as pe
from exporter.samples import Interval
from exporter.store import buckets_of
from tests.support.aggregates import aggregate_of

RATIO = 0.1  # load_to_compute_cost_ratio
WIDTH = 10.0  # the repeat windows' grid


def _iv(t: float, computed: float, generated: float, reloaded: float = 0.0, cached: float = 0.0,
        joules: float = 400.0, idle: float = 100.0) -> Interval:
    return Interval(t0=t, t1=t + 1.0, deltas={"generation_tokens": generated, "prompt_local_compute": computed,
                                              "prompt_local_cache_hit": cached,
                                              "prompt_external_kv_transfer": reloaded},
                    gauges={"kv_usage": 0.95}, energy_joules={"gpu": joules}, idle_joules={"gpu": idle})


def _load_starts(reloaded: float = 0.0) -> list[Interval]:
    """40 s: the first 10 s window starts idle and takes load at its 8th second (few tokens, its J/token well
    above the full windows'); the next three carry a steady, prompt-heavy load."""
    out = [_iv(t, 0.0, 0.0, joules=100.0) for t in range(7)]
    out += [_iv(t, 900.0, 30.0, reloaded, cached=200.0, joules=380.0) for t in range(7, 10)]
    out += [_iv(t, 1500.0 + 20 * (t % 3), 100.0, reloaded, cached=400.0, joules=700.0 + 5 * (t % 4))
            for t in range(10, 40)]
    return out


def _windows(ivs: list[Interval]) -> list[E.WindowStat]:
    return E.window_stats(buckets_of(ivs, WIDTH), WIDTH)


def test_paired_de_is_total_energy_over_total_tokens_not_the_mean_of_the_windows_ratios():
    """The OFF twin takes load in the same partial window; its J/token there is 3x its steady one, the ON's 1.5x."""
    on = [E.WindowStat(t0=0, t1=10, covered_seconds=10, generated_tokens=100, joules=30.0, kv_p95=0.9,
                       computed_prompt_tokens=0, loaded_prompt_tokens=0, loaded=True)] + \
        [E.WindowStat(t0=k * 10, t1=k * 10 + 10, covered_seconds=10, generated_tokens=1000, joules=200.0, kv_p95=0.9,
                      computed_prompt_tokens=0, loaded_prompt_tokens=0, loaded=True) for k in range(1, 4)]
    off = [E.WindowStat(t0=0, t1=10, covered_seconds=10, generated_tokens=100, joules=75.0, kv_p95=0.9,
                        computed_prompt_tokens=0, loaded_prompt_tokens=0, loaded=True)] + \
        [E.WindowStat(t0=k * 10, t1=k * 10 + 10, covered_seconds=10, generated_tokens=1000, joules=250.0 + 10 * k,
                      kv_p95=0.9, computed_prompt_tokens=0, loaded_prompt_tokens=0, loaded=True) for k in range(1, 4)]
    de, dt = E.paired(on, off)
    e_on, n_on = sum(w.joules for w in on), sum(w.generated_tokens for w in on)
    e_off, n_off = sum(w.joules for w in off), sum(w.generated_tokens for w in off)
    assert de.value == pytest.approx(1 - (e_on / n_on) / (e_off / n_off))
    mean_of_ratios = 1 - (sum(w.joules_per_token for w in on) / 4) / (sum(w.joules_per_token for w in off) / 4)
    assert abs(de.value - mean_of_ratios) > 0.02  # the partial window no longer weighs as a full one
    # the jackknife, by hand: leave one pair out of the four sums
    thetas = [1 - ((e_on - a.joules) / (n_on - a.generated_tokens))
              / ((e_off - b.joules) / (n_off - b.generated_tokens))
              for a, b in zip(on, off)]
    m = sum(thetas) / 4
    assert de.stderr == pytest.approx(math.sqrt(3 / 4 * sum((t - m) ** 2 for t in thetas)))
    assert dt.value == pytest.approx(0.0) and de.windows == 4


def test_the_jackknife_of_a_mean_is_the_standard_error_of_the_mean():
    """Leave-one-out of a plain mean (a ratio over unit denominators) gives the textbook SE exactly."""
    values = [1.0, 2.0, 4.0, 7.0]
    se = E.jackknife_stderr([(v, 1.0) for v in values], lambda s: s[0] / s[1])
    assert se == pytest.approx(E.mean_and_stderr(values)[1])
    assert E.jackknife_stderr([(1.0, 1.0)], lambda s: s[0] / s[1]) is None  # one window: no spread


@pytest.mark.parametrize("costs", [
    pe.PhaseCosts(scope="gpu", prompt_computed_j=0.05, prompt_computed_se=0.002, generated_j=0.3, generated_se=0.01,
                  reloaded_j=None, reloaded_se=None, windows=60, state="known", reason="", source="measured"),
    pe.PhaseCosts(scope="gpu", prompt_computed_j=0.05, prompt_computed_se=None, generated_j=0.25, generated_se=None,
                  reloaded_j=0.005, reloaded_se=None, windows=30, state="unknown", reason="", source="prior"),
    # beyond the energy: capped
    pe.PhaseCosts(scope="gpu", prompt_computed_j=5.0, prompt_computed_se=0.1, generated_j=0.3, generated_se=0.01,
                  reloaded_j=None, reloaded_se=None, windows=60, state="known", reason="", source="measured"),
], ids=["measured", "prior", "capped"])
def test_the_potential_de_is_the_tax_share_it_prices(costs):
    """potential dE = (1 - J_r/J_c) x the window's recompute energy share (the tax_in_energy figure), exactly,
    with a window in which the load starts."""
    ivs = _load_starts()
    agg, windows = aggregate_of(ivs), _windows(ivs)
    ref = 0.3
    share = derive_energy.tax_in_energy(agg, ref, [costs], False, RATIO)["recompute_energy_share"]["gpu"]
    est = E.potential(windows, ref, None, RATIO, costs, E.scope_stat(agg, "gpu"))
    kept = 1 - (costs.reloaded_j / costs.prompt_computed_j if costs.reloaded_j is not None else RATIO)
    assert est.value == pytest.approx(kept * share, rel=1e-9)
    assert est.windows == 4 and est.stderr is not None and est.stderr >= 0
    # the jackknife by hand: the whole window without each repeat window in turn
    def dE(ws):  # noqa: N802
        e = sum(w.joules for w in ws)
        computed, reloaded = sum(w.computed_prompt_tokens for w in ws), sum(w.loaded_prompt_tokens for w in ws)
        prompt = sum(w.prompt_tokens for w in ws)
        c = min(costs.prompt_computed_j, e / (computed + reloaded))
        return max(computed / prompt - ref, 0) * prompt * c * kept / e
    thetas = [dE([v for v in windows if v is not w]) for w in windows]
    m = sum(thetas) / 4
    jack = math.sqrt(3 / 4 * sum((t - m) ** 2 for t in thetas))
    if costs.source == "prior":
        assert est.stderr == pytest.approx(jack, rel=1e-9)
    else:
        assert est.stderr >= jack * (1 - 1e-9)  # the measured cost's SE on top


def test_a_window_holding_no_whole_repeat_window_still_has_the_potential_its_tax_share_prices():
    """A 30 s window often holds no whole repeat window (the grid's are 10 s here; at 1 s ticks its first second
    cuts one): the potential is priced on the window's own sums all the same, as the tax share beside it is, with
    no SE (the jackknife needs two windows). Before, it was unknown there while the share read 0.9 (the demo's
    demo-no-offload at the end of its story)."""
    costs = pe.PhaseCosts(scope="gpu", prompt_computed_j=0.05, prompt_computed_se=None, generated_j=0.25,
                          generated_se=None, reloaded_j=0.005, reloaded_se=None, windows=30, state="unknown", reason="",
                          source="prior")
    ivs = [iv for iv in _load_starts() if 10.5 <= iv.t0 < 19.5]  # 9 s: no 10 s bucket lies wholly inside
    agg = aggregate_of(ivs)
    assert not [w for w in _windows(ivs) if w.covered_seconds >= WIDTH]
    share = derive_energy.tax_in_energy(agg, 0.3, [costs], False, RATIO)["recompute_energy_share"]["gpu"]
    est = E.potential([], 0.3, None, RATIO, costs, E.scope_stat(agg, "gpu"))
    assert share > 0.01 and est.value == pytest.approx((1 - 0.005 / 0.05) * share, rel=1e-9)
    assert est.stderr is None and est.windows == 0
    assert E.potential([], 0.3, None, RATIO, costs, None).value is None  # nothing to price: unknown


def test_the_estimated_de_is_the_saving_over_the_energy_it_would_have_taken():
    costs = pe.PhaseCosts(scope="gpu", prompt_computed_j=0.05, prompt_computed_se=0.002, generated_j=0.3,
                          generated_se=0.01, reloaded_j=0.01, reloaded_se=0.001, windows=60, state="known", reason="",
                          source="measured")
    ivs = _load_starts(reloaded=600.0)
    agg = aggregate_of(ivs)
    fig = derive_energy.tax_in_energy(agg, 0.3, [costs], True, RATIO)
    used = agg.scope("gpu")
    saved_w = fig["offload_saved_watts"]["gpu"]
    marginal_w = (used.energy_joules - used.idle_joules) / used.covered_seconds
    est = E.estimated(_windows(ivs), None, RATIO, costs, E.scope_stat(agg, "gpu"))
    assert est.value == pytest.approx(saved_w / (marginal_w + saved_w), rel=1e-9)
    assert est.windows == 4 and est.stderr is not None


def test_the_server_s_potential_figure_is_the_tax_share_it_prices():
    """Through the model (model/offload.savings, the daemon's call): the OFF server's potential dE over the window
    against its recompute energy share, with the prior costs a server has before they are measured. Before, it
    priced the windows at the attribution price and averaged their ratios: 7.5 times the share here."""
    from exporter.config import Config
    from exporter.figures import KappaFigures
    from exporter.model import offload as offload_figures

    costs = pe.PhaseCosts(scope="gpu", prompt_computed_j=0.05, prompt_computed_se=None, generated_j=0.25,
                          generated_se=None, reloaded_j=0.005, reloaded_se=None, windows=30, state="unknown", reason="",
                          source="prior")
    ivs = _load_starts()
    agg = aggregate_of(ivs)
    share = derive_energy.tax_in_energy(agg, 0.3, [costs], False, RATIO)["recompute_energy_share"]["gpu"]
    so = offload_figures.OffloadSetup(None, None, KappaFigures(critical=None, breakeven_tokens=None,
                                                               breakeven_tokens_gqa=None, breakeven_tokens_mha=None,
                                                               model_source=None, hardware_source=None), None)
    (fig,) = offload_figures.savings(agg, _windows(ivs), _windows(ivs), None, False, 0.3, Config(), so, costs)
    assert fig.baseline == "potential"
    assert fig.energy_saving == pytest.approx((1 - RATIO) * share, rel=1e-9), (fig, share)


def _by_definition(windows: list[E.WindowStat], whole: E.WindowStat | None, kind: str, price, costs,
                   reference: float) -> tuple[float | None, float | None]:
    """dE and its jackknife SE as methods.md s2 defines them, with whole WindowStat copies (the code before the
    leave-one-out sums became tuples): the value over ``whole`` (else the windows' sum), each theta over ``whole``
    less one window, field by field."""
    from dataclasses import replace

    def plus(a: E.WindowStat, b: E.WindowStat, sign: float) -> E.WindowStat:
        return replace(a, **{f: (getattr(a, f) or 0.0) + sign * (getattr(b, f) or 0.0) for f in E._SUMMED})

    def de(s: E.WindowStat) -> float | None:
        return (E.potential if kind == "potential" else E.estimated)(
            *(([s], reference) if kind == "potential" else ([s],)), price, RATIO, costs, s).value

    usable = [w for w in windows if w.loaded and w.joules]
    if whole is None:
        whole = usable[0]
        for w in usable[1:]:
            whole = plus(whole, w, 1.0)
    thetas = [de(plus(whole, w, -1.0)) for w in usable]
    n = len(thetas)
    m = math.fsum(thetas) / n
    return de(whole), math.sqrt((n - 1) / n * math.fsum((t - m) ** 2 for t in thetas))


@pytest.mark.parametrize("pricing", ["costs", "number", "roofline"])
@pytest.mark.parametrize("kind", ["potential", "estimated"])
@pytest.mark.parametrize("given_whole", [True, False])
def test_the_leave_one_out_sums_price_exactly_what_window_copies_did(pricing, kind, given_whole):
    """The jackknife prices the whole less each repeat window (at 64 servers and a 1 h window ~7,700 of them a
    tick, hence tuples of the summed fields instead of WindowStat copies): the same dE and SE, to the last bit,
    whichever way the windows are priced (prior costs, a fixed J_c, the roofline per window)."""
    ivs = [Interval(t0=iv.t0 + k * 40, t1=iv.t1 + k * 40, deltas=iv.deltas, gauges=iv.gauges,
                    energy_joules=iv.energy_joules, idle_joules=iv.idle_joules)
           for k in range(6) for iv in _load_starts(reloaded=300.0 * (k % 2))]
    windows = _windows(ivs)
    assert len([w for w in windows if w.loaded]) >= 20
    costs = pe.PhaseCosts(scope="gpu", prompt_computed_j=0.05, prompt_computed_se=None, generated_j=0.25,
                          generated_se=None, reloaded_j=0.005, reloaded_se=None, windows=30, state="unknown", reason="",
                          source="prior") \
        if pricing == "costs" else None
    price = {"costs": None, "number": 0.04, "roofline": E.price_from_roofline(8e9, 4e14)}[pricing]
    whole = E.scope_stat(aggregate_of(ivs), "gpu") if given_whole else None
    fn = E.potential if kind == "potential" else E.estimated
    est = fn(windows, 0.5, price, RATIO, costs, whole) if kind == "potential" else fn(windows, price, RATIO, costs,
                                                                                        whole)
    value, se = _by_definition(windows, whole, kind, price, costs, 0.5)
    assert est.value is not None and est.stderr is not None and est.stderr > 0
    assert (est.value, est.stderr) == (value, se)
