"""The lab's window figures derive preemptions per minute as the daemon does (exporter/derive/pressure.py
rate_per_second: over the seconds of the intervals that carry the counter), not over the covered seconds."""

from kvwatt_lab.experiment.measure import window_figures

from exporter.derive.pressure import rate_per_second
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
