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



def _quiet_stream(n: int, dt: float = 1.0) -> list[Interval]:
    """A quiet engine's rows: counters that do not move (0), one constant gauge, a moving one."""
    return [Interval(t0=1000.0 + k * dt, t1=1000.0 + (k + 1) * dt,
                     deltas={"preemptions": 0.0, "generation_tokens": float(k % 7)},
                     gauges={"waiting": 0.0, "kv_usage": (k % 100) / 100.0}, energy_joules={"gpu": 80.0 * dt},
                     idle_joules={}) for k in range(n)]


def test_a_full_chunk_of_one_value_is_one_shared_chunk_and_reads_the_same():
    """A counter that did not move for a chunk of rows holds no chunk of its own (issue 39: the memory of a
    64-server node): its full chunks are one shared object, in this store and another, and every row reads
    back as it went in; a chunk of moving values keeps its own."""
    from exporter.store.columns import CHUNK, IntervalColumns
    ivs = _quiet_stream(3 * CHUNK + 10)
    a, b = IntervalColumns(), IntervalColumns()
    for iv in ivs:
        a.append(iv)
        b.append(iv)
    d, g = a._cols[0], a._cols[1]
    assert d["preemptions"][0] is d["preemptions"][1] is b._cols[0]["preemptions"][2]
    assert g["waiting"][0] is b._cols[1]["waiting"][1] and a._cols[2]["gpu"][0] is b._cols[2]["gpu"][0]
    assert d["preemptions"][0] is g["waiting"][0]  # one shared chunk per value, whatever the column
    assert len({id(c) for c in d["generation_tokens"]}) == len(d["generation_tokens"])  # moving: its own
    assert len({id(c) for c in g["kv_usage"]}) == len(g["kv_usage"])
    assert d["preemptions"][-1] is not d["preemptions"][0]  # the chunk being written is never shared
    assert [a.interval(i) for i in range(a.first, a.end)] == ivs


def test_a_key_that_appears_late_shares_its_absent_past():
    """A key first seen after several full chunks: its past is the shared NaN chunk (absent), not a copy each."""
    from exporter.store.columns import CHUNK, IntervalColumns
    ivs = _quiet_stream(3 * CHUNK)
    late = Interval(t0=ivs[-1].t1, t1=ivs[-1].t1 + 1.0, deltas={"prefix_hits": 5.0}, gauges={}, energy_joules={},
                    idle_joules={})
    s = IntervalColumns()
    for iv in ivs + [late]:
        s.append(iv)
    chunks = s._cols[0]["prefix_hits"]
    assert len(chunks) == 4 and chunks[0] is chunks[1] is chunks[2] and all(x != x for x in chunks[0])
    from exporter.store import columns
    assert chunks[0] is not columns._NAN_CHUNK  # never the template new chunks are copied from
    assert s.interval(s.end - 2).deltas == ivs[-1].deltas and s.interval(s.end - 1) is late


def test_voiding_a_row_in_a_shared_chunk_copies_it_first():
    """void_deltas writes NaN into an old row: a shared chunk is copied first, so another store's rows that
    share it read as before."""
    from exporter.store.columns import CHUNK, IntervalColumns
    ivs = _quiet_stream(2 * CHUNK + 5)
    a, b = IntervalColumns(), IntervalColumns()
    for iv in ivs:
        a.append(iv)
        b.append(iv)
    shared = b._cols[0]["preemptions"][0]
    assert a._cols[0]["preemptions"][0] is shared
    voided = a.void_deltas(10)
    assert voided.deltas == {} and a.interval(10).deltas == {} and a.interval(11).deltas == ivs[11].deltas
    assert b.interval(10) == ivs[10] and all(x == 0.0 for x in shared)
    assert a._cols[0]["preemptions"][0] is not shared

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



def test_a_packed_bucket_holds_one_block_for_every_counter_that_did_not_move():
    """A counter carried by every interval with no delta in the bucket (a quiet engine's preemptions, histogram
    buckets) points at the bucket's one still keys' block (issue 39: memory): it reads as the live aggregate's
    own sums, a counter that moved keeps its own, and the array is shorter by four values a still key."""
    from exporter.store.packed import _HEAD, _PER_KEY
    rng = random.Random(3)
    ivs = [Interval(t0=1000.0 + k, t1=1001.0 + k, deltas={**{f"still_{i}": 0.0 for i in range(10)},
                                                          "generation_tokens": float(rng.randint(1, 9))},
                    gauges={"kv_usage": rng.random()}, energy_joules={"gpu": 90.0}, idle_joules={})
           for k in range(95)]
    ivs[40] = Interval(t0=ivs[40].t0, t1=ivs[40].t1, deltas={**ivs[40].deltas, "still_3": 2.0},
                       gauges=ivs[40].gauges, energy_joules=ivs[40].energy_joules, idle_joules={})
    h = ServerHistory(math.inf, grids=(30.0,))
    feed(h, ivs)
    packed, live = h.buckets(30.0, -math.inf, math.inf), buckets_of(ivs, 30.0, end=ivs[-1].t1)
    assert len(packed) == len(live) == 3
    for p, lv in zip(packed, live):
        assert _bucket_readings(p.agg) == _bucket_readings(lv.agg)
        keys = p.agg._layout.keys
        moved = {"generation_tokens"} | ({"still_3"} if p.t0 <= ivs[40].t0 < p.t1 else set())
        assert {k for k, at in keys.items() if at == _HEAD} == {f"still_{i}" for i in range(10)} - moved
        assert len({at for k, at in keys.items() if k in moved}) == len(moved)  # each its own values
    assert packed[1].agg.n == packed[2].agg.n == 30  # the same intervals; the second has one more still key
    assert len(packed[2].agg._v) == len(packed[1].agg._v) - _PER_KEY

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
