"""dE and dTPS (methods.md s2): hand-computed formulas, window cutting, the three kinds, and the nine Table 1
conditions as synthetic ON/OFF pairs (tests/support/vllm_sim.py TABLE1, table1_pair)."""

from __future__ import annotations

import math
import random
import zlib

import pytest

from exporter.derive import economics as E
from exporter.samples import Interval
from exporter.store import buckets_of
from tests.support import vllm_sim as sim


def stats(ivs, width, **kw):
    """The repeat windows of a list of intervals: the store's grid buckets, then one WindowStat each."""
    return E.window_stats(buckets_of(ivs, width), width, **kw)


def test_delta_method_hand_computed():
    # x_ON = 0.8 +- 0.01, x_OFF = 1.0 +- 0.02: dE = 0.2; SE = 0.8 sqrt((0.01/0.8)^2 + 0.02^2) = 0.018868
    de, se = E.saving(0.8, 0.01, 1.0, 0.02)
    assert de == pytest.approx(0.2) and se == pytest.approx(0.8 * math.sqrt(0.0125 ** 2 + 0.02 ** 2))
    assert se == pytest.approx(0.018868, abs=1e-6)
    # dTPS: 1.1 +- 0.011 over 1.0 +- 0.01: 0.1; SE = 1.1 sqrt(0.01^2 + 0.01^2) = 0.015556
    dt, se = E.gain(1.1, 0.011, 1.0, 0.01)
    assert dt == pytest.approx(0.1) and se == pytest.approx(0.015556, abs=1e-6)
    assert E.saving(0.8, None, 1.0, 0.02)[1] is None


def test_mean_and_stderr():
    assert E.mean_and_stderr([1.0, 2.0, 3.0]) == (2.0, pytest.approx(1.0 / math.sqrt(3)))
    assert E.mean_and_stderr([5.0]) == (5.0, None)
    assert E.mean_and_stderr([]) == (None, None)


def _iv(t0, t1, gen, joules, idle=100.0, kv=0.9, **more):
    return Interval(t0=t0, t1=t1, deltas={"generation_tokens": gen, **more}, gauges={"kv_usage": kv},
                    energy_joules={"gpu": joules} if joules is not None else {},
                    idle_joules={"gpu": idle} if idle is not None else {})


def test_window_stats_hand_computed():
    # 10 s intervals on a 30 s grid: window [0,30) has t1 = 10, 20, 30 -> t1=30 belongs to [0,30)
    ivs = [_iv(0, 10, 100, 500), _iv(10, 20, 100, 500), _iv(20, 30, 100, 500), _iv(30, 40, 50, 300, kv=0.97),
           _iv(40, 50, 50, None), _iv(50, 60, 50, 300)]
    w = stats(ivs, 30.0)
    assert [(x.t0, x.t1) for x in w] == [(0, 30), (30, 60)]
    assert w[0].joules == 1500 - 300 and w[0].joules_per_token == pytest.approx(1200 / 300)
    assert w[0].tokens_per_second == 10 and w[0].loaded
    assert w[1].joules is None and w[1].joules_per_token is None  # one interval lacked energy
    total = stats(ivs, 30.0, marginal=False)
    assert total[0].joules_per_token == 5.0
    assert stats(ivs[:2], 30.0)[0].loaded is False  # 20 of 30 s covered


def test_estimated_reaches_a_pre_016_server_through_the_prefix_cache_counters():
    """vLLM < 0.16 has no prompt_tokens_by_source: window_stats takes the token sources from
    recompute.token_counts' prefix-cache estimate, so the estimated dE exists for such a server too."""
    ivs = [Interval(t0=t, t1=t + 1, deltas={"generation_tokens": 50.0, "prefix_queries": 1000.0, "prefix_hits": 400.0,
                                            "external_prefix_hits": 250.0},
                    gauges={"kv_usage": 0.95}, energy_joules={"gpu": 500.0}, idle_joules={"gpu": 150.0})
           for t in range(120)]
    ws = stats(ivs, 60)
    assert [(w.computed_prompt_tokens, w.loaded_prompt_tokens, w.prompt_tokens) for w in ws] == \
        [(60 * 350.0, 60 * 250.0, 60 * 1000.0)] * 2
    est = E.estimated(ws, 0.02, 0.1)
    # per window: 350 J/s x 60 s marginal; saved 15,000 x 0.02 x 0.9 = 270 J -> dE = 270 / (21,000 + 270)
    assert est.windows == 2 and est.value == pytest.approx(270 / 21270)


