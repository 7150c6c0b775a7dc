"""The store keeps intervals as columns (exporter/store/columns.py, docs/architecture.md "Windows"): what it
gives back equals what went in, its memory per interval is small and it adds nothing per interval for the
garbage collector to walk; completed grid buckets stay exact when a late interval thaws them."""

from __future__ import annotations

import gc
import math
import random
import tracemalloc

import pytest

from exporter.samples import Interval
from exporter.store import Grid, ServerHistory, aggregate_of, buckets_of

COUNTERS = tuple(f"counter_{i}" for i in range(28)) + ("generation_tokens",)
GAUGES = ("running", "waiting", "waiting_capacity", "waiting_deferred", "kv_usage")


def interval(t0: float, t1: float, rng: random.Random, sparse: bool = False) -> Interval:
    keep = (lambda: rng.random() < 0.7) if sparse else (lambda: True)
    deltas = {k: float(rng.randint(0, 50)) for k in COUNTERS if keep()}
    gauges = {k: float(rng.randint(0, 40)) for k in GAUGES if keep()}
    gauges["kv_usage"] = rng.random()
    energy = {"gpu": 100.0 * (t1 - t0)} if keep() else {}
    idle = {"gpu": 20.0 * (t1 - t0)} if energy and keep() else {}
    return Interval(t0=t0, t1=t1, deltas=deltas, gauges=gauges, energy_joules=energy, idle_joules=idle)


def feed(h: ServerHistory, ivs: list[Interval]) -> None:
    for iv in ivs:
        h._append(iv)
        h.advance(iv.t1)


def stream(n: int, dt: float = 0.25, seed: int = 1, sparse: bool = False) -> list[Interval]:
    rng = random.Random(seed)
    return [interval(1000.0 + k * dt, 1000.0 + (k + 1) * dt, rng, sparse) for k in range(n)]


def test_rows_read_back_equal_to_what_was_appended_keys_coming_and_going():
    ivs = stream(3000, sparse=True)
    ivs[1200] = Interval(t0=ivs[1200].t0, t1=ivs[1200].t1, deltas={"generation_tokens": math.nan},
                         gauges={"kv_usage": 0.5})
    h = ServerHistory(200.0, windows=(10.0, 100.0), grids=(5.0,))
    feed(h, ivs)
    kept = [iv for iv in ivs if iv.t1 >= ivs[-1].t1 - 200.0]
    got = list(h.intervals)
    assert len(got) == len(h.intervals) == len(kept)
    for a, b in zip(got, kept):  # NaN != NaN: compare the maps' keys and non-NaN values
        assert (a.t0, a.t1, a.energy_joules, a.idle_joules) == (b.t0, b.t1, b.energy_joules, b.idle_joules)
        assert a.deltas.keys() == b.deltas.keys() and a.gauges == b.gauges
    assert h.intervals[-1] is ivs[-1] and h.intervals[0] == kept[0]
    now = ivs[-1].t1
    for w in (10.0, 100.0):
        assert h.window(now, w) == [iv for iv in kept if iv.t0 >= now - w - 1e-6]
        agg, ref = h.aggregate(w), aggregate_of(h.window(now, w))
        assert list(agg.intervals) == list(ref.intervals)
        for k in COUNTERS:
            assert agg.delta(k) == ref.delta(k) and agg.count_with(k) == ref.count_with(k)
        for g in ("kv_usage", "pending", "running", "waiting", "waiting_capacity"):
            assert list(agg.sorted_gauge(g)) == list(ref.sorted_gauge(g))


def test_columns_cut_their_dead_prefix_often():
    """Rows dropped from the head leave the columns while they are still a small part of them."""
    from exporter.store.columns import CHUNK, IntervalColumns
    store = IntervalColumns()
    for iv in stream(5000):
        store.append(iv)
        if len(store) > 1000:
            store.popleft()
    held = len(store._t0) * CHUNK
    assert len(store) == 1000 and held <= 1000 + 2 * CHUNK
    assert all(len(chunks) == len(store._t0) for cols in store._cols for chunks in cols.values())


def _history_of(n: int) -> ServerHistory:
    h = ServerHistory(math.inf, windows=(60.0, 3600.0), grids=(30.0, 60.0))
    feed(h, stream(n))
    return h


def test_an_hour_of_intervals_costs_a_few_hundred_bytes_each():
    """36 values an interval, windows [1m, 1h] and two grids: under 600 bytes an interval in all (an Interval
    object with four dicts was ~2.8 KB)."""
    n = 4000
    tracemalloc.start()
    try:
        h = ServerHistory(math.inf, windows=(60.0, 3600.0), grids=(30.0, 60.0))
        before = tracemalloc.get_traced_memory()[0]
        feed(h, stream(n))  # the intervals are made here, as readings make them: the history's only
        per_interval = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    assert per_interval < 600, per_interval


