"""Incremental windows (docs/architecture.md "Windows"): the WindowAggregate and ServerHistory's sliding
windows and grid buckets give what the list-based derivations give over ``history.window(now, seconds)``,
stay exact under long streams of large counters, and do O(1) amortized work per interval."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest

from exporter import rules
from exporter.derive import collapse as C
from exporter.derive import economics as E
from exporter.derive import energy as EN
from exporter.derive import kappa as K
from exporter.derive import offload as O
from exporter.derive import pressure as P
from exporter.derive import recompute as R
from exporter.samples import EngineInfo, EngineReading, Interval
from exporter.store import Bucket, ServerHistory, buckets_of
from exporter.store import aggregate as W
from tests.support.aggregates import aggregate_of, collapse_at

KEYS = ("generation_tokens", "preemptions", "prompt_local_compute", "prompt_local_cache_hit",
        "prompt_external_kv_transfer", "prefix_queries", "prefix_hits", "external_prefix_hits", "flops",
        "offload_store_bytes", "offload_load_bytes", "offload_allocation_failures", "offload_stores_skipped",
        "prompt_tokens")
QS = (0.0, 0.05, 0.5, 0.9, 0.95, 0.99, 1.0)


# --- reference implementations: the list code as it was before windows became incremental ------------------
def ref_sum(ivs, key):
    vals = [iv.deltas[key] for iv in ivs if key in iv.deltas]
    return sum(vals) if vals else None


def ref_seconds_with(ivs, key):
    return sum(iv.seconds for iv in ivs if key in iv.deltas)


def ref_quantile(values, q):
    if not values:
        return None
    s = sorted(values)
    rank = q * (len(s) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return s[lo] + (s[hi] - s[lo]) * (rank - lo)


def ref_pending(ivs):
    return [iv.gauges["running"] + iv.gauges["waiting"] for iv in ivs
            if "running" in iv.gauges and "waiting" in iv.gauges]


def ref_window_energy(ivs, scope):
    used = [iv for iv in ivs if scope in iv.energy_joules]
    if not used:
        return None
    idle = sum(iv.idle_joules[scope] for iv in used) if all(scope in iv.idle_joules for iv in used) else None
    return EN.EnergyPerToken(scope, sum(iv.energy_joules[scope] for iv in used), idle,
                             sum(iv.deltas.get("generation_tokens") or 0.0 for iv in used),
                             sum(iv.seconds for iv in used), sum(iv.seconds for iv in used if W.is_loaded(iv)))


def ref_token_counts(ivs):
    by_source = {s: ref_sum(ivs, f"prompt_{s}") for s in R.SOURCES}
    if by_source["local_compute"] is not None:
        return {s: v or 0.0 for s, v in by_source.items()}
    queries, hits = ref_sum(ivs, "prefix_queries"), ref_sum(ivs, "prefix_hits")
    if queries is None or hits is None:
        return None
    external = ref_sum(ivs, "external_prefix_hits") or 0.0
    return {"local_compute": max(queries - hits - external, 0.0), "local_cache_hit": hits,
            "external_kv_transfer": external}


def ref_window_stats(ivs, width, scope="gpu", marginal=True, start=None, end=None):
    """economics.window_stats before window_stat: the fields that did not change meaning."""
    buckets = {}
    for iv in ivs:
        buckets.setdefault(math.floor((iv.t1 - 1e-9) / width), []).append(iv)
    out = []
    for k in sorted(buckets):
        t0, t1 = k * width, (k + 1) * width
        if (start is not None and t0 < start - 1e-9) or (end is not None and t1 > end + 1e-9):
            continue
        b = buckets[k]
        covered = sum(iv.seconds for iv in b)
        gen = ref_sum(b, "generation_tokens") or 0.0
        joules = None
        if all(scope in iv.energy_joules for iv in b):
            joules = sum(iv.energy_joules[scope] for iv in b)
            if marginal:
                joules = (joules - sum(iv.idle_joules[scope] for iv in b)
                          if all(scope in iv.idle_joules for iv in b) else None)
        kv = ref_quantile([iv.gauges["kv_usage"] for iv in b if "kv_usage" in iv.gauges], 0.95)
        out.append((t0, t1, covered, gen, joules, kv, covered >= rules.REPEAT_MIN_COVERED.default * width and gen > 0))
    return out


# --- comparison helpers --------------------------------------------------------------------------------------
def close(a, b, scale=None):
    """Equal up to 1e-9 relative (to ``scale`` when a difference of large sums is compared), None to None."""
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if math.isinf(a) or math.isinf(b):
        return a == b
    tol = 1e-9 * max(abs(a), abs(b), abs(scale or 0.0)) + 1e-12
    return abs(a - b) <= tol


def assert_close(a, b, what, scale=None):
    assert close(a, b, scale), f"{what}: incremental {a!r} != list {b!r}"


def assert_dict_close(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, f"{what}: {a!r} != {b!r}"
        return
    assert set(a) == set(b), what
    for k in a:
        assert_close(a[k], b[k], f"{what}[{k}]", scale=max(abs(v) for v in b.values()))


def assert_energy_close(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, f"{what}: {a!r} != {b!r}"
        return
    assert a.scope == b.scope
    for f in ("energy_joules", "idle_joules", "tokens", "seconds", "loaded_seconds"):
        assert_close(getattr(a, f), getattr(b, f), f"{what}.{f}")
    if b.tokens > 0:
        assert_close(a.joules_per_token, b.joules_per_token, f"{what}.J/tok")
        assert_close(a.marginal_joules_per_token, b.marginal_joules_per_token, f"{what}.marginal",
                     scale=b.energy_joules / b.tokens)


def check_aggregate(agg, ivs, tag):
    """Every query of ``agg`` against the same figure over the list ``ivs``."""
    assert agg.n == len(ivs) == len(agg), tag
    assert list(agg.intervals) == ivs, tag
    assert_close(agg.covered_seconds, sum(iv.seconds for iv in ivs), f"{tag} covered")
    for key in KEYS:
        assert_close(agg.delta(key), ref_sum(ivs, key), f"{tag} delta {key}")
        assert_close(agg.seconds_with(key), ref_seconds_with(ivs, key), f"{tag} seconds_with {key}")
    for key, values in (("kv_usage", [iv.gauges["kv_usage"] for iv in ivs if "kv_usage" in iv.gauges]),
                        ("pending", ref_pending(ivs))):
        assert W.gauge_values(agg, key) == values == W.gauge_values(ivs, key), f"{tag} gauge_values {key}"
        for q in QS:
            assert agg.quantile(key, q) == ref_quantile(values, q), f"{tag} quantile {key} {q}"
        assert agg.gauge_min(key) == (min(values) if values else None)
        assert agg.gauge_max(key) == (max(values) if values else None)
    for scope in ("gpu", "host", "nope"):
        used = [iv for iv in ivs if scope in iv.energy_joules]
        sc = agg.scope(scope)
        if not used:
            assert sc is None, f"{tag} scope {scope}"
            continue
        assert sc.n == len(used)
        assert_close(sc.covered_seconds, sum(iv.seconds for iv in used), f"{tag} {scope} covered")
        assert_close(sc.energy_joules, sum(iv.energy_joules[scope] for iv in used), f"{tag} {scope} energy")
        idle = sum(iv.idle_joules[scope] for iv in used) if all(scope in iv.idle_joules for iv in used) else None
        assert_close(sc.idle_joules, idle, f"{tag} {scope} idle")
        assert_close(sc.loaded_seconds, sum(iv.seconds for iv in used if W.is_loaded(iv)), f"{tag} {scope} loaded")
        for key in KEYS:
            if key not in W.SCOPE_KEYS:  # not summed per scope: asking is an error, not None
                with pytest.raises(KeyError, match="SCOPE_KEYS"):
                    sc.delta(key)
                continue
            assert_close(sc.delta(key), ref_sum(used, key), f"{tag} {scope} delta {key}")
            assert_close(sc.seconds_with(key), ref_seconds_with(used, key), f"{tag} {scope} seconds_with {key}")


def check_derivations(agg, ivs, tag):
    """Every derive function, given the incremental aggregate and given a fresh aggregate of the list."""
    fresh = aggregate_of(ivs)
    for q in (0.5, 0.95, 0.99):
        assert P.kv_usage_quantile(agg, q) == P.kv_usage_quantile(fresh, q) == ref_quantile(
            [iv.gauges["kv_usage"] for iv in ivs if "kv_usage" in iv.gauges], q), tag
    for key in KEYS:
        rate = None
        s, secs = ref_sum(ivs, key), ref_seconds_with(ivs, key)
        if s is not None and secs > 0:
            rate = s / secs
        assert_close(P.rate_per_second(agg, key), rate, f"{tag} rate {key}")
        assert_close(P.rate_per_second(fresh, key), rate, f"{tag} rate(list) {key}")
    assert_dict_close(R.token_counts(agg), ref_token_counts(ivs), f"{tag} token_counts")
    assert_dict_close(R.token_counts(fresh), ref_token_counts(ivs), f"{tag} token_counts(list)")
    gen = ref_sum(ivs, "generation_tokens")
    for a, b in zip(R.mfu_view(agg, gen), R.mfu_view(fresh, gen)):
        assert_close(a, b, f"{tag} mfu_view")
    for scope in ("gpu", "host"):
        ref = ref_window_energy(ivs, scope)
        assert_energy_close(EN.window_energy(agg, scope), ref, f"{tag} window_energy {scope}")
        assert_energy_close(EN.window_energy(fresh, scope), ref, f"{tag} window_energy(list) {scope}")
        for min_load in (0.0, 5.0):
            assert_energy_close(EN.per_token(agg, scope, min_load), EN.qualified(ref, min_load),
                                f"{tag} per_token {scope}")
    gpu_ivs = [iv for iv in ivs if "gpu" in iv.energy_joules]
    w = EN.qualified(ref_window_energy(gpu_ivs, "gpu"), 2.0)
    expect = None
    counts = ref_token_counts(gpu_ivs)
    if w is not None and w.idle_joules is not None and counts:
        units = w.tokens + counts["local_compute"] + 0.1 * counts["external_kv_transfer"]
        if units > 0:
            unit = (w.energy_joules - w.idle_joules) / units
            expect = {"local_compute": unit, "external_kv_transfer": 0.1 * unit}
    assert_dict_close(EN.prompt_attribution(agg, 2.0, 0.1), expect, f"{tag} prompt_attribution")
    assert_dict_close(EN.prompt_attribution(fresh, 2.0, 0.1), expect, f"{tag} prompt_attribution(list)")
    a, b = O.transfer_rates(agg), O.transfer_rates(fresh)
    assert_close(a.write_bytes_per_second, b.write_bytes_per_second, f"{tag} write rate")
    assert_close(a.read_bytes_per_second, b.read_bytes_per_second, f"{tag} read rate")
    parts = [ref_sum(ivs, k) for k in O.FAILURE_KEYS]
    known = [p for p in parts if p is not None]
    assert_close(O.store_failures(agg), sum(known) if known else None, f"{tag} store_failures")
    ext, local = ref_sum(ivs, "prompt_external_kv_transfer"), ref_sum(ivs, "prompt_local_compute")
    kappa = None if ext is None or local is None or (ext == 0 and local == 0) else (
        math.inf if local == 0 else ext / local)
    assert_close(K.observed(agg), kappa, f"{tag} kappa")
    for span in (5.0, 20.0):
        assert_close(C.generation_rate(agg, span), C.generation_rate(fresh, span), f"{tag} generation_rate")
    both = [iv for iv in ivs if "gpu" in iv.energy_joules and "gpu" in iv.idle_joules]
    secs = sum(iv.seconds for iv in both)
    mp = (None, None) if secs <= 0 else (sum(iv.energy_joules["gpu"] for iv in both) / secs,
                                         sum(iv.idle_joules["gpu"] for iv in both) / secs)
    for x, y in zip(C.mean_power(agg), mp):
        assert_close(x, y, f"{tag} mean_power")


# --- random streams ------------------------------------------------------------------------------------------
@dataclass
class Stream:
    """A random server: counters that climb (sometimes reset), appear and vanish; gauges sometimes missing;
    energy per tick with gaps and missing idle baselines; failed reads and outages."""

    rng: random.Random

    def __post_init__(self):
        self.counters = {k: self.rng.uniform(0, 1e6) for k in KEYS}
        self.scale = {k: 10 ** self.rng.uniform(-2, 9) for k in KEYS}
        self.present = {k: self.rng.random() < 0.7 for k in KEYS}
        self.start = 1000.0

    def reading(self) -> EngineReading:
        rng = self.rng
        for k in KEYS:
            if rng.random() < 0.02:
                self.present[k] = not self.present[k]
            r = rng.random()
            if r < 0.01:
                self.counters[k] = rng.uniform(0, 10)  # counter reset (an engine vanished)
            elif r < 0.25:
                pass  # no increase: a zero delta
            else:
                self.counters[k] += rng.uniform(0, self.scale[k])
        if rng.random() < 0.005:
            self.start += 100.0  # restart
        gauges = {}
        for g in ("kv_usage", "running", "waiting"):
            if rng.random() < 0.85:
                gauges[g] = rng.choice([0.0, 1.0, 0.5, round(rng.random(), 3), float(rng.randint(0, 20))])
        counters = {k: v for k, v in self.counters.items() if self.present[k]}
        return EngineReading(counters=counters, gauges=gauges, info=EngineInfo(process_start_time_seconds=self.start))

    def energy(self, h: ServerHistory):
        rng = self.rng
        for scope, p_gap, p_idle in (("gpu", 0.08, 0.9), ("host", 0.3, 0.6)):
            if rng.random() < 0.05:
                continue  # this scope not read at all this tick
            joules = None if rng.random() < p_gap else rng.uniform(0, 5000)
            idle = rng.uniform(0, 3000) if rng.random() < p_idle else None
            h.add_energy(scope, joules, idle)


WINDOWS = (5.0, 17.5, 20.0, 60.0)
GRIDS = (10.0, 20.0, 30.0)
TH = C.CollapseThresholds(throughput_drop_ratio=0.2, power_near_idle_ratio=1.5, reference_seconds=100.0,
                          recent_seconds=20.0)


def run_stream(seed, ticks=300, check_every=1):
    rng = random.Random(seed)
    s = Stream(rng)
    max_age = 160.0
    h = ServerHistory(max_age, windows=WINDOWS, grids=GRIDS)
    t, prev_inc, prev_list = 0.0, None, None
    for i in range(ticks):
        t += rng.choice([0.25, 0.5, 1.0, 1.0, 1.0, 1.5, 2.0, 3.0]) if rng.random() > 0.01 else rng.uniform(10, 40)
        s.energy(h)
        if rng.random() < 0.85:
            h.add_reading(t, s.reading())
        else:
            h.advance(t)  # the read failed: the windows still slide
        if i % check_every:
            continue
        for w in WINDOWS:
            agg, ivs = h.aggregate(w), h.window(t, w)
            tag = f"seed {seed} tick {i} t={t} window {w}"
            check_aggregate(agg, ivs, tag)
            check_derivations(agg, ivs, tag)
        # an unregistered length falls back to the list
        check_aggregate(h.aggregate(33.0), h.window(t, 33.0), f"seed {seed} tick {i} unregistered")
        # grid buckets against the list-based repeat windows over what the history still holds
        start = t - max_age
        for width in GRIDS:
            got = h.buckets(width, start, t)
            assert all(isinstance(b, Bucket) for b in got)
            ivs = list(h.intervals)
            want = E.window_stats(buckets_of(ivs, width, start, t), width)
            ref = ref_window_stats(ivs, width, start=start, end=t)
            stats = E.window_stats(got, width)
            assert [(b.t0, b.t1) for b in got] == [(x.t0, x.t1) for x in want] == [r[:2] for r in ref], \
                f"seed {seed} tick {i} grid {width}"
            for b in got:
                bucket_ivs = [iv for iv in ivs if math.floor((iv.t1 - 1e-9) / width) * width == b.t0]
                check_aggregate(b.agg, bucket_ivs, f"seed {seed} tick {i} bucket {b.t0}+{width}")
            for x, y, r in zip(stats, want, ref):
                tag = f"seed {seed} tick {i} window_stat {x.t0}+{width}"
                assert (x.loaded, x.kv_p95) == (y.loaded, y.kv_p95) == (r[6], r[5]), tag
                assert_close(x.covered_seconds, r[2], tag)
                assert_close(x.generated_tokens, r[3], tag)
                assert_close(x.joules, r[4], tag, scale=10000.0 * x.covered_seconds)
                for f in ("covered_seconds", "generated_tokens", "computed_prompt_tokens",
                          "loaded_prompt_tokens", "prompt_tokens"):
                    assert_close(getattr(x, f), getattr(y, f), f"{tag} {f}")
                assert_close(x.joules, y.joules, tag, scale=10000.0 * x.covered_seconds)
        # collapse: the daemon's incremental aggregates against the same cut made afresh from the list
        start, end = C.reference_span(t, TH)
        rates = C.reference_rates_from_buckets(h.buckets(TH.recent_seconds, start, end), TH.recent_seconds)
        offload = rng.choice([True, None])
        inc = C.evaluate_aggregates(h.aggregate(TH.recent_seconds), rates, t, offload, TH, prev_inc)
        lst = collapse_at(list(h.intervals), t, offload, TH, prev_list)
        assert inc.conditions == lst.conditions and inc.signature == lst.signature, f"seed {seed} tick {i}"
        assert inc.reason == lst.reason
        for f in ("recent_tokens_per_second", "reference_tokens_per_second", "gpu_power_watts",
                  "gpu_idle_power_watts"):
            assert_close(getattr(inc, f), getattr(lst, f), f"seed {seed} tick {i} collapse {f}")
        prev_inc, prev_list = inc, lst
    return h


@pytest.mark.parametrize("seed", range(4))
def test_incremental_windows_match_the_list_derivations(seed):
    run_stream(seed)


def test_long_stream_with_eviction_by_count_and_age():
    """A short max_intervals bound evicts intervals that the longest window still holds."""
    rng = random.Random(99)
    s = Stream(rng)
    h = ServerHistory(40.0, max_intervals=25, windows=(10.0, 60.0), grids=(15.0,))
    t = 0.0
    for i in range(600):
        t += rng.choice([0.5, 1.0, 2.0])
        s.energy(h)
        if rng.random() < 0.9:
            h.add_reading(t, s.reading())
        else:
            h.advance(t)
        for w in (10.0, 60.0):
            check_aggregate(h.aggregate(w), h.window(t, w), f"tick {i} window {w}")
        assert len(h.intervals) <= 25


def test_unbounded_history_keeps_every_bucket():
    h = ServerHistory(math.inf, windows=(30.0,), grids=(60.0,))
    for t in range(0, 3601):
        h.add_reading(float(t), EngineReading(counters={"generation_tokens": t * 10.0}, gauges={"kv_usage": 0.5},
                                              info=EngineInfo()))
    got = h.buckets(60.0, 0.0, 3600.0)
    assert [(b.t0, b.t1) for b in got] == [(k * 60.0, k * 60.0 + 60.0) for k in range(60)]
    assert got[0].agg.n == 60 and got[0].agg.delta("generation_tokens") == 600.0  # t1 = 1..60
    assert h.aggregate(30.0).n == 30 and len(h.intervals) == 3600


def test_grid_is_anchored_at_zero_and_a_bucket_completes_when_now_reaches_its_end():
    h = ServerHistory(600.0, grids=(10.0,))
    r = lambda g: EngineReading(counters={"generation_tokens": g}, gauges={}, info=EngineInfo())
    h.add_reading(3.0, r(0.0))
    h.add_reading(7.0, r(40.0))    # t1 = 7 -> bucket [0, 10)
    h.add_reading(10.0, r(70.0))   # t1 = 10 -> bucket [0, 10) (ends in (0, 10])
    assert [(b.t0, b.t1, b.agg.delta("generation_tokens")) for b in h.buckets(10.0, 0.0, 100.0)] == [(0, 10, 70.0)]
    h.add_reading(14.0, r(80.0))
    h.advance(19.0)
    assert len(h.buckets(10.0, 0.0, 100.0)) == 1  # [10, 20) not complete yet
    h.advance(45.0)  # read failed for a while: [10, 20) completes; [20, 30) and [30, 40) had no interval
    assert [(b.t0, b.t1) for b in h.buckets(10.0, 0.0, 100.0)] == [(0, 10), (10, 20)]
    assert [(b.t0, b.t1) for b in h.buckets(10.0, 5.0, 100.0)] == [(10, 20)]  # t0 >= start
    assert h.buckets(10.0, 0.0, 19.0) == h.buckets(10.0, 0.0, 10.0)  # t1 <= end
    # an unregistered width is built from the intervals held
    assert [(b.t0, b.t1) for b in h.buckets(5.0, 0.0, 100.0)] == [(5, 10), (10, 15)]


def test_a_window_empties_back_to_unknown():
    agg = W.WindowAggregate()
    ivs = [Interval(t0=0, t1=1, deltas={"a": 5.0, "b": 0.0}, gauges={"kv_usage": 0.3, "running": 1.0, "waiting": 0.0},
                    energy_joules={"gpu": 10.0}, idle_joules={"gpu": 4.0}),
           Interval(t0=1, t1=2, deltas={"a": 0.1}, gauges={"kv_usage": 0.7}, energy_joules={"gpu": 3.0})]
    for iv in ivs:
        agg.add(iv)
    assert agg.delta("a") == pytest.approx(5.1) and agg.delta("b") == 0.0 and agg.scope("gpu").idle_joules is None
    with pytest.raises(ValueError):
        agg.remove(ivs[1])  # only the oldest may leave
    agg.remove(ivs[0])
    assert agg.delta("b") is None and agg.delta("a") == pytest.approx(0.1) and agg.gauge_min("pending") is None
    assert agg.scope("gpu").energy_joules == 3.0
    agg.remove(ivs[1])
    assert (agg.n, agg.covered_seconds, agg.delta("a"), agg.scope("gpu"), agg.quantile("kv_usage", 0.5)) == \
        (0, 0.0, None, None, None)


def test_values_that_all_left_except_zeros_read_exactly_zero():
    """A spike followed by zeros: no residue, so "zero preemptions" is exactly zero again."""
    agg = W.WindowAggregate()
    seq = [Interval(t0=i, t1=i + 1, deltas={"preemptions": 1e15 if i == 0 else (0.1 if i == 1 else 0.0)},
                    gauges={}) for i in range(5)]
    for iv in seq:
        agg.add(iv)
    agg.remove()
    agg.remove()
    assert agg.delta("preemptions") == 0.0


def test_drift_stays_bounded_over_200k_ticks_of_large_counters():
    """Large, mixed-magnitude values (with spikes) added and removed 200k times: every running sum stays
    within 1e-9 relative of an exact re-sum (math.fsum) of what the window holds."""
    rng = random.Random(7)
    agg = W.WindowAggregate()
    held = 300
    worst = 0.0

    def exact(key, scope=None):
        ivs = [iv for iv in agg.intervals if scope is None or scope in iv.energy_joules]
        return math.fsum(iv.deltas[key] for iv in ivs if key in iv.deltas)

    for i in range(200_000):
        big = rng.random() < 0.001
        deltas = {"generation_tokens": rng.uniform(0, 5e4) + (1e13 if big else 0.0),
                  "flops": rng.uniform(1e14, 9e16), "preemptions": float(rng.random() < 0.05)}
        if rng.random() < 0.5:
            deltas["prompt_local_compute"] = rng.uniform(0, 1e-3)
        energy = {"gpu": rng.uniform(100.0, 1e6)} if rng.random() < 0.95 else {}
        agg.add(Interval(t0=i * 0.37, t1=(i + 1) * 0.37, deltas=deltas, gauges={"kv_usage": rng.random()},
                         energy_joules=energy, idle_joules={"gpu": rng.uniform(50.0, 1e5)} if energy else {}))
        if agg.n > held:
            agg.remove()
        if i % 997 == 0 or i == 199_999:
            for key in ("generation_tokens", "flops", "preemptions", "prompt_local_compute"):
                want = exact(key)
                got = agg.delta(key)
                if got is not None:
                    assert got == pytest.approx(want, rel=1e-9, abs=1e-300), (i, key)
                    worst = max(worst, abs(got - want) / want if want else abs(got))
                if key not in W.SCOPE_KEYS:
                    continue
                want_g = exact(key, "gpu")
                got_g = agg.scope("gpu").delta(key)
                if got_g is not None:
                    assert got_g == pytest.approx(want_g, rel=1e-9, abs=1e-300), (i, key, "gpu")
            sc = agg.scope("gpu")
            e = math.fsum(iv.energy_joules["gpu"] for iv in agg.intervals if "gpu" in iv.energy_joules)
            assert sc.energy_joules == pytest.approx(e, rel=1e-9)
            assert agg.covered_seconds == pytest.approx(math.fsum(iv.seconds for iv in agg.intervals), rel=1e-9)
    assert worst < 1e-9


def test_per_interval_work_is_constant_in_window_length_with_no_pause(monkeypatch):
    """Sliding a window makes its sums afresh once per max(n, RESUM_MIN_REMOVALS) removals, by a shadow that sums
    each interval added (one more sum a tick) and is adopted once the intervals held when it started have all
    left: no add or remove ever sums more than two intervals (the whole window at once was a tick's pause,
    issue 39), the fresh sums are adopted once per max(n, 1000) + n removals whatever the length, and what
    they read is the exact sum."""
    calls = {"sums": 0, "adopted": 0}
    original_sum_in, original_adopt = W.WindowAggregate._sum_in, W.WindowAggregate._adopt

    def sum_in(self, iv):
        calls["sums"] += 1
        original_sum_in(self, iv)

    def adopt(self, fresh):
        calls["adopted"] += 1
        original_adopt(self, fresh)

    monkeypatch.setattr(W.WindowAggregate, "_sum_in", sum_in)
    monkeypatch.setattr(W.WindowAggregate, "_adopt", adopt)
    for length in (100, 5000, 50_000):
        agg = W.WindowAggregate()
        removals, most = 100_000, 0
        calls.update(adopted=0)
        for i in range(length + removals):
            calls["sums"] = 0
            agg.add(Interval(t0=i, t1=i + 1, deltas={"g": 1.0}, gauges={}))
            if agg.n > length:
                agg.remove()
            most = max(most, calls["sums"])
        assert most <= 2, (length, most)  # the interval itself, and the shadow's copy of it
        period = max(length, W.RESUM_MIN_REMOVALS) + length  # the count, then the held intervals leaving
        assert removals // period - 1 <= calls["adopted"] <= removals // period + 1, (length, calls)
        assert agg.delta("g") == length and agg.n == length


def test_the_adopted_sums_are_the_held_intervals_summed_afresh():
    """At adoption the running sums equal a fresh aggregate of the held intervals, field by field (the
    compensated sums included): what resum() would give at that moment."""
    rng = random.Random(5)
    agg = W.WindowAggregate()
    for i in range(3 * W.RESUM_MIN_REMOVALS + 50):
        agg.add(Interval(t0=i * 0.3, t1=(i + 1) * 0.3, deltas={"generation_tokens": rng.uniform(0, 1e6)},
                         gauges={"kv_usage": rng.random()}, energy_joules={"gpu": rng.uniform(1, 1e5)},
                         idle_joules={}))
        if agg.n > 200:
            shadowing = agg._shadow is not None
            agg.remove()
            if shadowing and agg._shadow is None:  # adopted just now
                fresh = W.aggregate_of(list(agg.intervals))
                assert (agg.n, agg._cov, agg._loaded) == (fresh.n, fresh._cov, fresh._loaded)
                assert agg._keys == fresh._keys
                assert agg.scope("gpu").energy_joules == fresh.scope("gpu").energy_joules
                return
    raise AssertionError("no adoption")


def test_derive_functions_read_an_aggregate_or_a_scope_of_it():
    ivs = [Interval(t0=i, t1=i + 1, deltas={"generation_tokens": 10.0, "prefix_queries": 100.0, "prefix_hits": 60.0,
                               "external_prefix_hits": 30.0}, gauges={"kv_usage": i / 10, "running": 1.0},
                    energy_joules={"gpu": 500.0}, idle_joules={"gpu": 200.0}) for i in range(10)]
    agg = aggregate_of(ivs)
    assert isinstance(agg, W.WindowAggregate) and list(agg) == ivs
    assert R.token_counts(agg) == {"local_compute": 100.0, "local_cache_hit": 600.0,
                                   "external_kv_transfer": 300.0}
    assert R.token_counts(agg.scope("gpu")) == R.token_counts(agg)
    w = EN.per_token(agg, "gpu", 5)
    assert (w.energy_joules, w.idle_joules, w.tokens) == (5000.0, 2000.0, 100.0)
    assert EN.prompt_attribution(agg, 5, 0.1) == pytest.approx({"local_compute": 3000.0 / 230.0,
                                                                "external_kv_transfer": 300.0 / 230.0})
    assert P.kv_usage_quantile(agg, 0.95) == pytest.approx(0.855)
