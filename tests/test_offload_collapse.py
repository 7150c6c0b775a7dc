"""Collapse signature (methods.md s5): hand-computed conditions, then the detector over every scenario."""

from __future__ import annotations

import pytest

from exporter.derive import collapse as C
from exporter.samples import Interval
from exporter.sources.expfmt import parse
from exporter.sources.vllm import extract
from exporter.store import ServerHistory
from tests.support import vllm_sim as sim
from tests.support.aggregates import collapse_at
from tests.support.loopback import FakeVllm

TH = C.CollapseThresholds(throughput_drop_ratio=0.2, power_near_idle_ratio=1.25, reference_seconds=600,
                          recent_seconds=60)


def ivs(spec, idle_watts=150.0, energy=True):
    """spec: list of (seconds, tokens/s, preemptions/s, watts, running, waiting); 1 s intervals from t=0."""
    out, t = [], 0.0
    for seconds, tps, pps, watts, running, waiting in spec:
        for _ in range(int(seconds)):
            e = {"gpu": watts} if energy and watts is not None else {}
            i = {"gpu": idle_watts} if energy and idle_watts is not None else {}
            out.append(Interval(t0=t, t1=t + 1, deltas={"generation_tokens": tps, "preemptions": pps},
                                gauges={"running": running, "waiting": waiting, "kv_usage": 0.99}, energy_joules=e,
                                idle_joules=i))
            t += 1
    return out


def test_all_five_hold_hand_computed():
    # 600 s at 2000 tok/s (every 1-minute bucket 2000 -> p90 reference 2000), then 60 s stalled at 100 tok/s
    data = ivs([(660, 2000, 0, 500, 20, 5)])[:600] + ivs([(60, 100, 0, 180, 20, 5)])
    data = [Interval(t0=i, t1=i + 1, deltas=iv.deltas, gauges=iv.gauges, energy_joules=iv.energy_joules,
                     idle_joules=iv.idle_joules) for i, iv in enumerate(data)]
    r = collapse_at(data, 660.0, True, TH)
    assert r.reference_tokens_per_second == 2000
    assert r.recent_tokens_per_second == 100          # 100 < 0.2 * 2000 = 400
    assert r.gpu_power_watts == 180 and r.gpu_idle_power_watts == 150  # 180 <= 1.25 * 150 = 187.5
    assert r.conditions == {**dict.fromkeys(C.CLASSIC, True), "engine_steps_stopped": None}  # no step counter
    assert r.signature is True and r.condition_set == "classic"
    assert r.condition_sets == {"classic": True}  # stalled_engine does not apply without a step counter


@pytest.mark.parametrize("recent_tps,watts,expect", [
    (399.9, 187.5, True),    # just under the drop ratio, exactly at the power ratio
    (400.0, 180.0, False),   # 400 is not < 0.2 * 2000
    (100.0, 188.0, False),   # 188 W > 187.5 W
])
def test_threshold_edges(recent_tps, watts, expect):
    data = ivs([(600, 2000, 0, 500, 20, 5), (60, recent_tps, 0, watts, 20, 5)])
    assert collapse_at(data, 660.0, True, TH).signature is expect


def test_each_condition_can_veto():
    base = [(600, 2000, 0, 500, 20, 5)]
    assert collapse_at(ivs(base + [(60, 100, 0, 180, 20, 5)]), 660, False, TH).signature is False
    r = collapse_at(ivs(base + [(59, 100, 0, 180, 20, 5), (1, 100, 1, 180, 20, 5)]), 660, True, TH)
    assert r.conditions["zero_preemptions"] is False and r.signature is False
    r = collapse_at(ivs(base + [(59, 100, 0, 180, 20, 5), (1, 100, 0, 180, 0, 0)]), 660, True, TH)
    assert r.conditions["requests_pending"] is False and r.signature is False  # one idle sample suffices
    assert "requests_pending" in r.reason


def test_reference_is_the_90th_percentile_of_minute_buckets():
    # ten reference buckets: nine idle minutes and one at 1000 tok/s -> sorted [0]*9 + [1000];
    # rank 0.9 * 9 = 8.1 -> 0 + 0.1 * (1000 - 0) = 100
    data = ivs([(540, 0, 0, 150, 0, 0), (60, 1000, 0, 450, 8, 0), (60, 10, 0, 160, 3, 0)])
    r = collapse_at(data, 660.0, True, TH)
    assert r.reference_tokens_per_second == pytest.approx(100.0)
    assert r.conditions["throughput_collapsed"] is True  # 10 < 20


