"""Offload buffer sizing (methods.md s6): rates, residency, undersized, recommended size."""

from __future__ import annotations

import pytest

from exporter.derive import offload as O
from exporter.sources.expfmt import parse
from exporter.samples import Interval
from exporter.sources.vllm import extract
from exporter.store import ServerHistory
from tests.support import vllm_sim as sim
from tests.support.aggregates import aggregate_of

GIB = 2 ** 30


def iv(t0, t1, **deltas):
    return Interval(t0, t1, deltas, {})


def test_rates_hand_computed():
    data = [iv(0, 10, offload_store_bytes=5 * GIB, offload_load_bytes=1 * GIB),
            iv(10, 20, offload_store_bytes=3 * GIB, offload_load_bytes=1 * GIB)]
    r = O.transfer_rates(aggregate_of(data))
    assert r.write_bytes_per_second == pytest.approx(0.4 * GIB)  # 8 GiB / 20 s
    assert r.read_bytes_per_second == pytest.approx(0.1 * GIB)
    no_series = aggregate_of([iv(0, 10, generation_tokens=5)])
    assert O.transfer_rates(no_series).write_bytes_per_second is None


def test_residency_and_the_studys_observations():
    # methods.md s6: at up to 0.9 GiB/s, 32 GiB sufficed (35.6 s > 20 s); 8 GiB overflowed (8.9 s < 20 s)
    assert O.residency(32 * GIB, 0.9 * GIB) == pytest.approx(35.56, abs=0.01)
    assert O.residency(8 * GIB, 0.9 * GIB) == pytest.approx(8.89, abs=0.01)
    assert O.undersized(O.residency(32 * GIB, 0.9 * GIB), 0.9 * GIB, 0, 20.0) is False
    assert O.undersized(O.residency(8 * GIB, 0.9 * GIB), 0.9 * GIB, 0, 20.0) is True
    assert O.residency(None, 0.9 * GIB) is None
    assert O.residency(8 * GIB, 0.0) is None  # nothing written: unbounded, not exported


def test_undersized_logic():
    assert O.undersized(100.0, 1e9, 3.0, 20.0) is True     # stores failing although residency is fine
    assert O.undersized(None, None, 3.0, 20.0) is True
    assert O.undersized(None, None, None, 20.0) is None    # nothing known
    assert O.undersized(100.0, 1e9, None, 20.0) is False   # before 0.24: residency alone decides
    assert O.undersized(None, 0.0, None, 20.0) is False    # no writes, no failure counters
    assert O.undersized(None, None, 0.0, 20.0) is False    # buffer size unknown, no failures


def test_failures_sum_both_counters():
    data = [iv(0, 1, offload_allocation_failures=2, offload_stores_skipped=3), iv(1, 2, offload_stores_skipped=1)]
    assert O.store_failures(aggregate_of(data)) == 6
    assert O.store_failures(aggregate_of([iv(0, 1, offload_store_bytes=1)])) is None


def test_recommended_size_hand_computed():
    # 0.9 GiB/s x 20 s x 1.5 headroom = 27 GiB
    assert O.recommended_buffer(0.9 * GIB, 20.0, 1.5) == pytest.approx(27 * GIB)
    assert O.gib_ceil(27 * GIB + 1) == 28
    assert O.recommended_buffer(0.0, 20.0, 1.5) is None


@pytest.mark.parametrize("version", ["0.33", "0.24", "0.17"])
def test_undersized_scenario_end_to_end(version):
    """Both offload spellings, through the real parser and store: 8 GiB at 0.9 GiB/s is undersized."""
    eng = sim.SimEngine(sim.undersized_buffer_on(version=version))
    hist = ServerHistory(1000)
    for t in range(61):
        reading = extract(parse(eng.render()))
        hist.add_reading(float(t), reading)
        eng.advance(1.0)
    data = hist.window(60.0, 60.0)
    rates = O.transfer_rates(aggregate_of(data))
    assert rates.write_bytes_per_second == pytest.approx(0.9 * GIB, rel=0.01)
    res = O.residency(reading.info.offload_buffer_bytes, rates.write_bytes_per_second)
    assert res == pytest.approx(8 / 0.9, rel=0.01)
    failures = O.store_failures(aggregate_of(data))
    assert (failures is None) == (version == "0.17") and (failures or 0) >= (200 if version != "0.17" else 0)
    assert O.undersized(res, rates.write_bytes_per_second, failures, 20.0) is True
    assert O.gib_ceil(O.recommended_buffer(rates.write_bytes_per_second, 20.0, 1.5)) in (27, 28)  # ~27 GiB


def test_stable_large_buffer_is_not_undersized():
    ivs = sim.simulate_intervals(sim.stable_high_pressure_on(), 120)
    rates = O.transfer_rates(aggregate_of(ivs))
    # (compute 3.2 % x 24k + 2.4k generated) tok/s x 128 KiB = ~0.39 GiB/s -> 64 GiB lasts ~160 s
    assert rates.write_bytes_per_second == pytest.approx((0.032 * 24000 + 2400) * 131072, rel=0.02)
    res = O.residency(64 * GIB, rates.write_bytes_per_second)
    assert res > 150
    assert O.undersized(res, rates.write_bytes_per_second, O.store_failures(aggregate_of(ivs)), 20.0) is False
