"""The figures priced beyond the energy spent, and the dE and hit ratios above 1 (each failed before its fix):
the prior's price per token respects that a computed prompt token costs a fraction of a generated one and never
prices beyond a window's energy; tokens, seconds and energy come from the same intervals; windows with E <= 0
stay out of dE; a tier's hits never exceed its lookups (methods.md s12, s2; docs/offload.md)."""

from __future__ import annotations

import json

import pytest

from exporter.derive import economics, offload
from exporter.derive import energy as derive_energy
from exporter.derive import phase_energy as pe
from exporter.derive.economics import WindowStat
from exporter.recording import profile as profile_mod
from exporter.samples import Interval
from tests.support.aggregates import aggregate_of

RATIO = 0.1  # load_to_compute_cost_ratio


def iv(t: float, computed: float, generated: float, reloaded: float = 0.0, cached: float = 0.0,
       joules: float | None = 400.0, idle: float = 340.0) -> Interval:
    """One 1 s interval; ``joules`` None: no GPU energy sample for it (NVML failed)."""
    energy = {} if joules is None else {"gpu": joules}
    return Interval(t0=t, t1=t + 1.0, deltas={"generation_tokens": generated, "prompt_local_compute": computed,
                                              "prompt_local_cache_hit": cached,
                                              "prompt_external_kv_transfer": reloaded},
                    gauges={"kv_usage": 0.95}, energy_joules=energy,
                    idle_joules={} if joules is None else {"gpu": idle})


def test_the_prior_prices_a_computed_prompt_token_at_a_fraction_of_a_generated_one():
    decode_heavy = [pe.PhaseWindow(3000.0, 200.0, 1000.0, 0.0)] * 30
    c = pe.prior_costs(decode_heavy, "gpu", RATIO)
    assert c.prompt_computed_j == pytest.approx(pe.PRIOR_PROMPT_TO_GENERATED_COST_RATIO * c.generated_j)
    assert c.prompt_computed_j < c.generated_j
    assert c.reloaded_j == pytest.approx(RATIO * c.prompt_computed_j)
    # the windows' energy is all priced: sum of tokens x costs = sum of marginal joules
    assert 30 * (200 * c.prompt_computed_j + 1000 * c.generated_j) == pytest.approx(30 * 3000.0)


def test_a_decode_heavy_prior_never_prices_a_prompt_heavy_window_beyond_its_energy():
    """A decode-heavy hour prices a token at 3 J; the window recomputes 5,000 prompt tokens/s at 60 W."""
    prior = pe.PhaseCosts(scope="gpu", prompt_computed_j=3.0, prompt_computed_se=None, generated_j=3.0,
                          generated_se=None, reloaded_j=0.3, reloaded_se=None, windows=120, state="not_identifiable",
                          reason="", source="prior")
    agg = aggregate_of([iv(t, computed=5000.0, generated=10.0, cached=200.0) for t in range(30)])
    fig = derive_energy.tax_in_energy(agg, 0.05, [prior], False, RATIO)
    marginal = 60.0
    assert 0 < fig["recompute_tax_watts"]["gpu"] <= marginal
    assert 0 < fig["recompute_energy_share"]["gpu"] <= 1.0


def test_the_saving_never_prices_beyond_the_window_energy():
    prior = pe.PhaseCosts(scope="gpu", prompt_computed_j=3.0, prompt_computed_se=None, generated_j=3.0,
                          generated_se=None, reloaded_j=0.3, reloaded_se=None, windows=120, state="not_identifiable",
                          reason="", source="prior")
    agg = aggregate_of([iv(t, computed=100.0, generated=10.0, reloaded=4000.0) for t in range(30)])
    fig = derive_energy.tax_in_energy(agg, 0.05, [prior], True, RATIO)
    assert 0 < fig["offload_saved_watts"]["gpu"] <= 60.0


def test_tokens_seconds_and_energy_come_from_the_same_intervals():
    """NVML fails during a recompute burst: exact measured costs, yet the tax was 21.7x the marginal power."""
    exact = pe.PhaseCosts(scope="gpu", prompt_computed_j=0.01, prompt_computed_se=0.0001, generated_j=0.05,
                          generated_se=0.001, reloaded_j=None, reloaded_se=None, windows=120, state="known", reason="",
                          source="measured")
    steady = [iv(t, computed=100.0, generated=1000.0, cached=900.0, joules=340.0 + 1.0 + 50.0) for t in range(20)]
    burst = [iv(20.0 + t, computed=600_000.0, generated=100.0, joules=None) for t in range(10)]
    fig = derive_energy.tax_in_energy(aggregate_of(steady + burst), 0.05, [exact], False, RATIO)
    share = fig["recompute_energy_share"]
    assert share is not None and 0 <= share["gpu"] <= 1.0, share
    # the tax of the intervals with energy: (local_compute share 0.1 - reference 0.05) x 1,000 prompt tokens/s
    # x 0.01 J (the burst without energy is in neither the tokens, nor the seconds, nor the energy)
    assert fig["recompute_tax_watts"]["gpu"] == pytest.approx(0.05 * 1000.0 * 0.01)
    assert share["gpu"] == pytest.approx(0.5 / 51.0)