def test_unknown_power_makes_the_signature_unknown_not_false():
    data = ivs([(600, 2000, 0, 500, 20, 5), (60, 100, 0, 180, 20, 5)], energy=False)
    r = collapse_at(data, 660.0, True, TH)
    assert r.conditions["power_near_idle"] is None and r.signature is None
    assert r.reason.startswith("unknown: power_near_idle")
    # ... but a False condition still denies it (Kleene AND)
    data = ivs([(600, 2000, 0, 500, 20, 5), (60, 2000, 0, 500, 20, 5)], energy=False)
    assert collapse_at(data, 660.0, True, TH).signature is False
    # no idle baseline: energy but no idle joules
    data = ivs([(600, 2000, 0, 500, 20, 5), (60, 100, 0, 180, 20, 5)], idle_watts=None)
    assert collapse_at(data, 660.0, True, TH).conditions["power_near_idle"] is None


def test_no_history_no_reference():
    r = collapse_at(ivs([(60, 100, 0, 180, 20, 5)]), 60.0, True, TH)
    assert r.conditions["throughput_collapsed"] is None and r.signature is None
    assert "no reference level" in r.details["throughput_collapsed"]


def test_sparse_recent_window_is_unknown():
    data = ivs([(600, 2000, 0, 500, 20, 5), (20, 100, 0, 180, 20, 5)])  # only 20 s of the last 60
    r = collapse_at(data, 660.0, True, TH)
    assert r.conditions["throughput_collapsed"] is None and r.conditions["zero_preemptions"] is None


def test_reference_is_latched_while_the_signature_holds():
    stall = ivs([(600, 2000, 0, 500, 20, 5), (1200, 100, 0, 180, 20, 5)])
    prev = None
    for t in range(660, 1801, 10):
        prev = collapse_at(stall, float(t), True, TH, prev)
        assert prev.signature is True, t
    # by t=1800 the unlatched reference is the stalled level itself: without the latch it would clear
    assert collapse_at(stall, 1800.0, True, TH).signature is False
    assert prev.reference_tokens_per_second == 2000


def test_offload_unknown_is_reported():
    data = ivs([(600, 2000, 0, 500, 20, 5), (60, 100, 0, 180, 20, 5)])
    r = collapse_at(data, 660.0, None, TH)
    assert r.signature is None and "offload_enabled" in r.reason
    assert r.as_status()["conditions"]["offload_enabled"] is None


# --- stalled_engine: engine steps stopped while requests are pending (vLLM #45387, #45414) ------------------
def stepping(spec, offload=True):
    """spec: list of (seconds, steps/s, running, waiting, kv_usage); 1 s intervals with generation tokens =
    steps (one token per step), zero preemptions, no GPU energy (the CPU engine's case)."""
    out, t = [], 0.0
    for seconds, sps, running, waiting, kv in spec:
        for _ in range(int(seconds)):
            out.append(Interval(t0=t, t1=t + 1,
                                deltas={"generation_tokens": sps, "preemptions": 0.0, "engine_steps": sps},
                                gauges={"running": running, "waiting": waiting, "kv_usage": kv}, energy_joules={},
                                idle_joules={}))
            t += 1
    return out


@pytest.mark.parametrize("kv", [0.99, 0.0])  # terminal KV usage nearly full in #45387, 0 % in #45414
def test_stalled_engine_fires_whatever_the_kv_usage(kv):
    data = stepping([(600, 20, 4, 3, 0.5), (60, 0, 4, 3, kv)])
    r = collapse_at(data, 660.0, False, TH)  # no offloading, no GPU energy: the classic set is False
    assert r.conditions["engine_steps_stopped"] is True and r.conditions["requests_pending"] is True
    assert r.condition_sets == {"stalled_engine": True, "classic": False}
    assert r.signature is True and r.condition_set == "stalled_engine"
    assert r.reason.startswith("stalled_engine: engine steps stopped")
    assert r.as_status()["condition_set"] == "stalled_engine"


def test_one_step_in_the_window_is_not_a_stall():
    data = stepping([(600, 20, 4, 3, 0.5), (59, 0, 4, 3, 0.5), (1, 1, 4, 3, 0.5)])
    r = collapse_at(data, 660.0, False, TH)
    assert r.conditions["engine_steps_stopped"] is False and r.signature is False
    assert r.condition_set is None and "engine_steps_stopped" in r.reason