def test_paired_uses_only_windows_where_both_carry_load():
    on = [E.WindowStat(t0=k * 60, t1=k * 60 + 60, covered_seconds=60, generated_tokens=1000, joules=80.0, kv_p95=0.9,
                       computed_prompt_tokens=10, loaded_prompt_tokens=100, loaded=True) for k in range(4)]
    off = [E.WindowStat(t0=k * 60, t1=k * 60 + 60, covered_seconds=60, generated_tokens=800, joules=100.0, kv_p95=0.9,
                        computed_prompt_tokens=50, loaded_prompt_tokens=0, loaded=True) for k in range(3)]
    # OFF idle in the 4th window
    off.append(E.WindowStat(t0=180, t1=240, covered_seconds=60, generated_tokens=0, joules=0.0, kv_p95=0.9,
                            computed_prompt_tokens=0, loaded_prompt_tokens=0, loaded=False))
    de, dt = E.paired(on, off)
    assert de.windows == 3 and dt.windows == 3
    # J/tok ON 0.08, OFF 0.125 -> dE = 1 - 0.64 = 0.36; TPS 1000/800 -> +25 %
    assert de.value == pytest.approx(0.36) and dt.value == pytest.approx(0.25)
    assert de.stderr == pytest.approx(0.0, abs=1e-12)  # identical repeats: zero spread


def test_recorded_band_by_band_hand_computed():
    profile = [E.BandProfile(lo=0.0, hi=0.9, windows=5, joules_per_token=0.10, joules_per_token_stderr=0.002,
                             tokens_per_second=1000.0, tokens_per_second_stderr=10.0),
               E.BandProfile(lo=0.9, hi=1.0, windows=5, joules_per_token=0.20, joules_per_token_stderr=0.004,
                             tokens_per_second=800.0, tokens_per_second_stderr=8.0)]
    on = ([E.WindowStat(t0=k, t1=k + 1, covered_seconds=1, generated_tokens=900, joules=0.09 * 900, kv_p95=0.85,
                        computed_prompt_tokens=0, loaded_prompt_tokens=0, loaded=True) for k in range(3)] +
          [E.WindowStat(t0=k, t1=k + 1, covered_seconds=1, generated_tokens=1000, joules=0.12 * 1000, kv_p95=0.95,
                        computed_prompt_tokens=0, loaded_prompt_tokens=0, loaded=True) for k in range(3, 4)])
    de, dt = E.recorded(on, profile)
    # the ON energy over what the profile's J/token gives for the same tokens band by band:
    # 1 - (3 x 81 + 120) / (2,700 x 0.10 + 1,000 x 0.20) = 1 - 363/470 (the mean of the windows' ratios gave 0.175)
    assert de.value == pytest.approx(1 - 363 / 470) and de.windows == 4 and de.reference_windows == 10
    # TPS: 3,700 tokens in 4 s against 3 s x 1,000 + 1 s x 800 -> 3700/3800 - 1
    assert dt.value == pytest.approx(3700 / 3800 - 1)
    # SE: the jackknife over the 4 ON windows (without a band-1 window 282/380, without the band-2 one 243/270)
    # and the profile's SEs through r x N_b / base x SE_b
    thetas = [282 / 380] * 3 + [243 / 270]
    m = sum(thetas) / 4
    jack = 3 / 4 * sum((t - m) ** 2 for t in thetas)
    r = 363 / 470
    assert de.stderr == pytest.approx(math.sqrt(jack + (r * 2700 / 470 * 0.002) ** 2 + (r * 1000 / 470 * 0.004) ** 2))
    assert set(de.bands) == {"0-0.9", "0.9-1"}
    assert de.bands["0-0.9"]["value"] == pytest.approx(0.1) and de.bands["0.9-1"]["value"] == pytest.approx(0.4)


def test_recorded_skips_bands_without_profile_data():
    profile = [E.BandProfile(lo=0.0, hi=0.95, windows=5, joules_per_token=0.1, joules_per_token_stderr=0.001,
                             tokens_per_second=1000.0, tokens_per_second_stderr=5.0),
               E.BandProfile(lo=0.95, hi=1.0, windows=0, joules_per_token=None, joules_per_token_stderr=None,
                             tokens_per_second=None, tokens_per_second_stderr=None)]
    on = [E.WindowStat(t0=k, t1=k + 1, covered_seconds=1, generated_tokens=900, joules=90.0, kv_p95=0.97,
                       computed_prompt_tokens=0, loaded_prompt_tokens=0, loaded=True) for k in range(3)]
    de, _ = E.recorded(on, profile)
    assert de.value is None and de.windows == 0 and "0.95-1" in de.note


def test_estimated_hand_computed():
    # marginal 100 J, 1000 loaded tokens x 0.05 J x (1 - 0.1) = 45 J saved -> dE = 45 / 145
    w = E.WindowStat(t0=0, t1=60, covered_seconds=60, generated_tokens=500, joules=100.0, kv_p95=0.9,
                     computed_prompt_tokens=30, loaded_prompt_tokens=1000, loaded=True)
    est = E.estimated([w, w], 0.05, 0.1)
    assert est.value == pytest.approx(45 / 145) and est.stderr == 0.0 and est.windows == 2
    assert est.kind == "estimated" and "estimate" in est.note
    assert E.estimated([w], None, 0.1).value is None


