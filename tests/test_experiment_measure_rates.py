"""The lab's window figures derive preemptions per minute as the daemon does (exporter/derive/pressure.py
rate_per_second: over the seconds of the intervals that carry the counter), not over the covered seconds, and
with the daemon's guard against a glitched counter (the window evidence's, derive/pressure_evidence.py)."""

from kvwatt_lab.experiment.measure import window_figures

from exporter.derive.pressure import plausible_preemptions, preemptions_per_minute, rate_per_second
from exporter.derive.pressure_evidence import window_evidence
from exporter.samples import Interval
from exporter.store import aggregate_of


def test_preemptions_per_minute_is_the_daemons_rate():
    # 60 s covered, but only the last 30 s carry vllm:num_preemptions_total (the counter appeared mid-window)
    intervals = [Interval(t0=t, t1=t + 1.0, deltas={"generation_tokens": 5.0},
                          gauges={"kv_usage": 0.5}) for t in range(30)]
    intervals += [Interval(t0=t, t1=t + 1.0, deltas={"generation_tokens": 5.0, "preemptions": 0.5},
                           gauges={"kv_usage": 0.5})
                  for t in range(30, 60)]
    figures = window_figures(intervals, min_load_seconds=30.0)
    assert figures["covered_seconds"] == 60.0
    assert figures["preemptions"] == 15.0
    assert figures["preemptions_per_minute"] == rate_per_second(aggregate_of(intervals), "preemptions") * 60.0 == 30.0


def test_no_preemption_counter_no_rate():
    intervals = [Interval(t0=t, t1=t + 1.0, deltas={"generation_tokens": 5.0},
                          gauges={"kv_usage": 0.5}) for t in range(10)]
    assert window_figures(intervals, min_load_seconds=30.0)["preemptions_per_minute"] is None


def test_a_glitched_preemption_counter_is_no_rate_as_in_the_daemon():
    # one read jumps the counter by 10^9 in a 60 s window of one running request: past what the engine could
    # have preempted (derive/pressure.py plausible_preemptions), so no rate, as the daemon's evidence window
    intervals = [Interval(t0=t, t1=t + 1.0, deltas={"generation_tokens": 5.0, "preemptions": 1e9 if t == 30 else 0.0},
                          gauges={"kv_usage": 0.5, "running": 1.0, "waiting": 0.0}) for t in range(60)]
    agg = aggregate_of(intervals)
    assert agg.delta("preemptions") > plausible_preemptions(agg)  # the probe: a glitch by the daemon's rule
    figures = window_figures(intervals, min_load_seconds=30.0)
    assert figures["preemptions_per_minute"] is None
    assert figures["preemptions_per_minute"] == preemptions_per_minute(agg)  # the daemon's figure
    assert figures["preemptions"] == 1e9  # the count as read stays in the run's record


def test_the_lab_reads_the_daemons_window_evidence():
    # p95, KV max and preemptions/min are the daemon's window evidence (derive/pressure_evidence.py)
    intervals = [Interval(t0=t, t1=t + 1.0,
                          deltas={"generation_tokens": 5.0, "preemptions": 1.0 if t % 10 == 0 else 0.0},
                          gauges={"kv_usage": t / 100.0, "running": 4.0, "waiting": 1.0}) for t in range(60)]
    ev = window_evidence(aggregate_of(intervals), window_seconds=60.0)
    figures = window_figures(intervals, min_load_seconds=30.0)
    assert (figures["kv_usage_p95_ratio"], figures["kv_usage_max_ratio"], figures["preemptions_per_minute"]) == (
        ev.p95.value, ev.kv_max, ev.preemptions_per_minute)
    assert figures["kv_usage_max_ratio"] == 0.59 and figures["preemptions_per_minute"] == 6.0