def test_idle_engine_is_not_stalled():
    """Zero steps and nothing waiting or running: idle, not stalled."""
    data = stepping([(600, 20, 4, 3, 0.5), (60, 0, 0, 0, 0.0)])
    r = collapse_at(data, 660.0, False, TH)
    assert r.conditions["engine_steps_stopped"] is True and r.conditions["requests_pending"] is False
    assert r.condition_sets["stalled_engine"] is False and r.signature is False


def test_stalled_engine_needs_a_covered_window():
    data = stepping([(600, 20, 4, 3, 0.5), (20, 0, 4, 3, 0.5)])  # the last 40 s not sampled
    r = collapse_at(data, 660.0, False, TH)
    assert r.conditions["engine_steps_stopped"] is None
    assert r.details["engine_steps_stopped"] == "not enough samples in the recent window"


def test_stall_clears_when_steps_resume():
    data = stepping([(600, 20, 4, 3, 0.5), (60, 0, 4, 3, 0.5), (5, 20, 4, 3, 0.5)])
    assert collapse_at(data[:660], 660.0, False, TH).signature is True
    r = collapse_at(data, 665.0, False, TH)
    assert r.conditions["engine_steps_stopped"] is False and r.signature is False


def test_both_sets_name_the_stalled_engine_first():
    data = ivs([(600, 2000, 0, 500, 20, 5), (60, 0, 0, 180, 20, 5)])
    data = [Interval(t0=iv.t0, t1=iv.t1, deltas={**iv.deltas, "engine_steps": iv.deltas["generation_tokens"] / 10},
                     gauges=iv.gauges, energy_joules=iv.energy_joules, idle_joules=iv.idle_joules) for iv in data]
    r = collapse_at(data, 660.0, True, TH)
    assert r.condition_sets == {"stalled_engine": True, "classic": True}
    assert r.condition_set == "stalled_engine" and r.reason.count(":") == 2  # both named in the reason


# --- a stale step counter (issue 38.2): tokens cannot move without engine steps -----------------------------
def busy_with_flat_steps(tokens_per_second=500.0, prompt_per_second=0.0, seconds=660):
    """Busy the whole time (4 running): the step counter is on the wire but flat from t=600 (a detached stats
    logger, a data-parallel coordinator's copy), the token counters keep moving."""
    return [Interval(t0=float(t), t1=t + 1.0,
                     deltas={"generation_tokens": tokens_per_second, "prompt_tokens": prompt_per_second,
                             "preemptions": 0.0, "engine_steps": 20.0 if t < 600 else 0.0},
                     gauges={"running": 4, "waiting": 0, "kv_usage": 0.5}, energy_joules={}, idle_joules={})
            for t in range(seconds)]


@pytest.mark.parametrize("gen, prompt", [(500.0, 0.0), (0.0, 800.0)])  # decoding; prefilling only
def test_a_flat_step_counter_beside_moving_tokens_is_stale_not_a_stall(gen, prompt):
    r = collapse_at(busy_with_flat_steps(gen, prompt), 660.0, False, TH)
    assert r.conditions["engine_steps_stopped"] is False and r.conditions["requests_pending"] is True
    assert r.condition_sets["stalled_engine"] is False and r.signature is False and r.condition_set is None
    moved = "generation tokens 500/s" if gen else "prompt tokens 800/s"
    assert "stale" in r.stale_witnesses["engine_steps"] and moved in r.stale_witnesses["engine_steps"]
    assert "stale witness engine_steps" in r.reason
    assert r.as_status()["stale_witnesses"] == r.stale_witnesses


def test_no_progress_needs_every_witness_flat():
    """Steps and tokens all flat with requests pending: the stall holds, no witness called stale; a token
    counter flat but sampled over too little of the window leaves it unknown, never asserted."""
    stalled = busy_with_flat_steps(0.0, 0.0)
    stalled = [iv if iv.t0 < 600 else Interval(t0=iv.t0, t1=iv.t1, deltas={**iv.deltas, "generation_tokens": 0.0},
                                               gauges=iv.gauges, energy_joules={}, idle_joules={}) for iv in stalled]
    r = collapse_at(stalled, 660.0, False, TH)
    assert r.conditions["engine_steps_stopped"] is True and r.signature is True and not r.stale_witnesses
    sparse = [iv if iv.t0 < 600 or iv.t0 >= 650 else
              Interval(t0=iv.t0, t1=iv.t1, deltas={k: v for k, v in iv.deltas.items() if k != "generation_tokens"},
                       gauges=iv.gauges, energy_joules={}, idle_joules={}) for iv in stalled]
    r = collapse_at(sparse, 660.0, False, TH)
    assert r.conditions["engine_steps_stopped"] is None and r.signature is None


