"""The repeat windows kept as they complete (exporter/model/repeat.py) are the windows the grid holds: at every
tick the same WindowStats as reading every completed bucket of the window afresh (what a tick did before),
through the history's trimming and a bucket completed out of time order."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_store_columns import interval, stream  # noqa: E402

from exporter.derive import economics  # noqa: E402
from exporter.model.repeat import RepeatWindows  # noqa: E402
from exporter.samples import Interval  # noqa: E402
from exporter.store import ServerHistory  # noqa: E402

WIDTH = 30.0


def fresh(h: ServerHistory, now: float, seconds: float, marginal: bool) -> list[economics.WindowStat]:
    return economics.window_stats(h.buckets(WIDTH, now - seconds, now), WIDTH, "gpu", marginal)


def test_kept_repeat_windows_equal_the_grid_read_afresh_as_the_history_slides():
    h = ServerHistory(600.0, windows=(60.0,), grids=(WIDTH,))
    kept = {m: RepeatWindows(WIDTH, m) for m in (True, False)}
    checked = 0
    for k, iv in enumerate(stream(3000, dt=1.0, sparse=True)):
        h._append(iv)
        h.advance(iv.t1)
        if k % 7 == 0:
            for m, rw in kept.items():
                for seconds in (60.0, 300.0, 3600.0):
                    got = rw.within(h, iv.t1, seconds)
                    assert got == fresh(h, iv.t1, seconds, m), (k, m, seconds)
                    checked += len(got)
    assert checked > 1000
    assert len(kept[True]._t1) - kept[True]._head == len(h.buckets(WIDTH, -math.inf, math.inf)) < 25  # trimmed


def test_a_bucket_completed_out_of_time_order_is_taken_in():
    import random
    h = ServerHistory(math.inf, grids=(WIDTH,))
    rw = RepeatWindows(WIDTH, True)
    ivs = stream(100, dt=1.0)
    for iv in ivs[:40]:
        h._append(iv)
        h.advance(iv.t1)
    h.advance(1200.0)  # nothing read for a while
    assert rw.within(h, 1200.0, 3600.0) == fresh(h, 1200.0, 3600.0, True)
    h._append(Interval(t0=1150.0, t1=1201.0, deltas={"generation_tokens": 5.0}, gauges={"kv_usage": 0.5},
                       energy_joules={"gpu": 10.0}, idle_joules={}))
    h.advance(1250.0)
    assert rw.within(h, 1250.0, 3600.0) == fresh(h, 1250.0, 3600.0, True)
    late = interval(1100.0, 1105.0, random.Random(3))  # ends in a bucket no interval opened, behind a newer one
    h._append(late)
    h.advance(1260.0)
    assert h.grid(WIDTH).reorders == 1
    got = rw.within(h, 1260.0, 3600.0)
    assert [w.t0 for w in got][-2:] == [1080.0, 1200.0]
    assert got == fresh(h, 1260.0, 3600.0, True)
