"""Offload buffer sizing (methods.md s6): rates, residency, undersized, recommended size."""

from __future__ import annotations

import pytest

from exporter.derive import offload as O
from exporter.samples import Interval
from exporter.sources.expfmt import parse
from exporter.sources.vllm import extract
from exporter.store import ServerHistory
from tests.support import vllm_sim as sim
from tests.support.aggregates import aggregate_of

GIB = 2 ** 30


def iv(t0, t1, **deltas):
    return Interval(t0=t0, t1=t1, deltas=deltas, gauges={})


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
    assert O.flag_gib(27 * GIB) == 27 and O.flag_gib(27 * GIB + 1) == 28
    assert O.recommended_buffer(0.0, 20.0, 1.5) is None
    assert O.recommended_buffer(2e9, 1e300, 1.5) is None  # inf bytes: unknown, never an OverflowError later


MIB = 2 ** 20


def test_recommended_flag_is_fractional_gib_with_the_bytes_beside_it():
    """issue 37: --kv-offloading-size takes fractional GiB (0.0625 ran); whole GiB made 18 MiB a flag of 1."""
    assert O.flag_gib(18 * MIB) == 0.018  # 18 MiB = 0.01758 GiB, up to 2 significant digits
    assert O.flag_words(18 * MIB) == "0.018 (18 MiB)"
    assert O.flag_words(27 * GIB) == "27 (27 GiB)" and O.flag_words(None) is None


@pytest.mark.parametrize("n_bytes", [1.0, 4096.0, 18 * MIB, 0.0625 * GIB, 0.999 * GIB, GIB, 27 * GIB + 1,
                                     99.99 * GIB, 1.23e15, 2 ** 50 * 0.7])
def test_recommended_flag_never_under_the_bytes_nor_over_1_5x(n_bytes):
    gib = O.flag_gib(n_bytes)
    assert n_bytes <= gib * GIB <= 1.1 * n_bytes * (1 + 1e-12)
    assert float(O.flag_words(n_bytes).split()[0]) == gib  # the words state the value, as the flag takes it


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
    assert O.flag_gib(O.recommended_buffer(rates.write_bytes_per_second, 20.0, 1.5)) in (27, 28)  # ~27 GiB


def test_stable_large_buffer_is_not_undersized():
    ivs = sim.simulate_intervals(sim.stable_high_pressure_on(), 120)
    rates = O.transfer_rates(aggregate_of(ivs))
    # (compute 3.2 % x 24k + 2.4k generated) tok/s x 128 KiB = ~0.39 GiB/s -> 64 GiB lasts ~160 s
    assert rates.write_bytes_per_second == pytest.approx((0.032 * 24000 + 2400) * 131072, rel=0.02)
    res = O.residency(64 * GIB, rates.write_bytes_per_second)
    assert res > 150
    assert O.undersized(res, rates.write_bytes_per_second, O.store_failures(aggregate_of(ivs)), 20.0) is False


def _window(seconds: float, write: float, residency: float | None):
    from exporter.figures import WindowFigures
    return WindowFigures(f"{seconds:g}s", seconds, seconds, offload_write_bytes_per_second=write,
                         offload_buffer_residency_seconds=residency)


def test_the_figures_recommend_the_flag_in_fractional_gib():
    """issue 37: 0.6 MiB/s x 20 s x 1.5 = 18 MiB recommended was served as recommended_gib 1 (and the demo said
    --kv-offloading-size 1); now 0.018, the bytes beside it in the words, never above 1.5x the bytes."""
    from exporter.config import Config
    from exporter.model import offload as offload_figures
    cfg = Config(p99_tool_latency_seconds=20.0, buffer_headroom=1.5)
    b = offload_figures.buffer([_window(60, 0.6 * MIB, 5.0)], 0.0, cfg, 3 * MIB)
    assert b.recommended_bytes == pytest.approx(18 * MIB) and b.undersized is True
    assert b.recommended_gib == 0.018 and b.recommended_gib * GIB <= 1.5 * b.recommended_bytes
    assert b.recommended_words == "0.018 (18 MiB)"
    assert "--kv-offloading-size 0.018 (18 MiB) or more" in offload_figures.undersized_words(b, cfg)


def test_a_recommendation_above_a_sufficient_pool_says_why():
    """The verdict reads the shortest window's residency against the target; the recommendation sizes for the
    busiest window with the headroom. A 64 MiB pool holding 32 s of the 1m window's 2 MiB/s is not undersized
    (>= 20 s), yet the 5m window's 3 MiB/s x 20 s x 1.5 = 90 MiB: the words say so; below the pool, nothing."""
    from exporter.config import Config
    from exporter.model import offload as offload_figures
    cfg = Config(p99_tool_latency_seconds=20.0, buffer_headroom=1.5)
    windows = [_window(60, 2 * MIB, 32.0), _window(300, 3 * MIB, 64 / 3)]
    b = offload_figures.buffer(windows, 0.0, cfg, 64 * MIB)
    assert b.undersized is False and b.recommended_bytes == pytest.approx(90 * MIB) and b.recommended_gib == 0.088
    note = b.recommended_note
    assert "larger than the 64 MiB pool, which is not undersized" in note
    assert "busiest window (300s, writes at 3 MiB/s" in note and "2 MiB/s over the 60s the verdict reads" in note
    assert "p99 tool-call latency 20 s times 1.5 headroom" in note
    assert offload_figures.buffer(windows, 0.0, cfg, 128 * MIB).recommended_note == ""  # within the pool
    assert offload_figures.buffer([_window(60, 4 * MIB, 16.0)], 0.0, cfg, 64 * MIB).recommended_note == ""  # undersized


def test_the_page_states_the_flag_its_bytes_and_why_it_exceeds_the_pool():
    from exporter.serve.page import _buffer
    b = {"undersized": False, "write_bytes_per_second": 2 * MIB, "p99_tool_latency_seconds": 20.0,
         "residency_seconds": 32.0, "store_failures": 0, "recommended_bytes": 90 * MIB, "recommended_gib": 0.088,
         "recommended_words": "0.088 (90 MiB)", "headroom": 1.5, "residency_target_seconds": 20.0,
         "residency_target_source": "p99_tool_latency",
         "recommended_note": "the recommendation is larger than the 64 MiB pool, which is not undersized: ..."}
    html = _buffer({"offload_buffer": b, "offload_enabled": True, "offload_buffer_bytes": 64 * MIB})
    assert '<b data-field="recommended-buffer">0.088 GiB</b> (--kv-offloading-size 0.088 (90 MiB):' in html
    assert '<span data-field="recommended-note">(the recommendation is larger than the 64 MiB pool' in html
    assert "recommended-note" not in _buffer({"offload_buffer": {**b, "recommended_note": ""},
                                              "offload_enabled": True, "offload_buffer_bytes": 128 * MIB})