def test_no_tracked_object_per_interval():
    """A full collection walks every tracked object: the history adds none per interval (buckets add a few
    per bucket, not per interval)."""
    h = _history_of(100)
    gc.collect()
    gc.collect()
    n0 = len(gc.get_objects())
    ivs = stream(4000, seed=2)[100:]  # times continue after the first 100
    feed(h, ivs)
    n, buckets = len(ivs), sum((ivs[-1].t1 - ivs[0].t0) / w for w in h.grids)
    del ivs  # the history's only
    gc.collect()
    gc.collect()
    grown = len(gc.get_objects()) - n0
    from exporter.store.columns import CHUNK
    chunks = (len(COUNTERS) + len(GAUGES) + 4) * (n / CHUNK + 1)  # an array per column per chunk of rows
    assert grown < 4 * buckets + chunks < n / 2, (grown, buckets, chunks)  # one per interval: 3,900; a bucket packs


def test_a_late_interval_thaws_a_completed_bucket_and_keeps_it_exact():
    ivs = stream(40, dt=1.0, sparse=True)
    grid = Grid(10.0)
    for iv in ivs[:25]:
        grid.add(iv)
    grid.close(ivs[24].t1)
    b = grid.done[-1]
    assert b.agg._frozen
    late = Interval(t0=ivs[24].t1, t1=b.t1, deltas={"generation_tokens": 7.0}, gauges={"kv_usage": 0.9, "running": 3.0})
    grid.add(late)  # ends in the bucket already completed
    assert not b.agg._frozen
    ref = [x for x in buckets_of([*ivs[:25], late], 10.0) if x.t0 == b.t0][0]
    assert b.agg.delta("generation_tokens") == ref.agg.delta("generation_tokens")
    assert b.agg.count_with("generation_tokens") == ref.agg.count_with("generation_tokens")
    assert list(b.agg.sorted_gauge("kv_usage")) == list(ref.agg.sorted_gauge("kv_usage"))


def _bucket_readings(agg) -> tuple:
    """Everything a reader of a completed bucket asks (window_stat, the threshold and phase learners, the
    collapse reference): the same numbers whether the bucket is live or packed."""
    scopes = []
    for name in ("gpu", "host"):
        sc = agg.scope(name)
        scopes.append(None if sc is None else (
            sc.n, sc.covered_seconds, sc.loaded_seconds, sc.energy_joules, sc.idle_n, sc.idle_joules,
            sc.idle_subset_seconds, sc.idle_subset_energy_joules, sc.idle_subset_idle_joules,
            [(k, sc.delta(k), sc.count_with(k), sc.seconds_with(k)) for k in sc.keys()]))
    gauges = [(k, list(agg.sorted_gauge(k)), agg.quantile(k, 0.95), agg.gauge_max(k), agg.gauge_count(k))
              for k in (*GAUGES, "pending", "waiting_deferred", "kv_pool_usage@cpu")]
    return (agg.n, len(agg), agg.covered_seconds, agg.loaded_seconds, agg.pools(),
            [(k, agg.delta(k), agg.count_with(k), agg.seconds_with(k)) for k in (*agg.keys(), "absent")],
            scopes, gauges, list(agg))


@pytest.mark.parametrize("sparse", [True, False])  # dense: the energy scope shares the bucket's counter sums
def test_a_store_keeps_completed_buckets_packed_and_they_read_as_the_live_ones(sparse):
    """A history's completed bucket is one array (store/packed.py), not ~22 objects, and reads exactly as the
    aggregate it was packed from (a grid over the same intervals without a store keeps live ones)."""
    from exporter.store.packed import PackedAggregate
    ivs = stream(400, dt=1.0, sparse=sparse)
    h = ServerHistory(math.inf, grids=(30.0,))
    feed(h, ivs)
    packed = h.buckets(30.0, -math.inf, math.inf)
    live = buckets_of(ivs, 30.0, end=ivs[-1].t1)
    assert len(packed) == len(live) == 13
    for p, lv in zip(packed, live):
        assert type(p.agg) is PackedAggregate and type(lv.agg) is not PackedAggregate
        assert (p.t0, p.t1) == (lv.t0, lv.t1)
        assert _bucket_readings(p.agg) == _bucket_readings(lv.agg)
    shared = [p.agg._layout.scopes["gpu"][1] is p.agg._layout.keys for p in packed]
    assert not any(shared) if sparse else all(shared)


def test_a_late_interval_unpacks_a_packed_bucket_and_keeps_it_exact():
    from exporter.store.packed import PackedAggregate
    ivs = stream(40, dt=1.0, sparse=True)
    h = ServerHistory(math.inf, grids=(10.0,))
    feed(h, ivs[:25])
    h.advance(ivs[24].t1 + 0.5)
    b = h.buckets(10.0, -math.inf, math.inf)[-1]
    assert type(b.agg) is PackedAggregate
    late = Interval(t0=ivs[24].t1, t1=b.t1, deltas={"generation_tokens": 7.0}, gauges={"kv_usage": 0.9, "running": 3.0})
    h._append(late)  # ends in the bucket already completed: unpacked, added to, packed again
    assert type(b.agg) is PackedAggregate
    ref = [x for x in buckets_of([*ivs[:25], late], 10.0) if x.t0 == b.t0][0]
    for key in ("generation_tokens", "counter_3"):
        assert b.agg.delta(key) == ref.agg.delta(key)
        assert b.agg.count_with(key) == ref.agg.count_with(key)
    assert list(b.agg.sorted_gauge("kv_usage")) == list(ref.agg.sorted_gauge("kv_usage"))
    assert b.agg.covered_seconds == ref.agg.covered_seconds and b.agg.n == ref.agg.n == 11