# --- scenarios: the detector flags exactly the collapsed runs -----------------------------------------------
CLEAR_LAG = 20.0    # recovery shows within 20 s (1-minute mean above 20 % of the reference after ~12 s)
DETECT_LAG = 70.0   # onset needs the 1-minute mean power near idle: a full window plus an evaluation step


def sweep(scn, seconds=1200, step=5, **kw):
    data = sim.simulate_intervals(scn, seconds, 1.0, **kw)
    prev, out = None, []
    for t in range(60, int(seconds) + 1, step):
        sub = [iv for iv in data if iv.t1 <= t]
        prev = collapse_at(sub, float(t), scn.offload_enabled, TH, prev)
        out.append((float(t), prev))
    return out


def check_exact(scn, results):
    spans = scn.collapsed_spans()
    for t, r in results:
        inside = any(a <= t <= b + CLEAR_LAG for a, b, _ in spans)
        settled = any(a + DETECT_LAG <= t <= b for a, b, _ in spans)
        if r.signature:
            assert inside, f"{scn.name}: false collapse at t={t}: {r.reason}"
        if settled:
            assert r.signature is True, f"{scn.name}: missed collapse at t={t}: {r.reason}"


@pytest.mark.parametrize("name", sim.ALL_DETECTOR_SCENARIOS)
def test_detector_flags_exactly_the_collapsed_runs(name):
    scn = sim.build(name)
    results = sweep(scn)
    check_exact(scn, results)
    flagged = any(r.signature for _, r in results)
    assert flagged == bool(scn.collapsed_spans())


@pytest.mark.parametrize("version", ["0.24", "0.16"])
def test_detector_on_older_versions(version):
    scn = sim.recovering_on(version=version)
    check_exact(scn, sweep(scn))


def test_recovering_run_clears_when_throughput_returns():
    scn = sim.recovering_on(steady_seconds=300, collapse_seconds=180)
    results = dict(sweep(scn, seconds=700))
    assert results[480.0].signature is True
    assert results[495.0].signature is False and results[495.0].conditions["throughput_collapsed"] is False


def test_without_gpu_energy_collapse_is_unknown_never_asserted():
    scn = sim.collapsing_on()
    results = sweep(scn, seconds=700, with_gpu_energy=False)
    assert not any(r.signature for _, r in results)
    assert results[-1][1].signature is None
    # once a reference exists (t >= 120), healthy throughput denies the signature even without power
    assert all(r.signature is False for t, r in results if 120 <= t < 300)


def test_pipeline_through_http_store_and_restart():
    """FakeVllm -> sources.vllm -> store.ServerHistory -> collapse, across an outage and a restart, with the
    energy accumulated tick by tick as the daemon does (an interval spanning the outage carries its energy)."""
    import requests

    from exporter.sources.vllm import _process_start

    scn = sim.restarting_on(steady_seconds=120, down_seconds=20, quiet_seconds=60)
    # the recent window and its grid registered, as the daemon's history has them (model/server.py): kept tick by
    # tick, not rebuilt from every interval held at each tick
    hist = ServerHistory(2000, windows=(TH.recent_seconds,), grids=(TH.recent_seconds,))
    prev, seen_down = None, 0
    with FakeVllm(scn, auto=False) as fv:
        e_prev = fv.gpu_energy_joules()
        for t in range(1, 400):
            fv.step(1.0)
            e = fv.gpu_energy_joules()
            hist.add_energy("gpu", e - e_prev, scn.gpu_idle_watts * 1.0)
            e_prev = e
            try:
                text = requests.get(fv.url + "/metrics", timeout=2).text
            except requests.ConnectionError:
                seen_down += 1
                continue
            reading = extract(parse(text), _process_start(text))
            hist.add_reading(float(t), reading)
            rates = C.reference_rates_from_buckets(hist.buckets(TH.recent_seconds, *C.reference_span(t, TH)),
                                                   TH.recent_seconds)
            prev = C.evaluate_aggregates(hist.aggregate(TH.recent_seconds), rates, float(t),
                                         reading.info.offload_enabled, TH, prev)
            assert prev.signature is not True, (t, fv.phase, prev.reason)
    assert seen_down >= 15 and hist.restarts == 1
    assert prev.signature is False  # load is back, healthy
