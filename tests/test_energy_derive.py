"""Energy per token (methods.md s1) and the prompt-token attribution model, on hand-computed numbers."""

from __future__ import annotations

import pytest

from exporter.derive.energy import per_token, prompt_attribution, window_energy
from exporter.samples import Interval
from tests.support.aggregates import aggregate_of


def iv(t0, t1, tokens, energy=None, idle=None, running=1.0, **deltas):
    return Interval(t0=t0, t1=t1, deltas={"generation_tokens": tokens, **deltas}, gauges={"running": running},
                    energy_joules=dict(energy or {}), idle_joules=dict(idle or {}))


def window():
    return [
        iv(0, 10, 500, {"gpu": 3000.0, "host": 900.0}, {"gpu": 1000.0, "host": 400.0}),
        iv(10, 20, 700, {"gpu": 3500.0, "host": 1000.0}, {"gpu": 1000.0, "host": 400.0}),
        iv(20, 30, 1000, {"host": 1100.0}, {"host": 400.0}),  # GPU sample missing in this span
        iv(30, 40, 300, {"gpu": 2600.0, "host": 700.0}, {"gpu": 1000.0, "host": 400.0}),
    ]


def test_gpu_figures_only_over_intervals_with_a_sample():
    w = per_token(aggregate_of(window()), "gpu", min_load_seconds=30)
    # E = 3000 + 3500 + 2600 = 9100 J, P_idle*dt = 3000 J, N = 500 + 700 + 300 = 1500 (not 2500), dt = 30 s
    assert (w.energy_joules, w.idle_joules, w.tokens, w.seconds) == (9100.0, 3000.0, 1500.0, 30.0)
    assert w.joules_per_token == pytest.approx(9100 / 1500)  # 6.0667
    assert w.marginal_joules_per_token == pytest.approx(6100 / 1500)  # 4.0667


def test_host_scope_is_separate():
    w = per_token(aggregate_of(window()), "host", min_load_seconds=30)
    assert w.joules_per_token == pytest.approx(3700 / 2500)
    assert w.marginal_joules_per_token == pytest.approx((3700 - 1600) / 2500)


def test_no_figure_without_enough_load_or_tokens():
    assert per_token(aggregate_of(window()), "gpu", min_load_seconds=31) is None  # 30 s of load < 31
    idle_window = [iv(0, 60, 0, {"gpu": 6000.0}, {"gpu": 6000.0}, running=0.0)]
    # no load, no tokens: absent, not inf
    assert per_token(aggregate_of(idle_window), "gpu", min_load_seconds=30) is None
    running_no_tokens = [iv(0, 60, 0, {"gpu": 9000.0}, {"gpu": 6000.0}, running=4.0)]
    assert window_energy(aggregate_of(running_no_tokens), "gpu").loaded_seconds == 60.0
    assert per_token(aggregate_of(running_no_tokens), "gpu", min_load_seconds=30) is None  # zero tokens
    assert per_token(aggregate_of([]), "gpu", 0) is None
    assert per_token(aggregate_of(window()), "nope", 0) is None


def test_load_counts_tokens_or_running_requests():
    ivs = [iv(0, 20, 100, {"gpu": 100.0}, running=0.0),  # tokens, nothing running at the end: loaded
           iv(20, 40, 0, {"gpu": 100.0}, running=2.0),  # running, no token yet: loaded
           iv(40, 60, 0, {"gpu": 100.0}, running=0.0)]  # idle
    assert window_energy(aggregate_of(ivs), "gpu").loaded_seconds == 40.0
    assert per_token(aggregate_of(ivs), "gpu", min_load_seconds=40).joules_per_token == pytest.approx(3.0)


def test_marginal_absent_without_a_baseline_total_still_there():
    ivs = window()
    ivs[1] = iv(10, 20, 700, {"gpu": 3500.0})  # no idle_joules: a device had no baseline
    w = per_token(aggregate_of(ivs), "gpu", min_load_seconds=30)
    assert w.marginal_joules_per_token is None and w.joules_per_token == pytest.approx(9100 / 1500)


def test_stale_baseline_gives_negative_marginal_not_clamped():
    ivs = [iv(0, 30, 100, {"gpu": 2000.0}, {"gpu": 3000.0})]
    assert per_token(aggregate_of(ivs), "gpu", 30).marginal_joules_per_token == pytest.approx(-10.0)


def test_prompt_attribution_model():
    ivs = [iv(t, t + 10, tokens, {"gpu": e}, {"gpu": 1000.0}, prompt_local_compute=200.0,
              prompt_local_cache_hit=5000.0, prompt_external_kv_transfer=1000.0)
           for t, tokens, e in ((0, 500, 3000.0), (10, 700, 3500.0), (30, 300, 2600.0))]
    ivs.insert(2, iv(20, 30, 1000, {}, prompt_local_compute=99999.0))  # no GPU sample: excluded entirely
    got = prompt_attribution(aggregate_of(ivs), min_load_seconds=30, load_to_compute_cost_ratio=0.1)
    # marginal 6100 J over units 1500 generated + 600 computed + 0.1 * 3000 reloaded = 2400
    assert got == {"local_compute": pytest.approx(6100 / 2400),
                   "external_kv_transfer": pytest.approx(0.1 * 6100 / 2400)}
    assert prompt_attribution(aggregate_of(ivs), 31, 0.1) is None
    no_sources = [iv(0, 40, 100, {"gpu": 4000.0}, {"gpu": 1000.0})]
    assert prompt_attribution(aggregate_of(no_sources), 30, 0.1) is None