def _stat(joules: float, gen: float = 1000.0, computed: float = 2000.0, loaded: float = 0.0,
          prompt: float = 3000.0, kv: float = 0.5) -> WindowStat:
    return WindowStat(t0=0.0, t1=30.0, covered_seconds=30.0, generated_tokens=gen, joules=joules, kv_p95=kv,
                      computed_prompt_tokens=computed, loaded_prompt_tokens=loaded, loaded=True, prompt_tokens=prompt)


def test_the_potential_de_never_exceeds_one():
    """An OFF server priced at a decode-heavy prior: the tax tokens cost more than the window spent."""
    off = [_stat(joules=500.0, computed=2000.0, prompt=2100.0) for _ in range(5)]
    est = economics.potential(off, 0.05, 3.0, RATIO)
    assert est.value is not None and est.value <= 1.0, est


def test_paired_de_leaves_out_windows_with_no_positive_energy():
    """A stale P_idle on the OFF GPU: its marginal J/token is <= 0, and dE was 3.61, verdict saves."""
    on = [WindowStat(t0=30.0 * i, t1=30.0 * i + 30, covered_seconds=30.0, generated_tokens=1000.0, joules=500.0,
                     kv_p95=0.5, computed_prompt_tokens=0.0, loaded_prompt_tokens=0.0, loaded=True,
                     prompt_tokens=0.0) for i in range(4)]
    off = [WindowStat(t0=30.0 * i, t1=30.0 * i + 30, covered_seconds=30.0, generated_tokens=1000.0, joules=-190.0,
                      kv_p95=0.5, computed_prompt_tokens=0.0, loaded_prompt_tokens=0.0, loaded=True,
                      prompt_tokens=0.0) for i in range(4)]
    energy, _ = economics.paired(on, off)
    assert energy.value is None or energy.value <= 1.0
    assert energy.value is None and energy.windows == 0


def test_recorded_de_leaves_out_a_band_with_no_positive_energy():
    on = [_stat(joules=500.0) for _ in range(4)]
    band = economics.BandProfile(lo=0.0, hi=0.8, windows=6, joules_per_token=-0.2, joules_per_token_stderr=0.01,
                                 tokens_per_second=100.0, tokens_per_second_stderr=1.0)
    energy, _ = economics.recorded(on, [band])
    assert energy.value is None


def test_baseline_record_writes_no_negative_band_that_run_refuses():
    """Windows with E <= 0 (a stale P_idle while recording) stay out of the band: the profile loads."""
    windows = [_stat(joules=-300.0, kv=0.5) for _ in range(4)] + [_stat(joules=100.0, kv=0.5)]
    (band, *_) = economics.build_bands(windows)
    assert band.joules_per_token is None or band.joules_per_token > 0
    prof = profile_mod.Profile(server="off", model_name="m", offload_enabled=False,
                               recorded_at="2026-11-27T00:00:00Z", duration_seconds=150.0, window_seconds=30.0,
                               bands=tuple(economics.build_bands(windows)))
    profile_mod.from_json(json.loads(json.dumps(profile_mod.to_json(prof))), "profile.json")  # no ConfigError


def test_a_tier_chunk_hit_ratio_never_exceeds_one():
    agg = aggregate_of([Interval(t0=t, t1=t + 1.0, deltas={"tier_chunk_queries@1:fs": 10.0,
                                                           "tier_chunk_hits@1:fs": 30.0,
                                                           "tier_write_bytes@1:fs": 1e6}, gauges={})
                        for t in range(3)])
    (flows,) = offload.tier_flows(agg)
    assert flows.chunk_hit_ratio is None or flows.chunk_hit_ratio <= 1.0


def test_the_estimated_de_never_exceeds_one_when_a_reload_costs_more_than_recomputing():
    """Found by bench/fuzz_bounds.py (seed 20261127, 32 of 82,976 ticks): measured costs with a reload dearer
    than a recomputation make the saving negative; where it is larger than the window's energy, the estimated
    OFF energy E + saved is <= 0 and dE = saved / (E + saved) came out above 1. Such a window stays out."""
    costs = pe.PhaseCosts(scope="gpu", prompt_computed_j=0.01, prompt_computed_se=0.001, generated_j=0.4,
                          generated_se=0.01, reloaded_j=0.05, reloaded_se=0.001, windows=60, state="known", reason="",
                          source="measured")
    on = [_stat(joules=10.0, computed=0.0, loaded=1000.0, prompt=1000.0) for _ in range(4)]
    est = economics.estimated(on, None, RATIO, costs)
    assert est.value is None or est.value <= 1.0, est
    fine = [_stat(joules=100.0, computed=0.0, loaded=1000.0, prompt=1000.0) for _ in range(4)]
    assert economics.estimated(fine, None, RATIO, costs).value < 0  # a reload that costs: dE < 0, kept
