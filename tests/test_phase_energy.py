"""Measured per-phase energy costs (exporter/derive/phase_energy.py, methods.md s12) against a power double
with known costs (tests/phase_double.py: the agentic mix of /work/shared/traces, 5 % multiplicative and 150 J
additive noise per window). Stated tolerance: at 120 windows, over 20 seeds, every fitted cost is within 3.5 of
its SEs of the truth and the median relative error is <= 10 % per phase; over 40 seeds the z-scores have an SD
in [0.7, 1.4] (SE calibrated)."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from exporter import rules
from exporter.derive import phase_energy as pe
from exporter.results import PHASES
from exporter.samples import Interval
from exporter.store import buckets_of
from tests import phase_double

TRUE = (0.03, 0.4, 0.004)  # J per computed prompt, generated, reloaded token (H100-like orders of magnitude)
MIN_W, MAX_COND = rules.PHASE_MIN_WINDOWS.default, rules.PHASE_MAX_CONDITION.default


def fit(ws):
    return pe.estimate(ws, "gpu", MIN_W, MAX_COND, 0.1)


@pytest.mark.parametrize("offload", [False, True])
def test_double_recovers_the_costs_within_the_stated_tolerance(offload):
    phases = ("prompt_computed", "generated") + (("reloaded",) if offload else ())
    rel = {p: [] for p in phases}
    for seed in range(20):
        c = fit(phase_double.windows(120, TRUE, seed=seed, offload=offload))
        assert (c.state, c.source, c.windows) == ("known", "measured", 120)
        for phase, truth in zip(phases, TRUE):
            got, se = c.joules(phase), c.stderr(phase)
            assert abs(got - truth) <= 3.5 * se, (seed, phase, got, se)
            rel[phase].append(abs(got - truth) / truth)
        if not offload:
            assert c.reloaded_j is None and "reloaded" in c.reason
    for phase in phases:
        assert statistics.median(rel[phase]) <= 0.10, (phase, statistics.median(rel[phase]))


def test_the_standard_errors_are_calibrated():
    z = []
    for seed in range(40):
        c = fit(phase_double.windows(60, TRUE, seed=100 + seed, offload=True))
        z += [(c.joules(p) - t) / c.stderr(p) for p, t in zip(PHASES, TRUE)]
    assert 0.7 <= statistics.pstdev(z) <= 1.4
    assert abs(statistics.mean(z)) < 0.4


def test_more_windows_shrink_the_standard_error():
    se30 = fit(phase_double.windows(30, TRUE, seed=5)).prompt_computed_se
    se120 = fit(phase_double.windows(120, TRUE, seed=5)).prompt_computed_se
    assert se120 < se30


def test_a_constant_mix_is_not_identifiable_and_keeps_the_prior():
    c = fit(phase_double.windows(120, TRUE, constant_mix=True))
    assert (c.state, c.source) == ("not_identifiable", "prior")
    assert "does not vary enough" in c.reason and "prompt_computed and generated" in c.reason
    # the prior: one unit per generated token, a fraction of it per computed prompt token, 0.1 of that per reloaded
    p = pe.PRIOR_PROMPT_TO_GENERATED_COST_RATIO
    assert c.prompt_computed_j == pytest.approx(p * c.generated_j)
    assert c.reloaded_j == pytest.approx(0.1 * p * c.generated_j)
    assert c.prompt_computed_se is None


def test_too_few_windows_are_not_identifiable():
    c = fit(phase_double.windows(MIN_W - 1, TRUE))
    assert c.state == "not_identifiable" and f"needs {MIN_W}" in c.reason


def test_no_window_is_unknown():
    c = fit([])
    assert (c.state, c.prompt_computed_j) == ("unknown", None)


def test_nnls_pins_a_negative_cost_at_zero():
    # y = 2*x1 - 0.5*x2 exactly: the unconstrained fit is negative on x2; NNLS pins it at 0 and refits x1
    x1 = [1.0, 2.0, 3.0, 4.0, 5.0]
    x2 = [5.0, 1.0, 4.0, 2.0, 3.0]
    y = [2 * a - 0.5 * b for a, b in zip(x1, x2)]
    f = pe.nnls([x1, x2], y)
    assert f.coef[1] == 0.0 and f.free == (True, False)
    assert f.coef[0] == pytest.approx(sum(a * b for a, b in zip(x1, y)) / sum(a * a for a in x1))


def _brute_nnls(cols, y):
    """Every subset fitted row by row (its own Gram matrix, its residuals summed over the rows), the feasible
    one with the least residual, the larger set on a tie: what nnls did before it read one pass's normal
    equations."""
    best = None
    for size in range(len(cols), 0, -1):
        for subset in itertools.combinations(range(len(cols)), size):
            xs = [cols[i] for i in subset]
            b = pe._solve(pe._gram(xs), [sum(x * v for x, v in zip(c, y)) for c in xs])
            if b is None or any(v < 0 for v in b):
                continue
            rss = sum((v - sum(bi * c[k] for bi, c in zip(b, xs))) ** 2 for k, v in enumerate(y))
            if best is None or rss < best[1] * (1 - 1e-9):
                best = (subset, rss, b)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_nnls_from_the_normal_equations_is_the_row_by_row_fit(seed):
    """Random windows with 2 or 3 columns, some true costs negative (so subsets are pinned): the same free set,
    coefficients and residual as fitting every subset over the rows."""
    rng = random.Random(seed)
    k, n = rng.choice([2, 3]), rng.randint(5, 300)
    true = [rng.uniform(-0.2, 1.0) for _ in range(k)]
    cols = [[rng.uniform(0, 1000) * rng.choice([0.0, 1.0, 1.0]) for _ in range(n)] for _ in range(k)]
    y = [sum(t * c[i] for t, c in zip(true, cols)) + rng.gauss(0, 20) for i in range(n)]
    got, want = pe.nnls(cols, y), _brute_nnls(cols, y)
    assert (got is None) == (want is None)
    if got is None:
        return
    subset, rss, b = want
    assert got.free == tuple(i in subset for i in range(k))
    assert [got.coef[i] for i in subset] == pytest.approx(b, rel=1e-9, abs=1e-12)
    assert got.rss == pytest.approx(rss, rel=1e-9)


def test_condition_number_of_orthogonal_and_proportional_columns():
    assert pe.condition_number([[1.0, 0.0], [0.0, 1.0]]) == pytest.approx(1.0)
    assert math.isinf(pe.condition_number([[1.0, 2.0], [2.0, 4.0]]))


def _iv(t0, gen, computed, reloaded, joules, idle):
    return Interval(t0=t0, t1=t0 + 1, deltas={"generation_tokens": gen, "prompt_local_compute": computed,
                                              "prompt_local_cache_hit": 0.0,
                                              "prompt_external_kv_transfer": reloaded},
                    gauges={"kv_usage": 0.5}, energy_joules={"gpu": joules}, idle_joules={"gpu": idle})


def test_observation_reads_the_grid_bucket():
    ivs = [_iv(t, 10.0, 100.0, 5.0, 150.0, 100.0) for t in range(10)]
    (b,) = buckets_of(ivs, 10.0)
    o = pe.observation(b, 10.0, "gpu")
    assert o == pe.PhaseWindow(500.0, 1000.0, 100.0, 50.0)
    assert pe.observation(b, 10.0, "host") is None  # no host energy: no observation


def test_tax_and_saving_in_watts():
    c = pe.PhaseCosts(scope="gpu", prompt_computed_j=0.03, prompt_computed_se=0.001, generated_j=0.4, generated_se=0.01,
                      reloaded_j=0.004, reloaded_se=0.0005, windows=60, state="known", reason="", source="measured")
    assert pe.recompute_tax_watts(0.2, 1000.0, c) == pytest.approx(0.2 * 1000 * 0.03)
    assert pe.recompute_tax_watts(-0.1, 1000.0, c) == 0.0
    assert pe.offload_saved_watts(500.0, c, 0.1) == pytest.approx(500 * (0.03 - 0.004))
    no_reload = pe.PhaseCosts(scope="gpu", prompt_computed_j=0.03, prompt_computed_se=0.001, generated_j=0.4,
                              generated_se=0.01, state="known", source="measured")
    assert pe.offload_saved_watts(500.0, no_reload, 0.1) == pytest.approx(500 * 0.03 * 0.9)
    assert pe.recompute_tax_watts(None, 1000.0, c) is None


# --- dE priced with the measured costs (derive/economics.py) ----------------------------------------------
def _stats(n=8):
    from exporter.derive.economics import WindowStat
    return [WindowStat(t0=0, t1=30, covered_seconds=30, generated_tokens=1000.0 + 50 * i, joules=4000.0 + 100 * i,
                       kv_p95=0.9, computed_prompt_tokens=2000.0, loaded_prompt_tokens=3000.0 + 200 * i, loaded=True,
                       prompt_tokens=9000.0)
            for i in range(n)]


def _costs(se_c, se_r, cov=0.0):
    return pe.PhaseCosts(scope="gpu", prompt_computed_j=0.03, prompt_computed_se=se_c, generated_j=0.4,
                         generated_se=0.01, reloaded_j=0.004, reloaded_se=se_r, windows=60, state="known", reason="",
                         source="measured", cov_prompt_reloaded=cov)


def test_estimated_uses_the_measured_prices():
    from exporter.derive import economics
    on = _stats()
    est = economics.estimated(on, None, 0.1, _costs(0.0, 0.0))
    rows = [(w.loaded_prompt_tokens * (0.03 - 0.004), w.joules + w.loaded_prompt_tokens * (0.03 - 0.004)) for w in on]
    assert est.value == pytest.approx(sum(s for s, _ in rows) / sum(e for _, e in rows))  # a ratio of sums
    # cost SE 0: the windows' jackknife alone
    assert est.stderr == pytest.approx(economics.jackknife_stderr(rows, lambda t: t[0] / t[1]))


def test_the_cost_uncertainty_widens_the_se_of_de():
    from exporter.derive import economics
    on = _stats()
    plain = economics.estimated(on, None, 0.1, _costs(0.0, 0.0)).stderr
    wide = economics.estimated(on, None, 0.1, _costs(0.006, 0.001)).stderr
    assert wide > plain
    # by hand: dE = S/(E+S) over the sums, S = L (c - r): d dE/dc = L E/(E+S)^2 = -d dE/dr
    big_l, big_e = sum(w.loaded_prompt_tokens for w in on), sum(w.joules for w in on)
    g = big_l * big_e / (big_e + big_l * 0.026) ** 2
    assert wide ** 2 == pytest.approx(plain ** 2 + g * g * (0.006 ** 2 + 0.001 ** 2), rel=1e-3)


def test_potential_prices_the_tax_with_the_measured_cost_and_the_prior_reload():
    from exporter.derive import economics
    off = _stats()
    # an OFF server's measured costs: no reloaded tokens, so no reload cost fitted (J_r = ratio x J_c, as the
    # saving kvwatt_offload_saved_watts prices it)
    off_costs = pe.PhaseCosts(scope="gpu", prompt_computed_j=0.03, prompt_computed_se=0.0, generated_j=0.4,
                              generated_se=0.01, reloaded_j=None, reloaded_se=None, windows=60, state="known",
                              reason="", source="measured")
    est = economics.potential(off, 0.1, None, 0.1, off_costs)
    saved = sum((w.computed_prompt_tokens - 0.1 * w.prompt_tokens) * 0.03 * 0.9 for w in off)
    assert est.windows == 8 and est.value == pytest.approx(saved / sum(w.joules for w in off))


# --- the learner in the model layer --------------------------------------------------------------------------
def _bucket_ivs(k, win, width=10.0):
    """One grid bucket's worth of 1 s intervals carrying the window ``win``'s tokens and energy."""
    n = int(width)
    return [Interval(t0=k * width + i, t1=k * width + i + 1,
                     deltas={"generation_tokens": win.generated / n, "prompt_local_compute": win.computed / n,
                             "prompt_local_cache_hit": 0.0, "prompt_external_kv_transfer": win.reloaded / n},
                     gauges={"kv_usage": 0.5}, energy_joules={"gpu": 100.0 + win.joules / n},
                     idle_joules={"gpu": 100.0}) for i in range(n)]


def test_the_learner_measures_from_grid_buckets_and_logs_the_change_once(caplog):
    from exporter.model.energy import PhaseLearner
    wins = phase_double.windows(40, TRUE, seed=9)
    ivs = [iv for k, w in enumerate(wins) for iv in _bucket_ivs(k, w)]
    learner = PhaseLearner(name="s", width=10.0, history_seconds=3600.0, min_windows=MIN_W, max_condition=MAX_COND,
                           load_to_compute_cost_ratio=0.1)
    with caplog.at_level("INFO", logger="kvwatt.energy"):
        for k in range(1, 41):  # one bucket completes per "tick"
            learner.observe(buckets_of([iv for iv in ivs if iv.t1 <= k * 10.0], 10.0))
    (gpu,) = learner.figures()
    assert (gpu.state, gpu.windows) == ("known", 40)
    assert abs(gpu.prompt_computed_j - TRUE[0]) <= 3.5 * gpu.prompt_computed_se
    changes = [r.getMessage() for r in caplog.records]
    assert len(changes) == 2, changes  # unknown -> not_identifiable (first window) -> known, not once per tick


@pytest.mark.parametrize("offload", [False, True])
def test_the_learners_running_sums_give_the_fit_over_the_windows_it_keeps(offload):
    """A 300 s history of 10 s windows (30 kept) fed 200: the refit from the sums kept as windows come and go
    (PhaseSums) is the fit over the windows kept, identical before the first leaves and through every recount."""
    from exporter.model.energy import PhaseLearner
    wins = phase_double.windows(200, TRUE, seed=5, offload=offload)
    ivs = [iv for k, w in enumerate(wins) for iv in _bucket_ivs(k, w)]
    learner = PhaseLearner(name="s", width=10.0, history_seconds=300.0, min_windows=MIN_W, max_condition=MAX_COND,
                           load_to_compute_cost_ratio=0.1)
    for k in range(1, 201):
        learner.observe(buckets_of([iv for iv in ivs if (k - 1) * 10.0 < iv.t1 <= k * 10.0], 10.0))
        kept = list(learner.windows["gpu"])
        assert len(kept) == min(k, 30)
        want, got = fit(kept), learner.costs["gpu"]
        assert (got.state, got.source, got.windows) == (want.state, want.source, want.windows), k
        for phase in ("prompt_computed", "generated", "reloaded"):
            for a, b, rel in ((got.joules(phase), want.joules(phase), 1e-9), (got.stderr(phase), want.stderr(phase),
                                                                               1e-6)):
                assert (a is None and b is None) or a == pytest.approx(b, rel=rel), (k, phase, a, b)
        if k <= 30:
            assert got == want, k  # no window has left yet: the very sums of a pass over the rows
    assert learner.sums["gpu"].removed < 30  # recounted as windows left


def test_a_stale_idle_gives_no_prior_rather_than_a_negative_price():
    ws = [pe.PhaseWindow(-50.0, 100.0, 10.0, 0.0)] * 3
    c = fit(ws)
    assert c.prompt_computed_j is None and "not positive" in c.reason


def test_a_new_engine_sets_the_measured_costs_aside():
    """A new evidence epoch (model/epoch.py): the windows priced the old engine's phases; back to the prior."""
    from exporter.model.energy import PhaseLearner
    learner = PhaseLearner(name="s", width=30.0, history_seconds=3600.0, min_windows=2, max_condition=100.0,
                           load_to_compute_cost_ratio=0.1)
    learner.windows["gpu"].extend(object() for _ in range(3))
    learner.set_aside()
    assert not learner.windows["gpu"] and learner.figures() == ()
    assert learner.costs["gpu"].source == "prior"
