"""Locating the KV-pressure threshold (derive/threshold.py, methods.md s10), against hand-worked cases."""

import random
from dataclasses import replace

import pytest

from exporter.derive.pressure_evidence import quantile_bounds, recorded_evidence
from exporter.derive.threshold import LocatedThreshold, PressurePoint, classify, locate, taxed


def pt(p95, pre=0.0, tax=0.0, se=None, weight=1.0, low=None, high=None, **kw):
    """A point; by default a clean one: preemptions counted and zero, a known tax of 0 (a clean point needs
    positive signs of low pressure, methods.md s10)."""
    return PressurePoint(evidence=recorded_evidence(p95=p95, preemptions_per_minute=pre, tax=tax, tax_se=se,
                                                    p95_low=low, p95_high=high, **kw), weight=weight)


def test_classify_needs_preemptions_or_a_tax_above_its_noise():
    assert classify(pt(0.5, pre=0.5)) is True          # methods.md s3 onset, inclusive
    assert classify(pt(0.5, pre=0.4)) is False
    assert classify(pt(0.5, pre=0.0, tax=0.10, se=0.02)) is True
    assert classify(pt(0.5, pre=0.0, tax=0.03, se=0.02)) is False  # inside 2 SE
    assert classify(pt(0.5, pre=0.0, tax=0.015, se=0.001)) is False  # above 2 SE but under 5 points
    assert classify(pt(0.5, pre=0.0, tax=0.025, se=0.007)) is False  # the 4-session window: 2.5 points, no preemption
    assert classify(pt(0.5, pre=None, tax=None)) is None
    assert classify(pt(0.5, pre=0.0, tax=-0.2, se=0.01)) is False  # a negative tax is no pressure
    assert taxed(pt(0.5, tax=0.06).evidence) and not taxed(pt(0.5, tax=0.04).evidence)  # unknown SE: 5 points


def test_clean_needs_positive_signs_and_waiting_for_capacity_is_pressure():
    # the busy-at-start windows (p95 0.76-0.84, no reference, no preemption that minute) were kept clean
    assert classify(pt(0.8, pre=0.0, tax=None, kv_max=0.9)) is None  # an unknown tax never makes a window clean
    assert classify(pt(0.8, pre=None, tax=-0.2)) is None  # preemptions not counted: no positive sign
    assert classify(pt(0.8, pre=0.0, tax=None, kv_max=0.9, capacity_share=1.0)) is True  # waited for KV
    assert classify(pt(0.1, pre=0.0, tax=None, kv_max=0.2, capacity_share=0.02)) is True  # any wait is pressure
    assert classify(pt(0.5, pre=0.0, tax=None, kv_max=0.6, capacity_share=0.0)) is False  # gauge read at zero
    assert classify(pt(0.5, pre=0.0, tax=None, kv_max=0.85, capacity_share=0.0)) is None  # came near full
    assert classify(pt(0.5, pre=0.0, tax=None, kv_max=0.6)) is None  # no capacity gauge: levels are no sign
    assert classify(pt(0.9, pre=0.0, tax=None, kv_max=0.95, residency="low_pressure")) is False


def test_vllm_cpu_block_sweep_locates_between_the_last_clean_and_first_taxed_p95():
    # the CPU engine's KV-size sweep: blocks 2000/512/256/192/128 -> p95 0.08/0.34/0.77/0.79/0.79, local_compute
    # 0.04/0.04/0.33/0.63/0.86, preemptions only at 128 blocks; reference 0.04, tax SE 0.01; 3 runs each
    sweep = [pt(0.08, 0, 0.0, 0.01, 3), pt(0.34, 0, 0.0, 0.01, 3), pt(0.77, 0, 0.29, 0.01, 3),
             pt(0.79, 0, 0.59, 0.01, 3), pt(0.79, 4.0, 0.82, 0.01, 3)]
    got = locate(sweep)
    assert replace(got, reason="") == LocatedThreshold(ratio=pytest.approx(0.555), low=0.34, high=0.77,
                                                       method="tax_onset", points=5, clean_below=6.0,
                                                       pressured_above=9.0, misplaced=0.0, state="provisional")
    assert got.reason == "interval [0.340, 0.770] wider than 0.30"  # 0.43 between the last clean and first taxed


def test_preemption_only_evidence_names_its_method():
    pts = [pt(0.3), pt(0.5), pt(0.6), pt(0.8, pre=2.0), pt(0.85, pre=5.0)]
    got = locate(pts)
    assert got.method == "preemption_onset"
    assert got.ratio == pytest.approx(0.7) and (got.low, got.high) == (0.6, 0.8)


def test_interval_widens_by_the_edge_points_own_p95_uncertainty():
    pts = [pt(0.3), pt(0.6, low=0.55, high=0.66), pt(0.8, pre=2.0, low=0.74, high=0.86), pt(0.9, pre=3)]
    got = locate(pts)
    assert (got.low, got.high) == (0.55, 0.86)
    assert got.ratio == pytest.approx(0.7)


def test_no_pressured_points_or_too_few_points_give_none():
    assert locate([pt(0.2), pt(0.5), pt(0.9)]) is None                     # no pressure at all
    assert locate([pt(0.2), pt(0.9, pre=3)]) is None                       # only 2 points
    assert locate([pt(0.2, pre=3), pt(0.5, pre=3), pt(0.9, pre=3)]) is None  # nothing clean below
    assert locate([pt(0.2), pt(0.5), pt(0.9, pre=3)], min_side=2) is None   # one pressured window only
    assert locate([pt(0.2), pt(0.5), pt(0.9, pre=3)], min_side=1) is not None
    assert locate([pt(0.2, None), pt(0.5, None), pt(0.9, pre=3)]) is None  # unknown points do not count


def test_an_isolated_pressured_window_at_low_p95_is_outvoted():
    pts = [pt(0.1), pt(0.15, pre=1.0), pt(0.2), pt(0.3), pt(0.4), pt(0.7, pre=2), pt(0.75, pre=3), pt(0.8, pre=3)]
    got = locate(pts)
    assert got.ratio == pytest.approx(0.55) and got.misplaced == 1.0 and got.points == 8


def test_mixed_band_spans_every_equally_good_cut():
    # C 0.3 | P 0.5 | C 0.6 | P 0.7 P 0.8: cutting after 0.3 or after 0.6 both misplace one window
    pts = [pt(0.2), pt(0.3), pt(0.5, pre=1), pt(0.6), pt(0.7, pre=1), pt(0.8, pre=1)]
    got = locate(pts)
    assert got.ratio == pytest.approx(0.4)  # the lowest cut
    assert (got.low, got.high) == (0.3, 0.7)


def test_no_cut_between_equal_p95_values():
    assert locate([pt(0.5), pt(0.5), pt(0.5, pre=2), pt(0.5, pre=2)]) is None


def test_quantile_bounds_bracket_the_true_p95_of_the_population():
    rng = random.Random(7)
    hits = 0
    for _ in range(400):
        s = sorted(rng.random() for _ in range(120))
        lo, hi = quantile_bounds(s, 0.95)
        hits += lo <= 0.95 <= hi
    assert 0.90 <= hits / 400 <= 0.995  # nominal 95 %
    assert quantile_bounds([], 0.95) is None
    assert quantile_bounds([0.4], 0.95) == (0.4, 0.4)
    s = [i / 100 for i in range(100)]
    lo, hi = quantile_bounds(s, 0.95)
    assert lo < 0.94 < 0.95 < hi  # the interval contains the point estimate