def test_estimated_from_the_simulated_on_server():
    """Stable ON run: 16.5 % of 24k prompt tok/s reloaded; priced at a known J per computed token."""
    ivs = sim.simulate_intervals(sim.stable_high_pressure_on(), 300)
    ws = stats(ivs, 60)
    est = E.estimated(ws, 0.02, 0.1)
    # per second: 500 W - 150 W idle = 350 J marginal; saved 0.165 x 24,000 x 0.02 J x 0.9 = 71.3 J
    saved = 0.165 * 24000 * 0.02 * 0.9
    assert est.value == pytest.approx(saved / (350 + saved), rel=0.03)
    assert est.windows >= 4


# --- Table 1 -----------------------------------------------------------------------------------------------
def _table1_windows(cond, seed=None):
    on, off = sim.table1_pair(cond, seed=seed)
    seconds = sim.TABLE1_WINDOWS * 60
    return (stats(sim.simulate_intervals(on, seconds), 60),
            stats(sim.simulate_intervals(off, seconds), 60))


@pytest.mark.parametrize("cond", sim.TABLE1, ids=[c.name for c in sim.TABLE1])
def test_table1_paired_lands_within_the_stated_uncertainty(cond):
    on, off = _table1_windows(cond)
    de, dt = E.paired(on, off)
    assert de.windows == dt.windows == sim.TABLE1_WINDOWS
    # within two SEs, the condition's or the one reported (this seed's office c=4 spreads wider than encoded:
    # 11.3 points reported for 6.2 encoded, and lands 13 points low)
    assert abs(de.value * 100 - cond.dE_pct) <= 2 * max(cond.dE_se_pct, de.stderr * 100), (de, cond)
    assert abs(dt.value * 100 - cond.dTPS_pct) <= 2 * max(cond.dTPS_se_pct, dt.stderr * 100), (dt, cond)
    # and the SE it reports is the uncertainty the condition states, within a jackknife's own spread over 12
    # windows (1/sqrt(2 x 11) = 21 % a sd; this seed's office c=4 reads 1.8x: its windows spread wider than
    # encoded, the delta method's SE of means read 1.5x): the calibration is
    # test_table1_paired_is_unbiased_and_calibrated's
    assert 0.5 <= de.stderr * 100 / cond.dE_se_pct <= 2.0
    assert 0.5 <= dt.stderr * 100 / cond.dTPS_se_pct <= 2.0


@pytest.mark.parametrize("cond", sim.TABLE1, ids=[c.name for c in sim.TABLE1])
def test_table1_recorded_against_an_off_profile(cond):
    _, off_profile_run = _table1_windows(cond, seed=zlib.crc32(cond.name.encode()) % 1000 + 5000)  # a separate OFF run
    profile = E.build_bands(off_profile_run, [(0.0, 1.0)])  # one band: the synthetic J/token has no KV slope
    on, _ = _table1_windows(cond)
    de, dt = E.recorded(on, profile)
    assert abs(de.value * 100 - cond.dE_pct) <= 3 * cond.dE_se_pct
    assert abs(dt.value * 100 - cond.dTPS_pct) <= 3 * cond.dTPS_se_pct


def test_table1_paired_is_unbiased_and_calibrated():
    """Monte Carlo over the sim's noise model (J and TPS x (1 + N(0, cv)) per window): the mean of 400
    estimates sits on the encoded value and the +-1.96 SE interval covers it ~95 % of the time."""
    cond = sim.TABLE1[4]  # office c=4: the noisiest of the study's conditions
    cv_e, cv_t = sim.table1_noise_ratio(cond)
    rng = random.Random(0)
    n, est, covered = sim.TABLE1_WINDOWS, [], 0
    for _ in range(400):
        def windows(j, tps):
            return [E.WindowStat(t0=k, t1=k + 1, covered_seconds=1.0, generated_tokens=tps * (1 + rng.gauss(0, cv_t)),
                                 joules=None, kv_p95=0.9, computed_prompt_tokens=0, loaded_prompt_tokens=0,
                                 loaded=True) for k in range(n)], [j * (1 + rng.gauss(0, cv_e)) for _ in range(n)]
        on, j_on = windows(0.15 * (1 - cond.dE_pct / 100), 2000 * (1 + cond.dTPS_pct / 100))
        off, j_off = windows(0.15, 2000.0)
        on = [E.WindowStat(t0=w.t0, t1=w.t1, covered_seconds=1.0, generated_tokens=w.generated_tokens,
                           joules=j * w.generated_tokens, kv_p95=0.9, computed_prompt_tokens=0, loaded_prompt_tokens=0,
                           loaded=True)
              for w, j in zip(on, j_on)]
        off = [E.WindowStat(t0=w.t0, t1=w.t1, covered_seconds=1.0, generated_tokens=w.generated_tokens,
                            joules=j * w.generated_tokens, kv_p95=0.9, computed_prompt_tokens=0, loaded_prompt_tokens=0,
                            loaded=True)
               for w, j in zip(off, j_off)]
        de, _ = E.paired(on, off)
        est.append(de.value)
        covered += abs(de.value - cond.dE_pct / 100) <= 1.96 * de.stderr
    mean = sum(est) / len(est)
    assert mean * 100 == pytest.approx(cond.dE_pct, abs=3 * cond.dE_se_pct / math.sqrt(400) + 0.2)
    assert 0.88 <= covered / 400 <= 0.98
