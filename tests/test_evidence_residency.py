"""The engine's KV-block residency evidence in the verdicts (model/pressure/, methods.md s10-s11): the lead's
real vLLM 0.32 captures (tests/data/kv-cache-metrics/: 6 sessions x 3 turns on 96 and on 2000 KV blocks, every
block sampled) replayed minute by minute through the real Model, their counters advanced linearly between the
two expositions, the KV-usage gauge set to the level under test (the captures were taken idle)."""

from __future__ import annotations

import json
from pathlib import Path

from exporter.config import from_mapping
from exporter.derive.threshold import PressurePoint
from exporter.model import Model
from exporter.model.evidence_book import STATE_FILE, parse_entry
from exporter.model.pressure import ResidencySign, disagreement
from exporter.model.reference_book import ReferenceBook
from exporter.samples import EngineReading, ServerRead, SourceStatus, Tick
from exporter.sources.vllm import VllmAdapter
from tests.test_threshold_live import WALL

DATA = Path(__file__).resolve().parent / "data" / "kv-cache-metrics"
RESIDENCY = "kv_idle_before_evict_hist", "kv_reuse_gap_hist", "kv_lifetime_hist"


def model(tmp_path, refs: ReferenceBook | None = None, reference: float | None = None) -> Model:
    server = {"name": "s", "url": "http://127.0.0.1:9", "kv_cache_metrics_sample": 1.0}
    if reference is not None:
        server["reference_local_compute_share"] = reference
    mapping = {"servers": [server],
               "windows": ["1m"], "state_dir": str(tmp_path / "state"), "nvml": False,
               "powercap_root": str(tmp_path / "none")}
    return Model(from_mapping(mapping), wall_clock=lambda: WALL, references=refs)


class Capture:
    """The capture's workload repeated once a minute: counters at start + (minutes + s/60) x (end - start)."""

    def __init__(self, name: str, kv: float, preemptions: bool = True, histograms: bool = True):
        adapter = VllmAdapter()
        self.start = adapter.read((DATA / f"{name}-000.prom").read_text())
        self.end = adapter.read((DATA / f"{name}-end.prom").read_text())
        self.kv, self.preemptions, self.histograms = kv, preemptions, histograms

    def at(self, minutes: float) -> EngineReading:
        c = {k: v + minutes * (self.end.counters[k] - v) for k, v in self.start.counters.items()
             if k in self.end.counters}
        if not self.preemptions:
            c["preemptions"] = 0.0
        if not self.histograms:
            c = {k: v for k, v in c.items() if not k.startswith(RESIDENCY)}
        gauges = {**self.end.gauges, "kv_usage": self.kv, "running": 6.0, "waiting": 0.0, "waiting_capacity": 0.0}
        return EngineReading(counters=c, gauges=gauges, info=self.end.info, capabilities=self.end.capabilities)


def run(m: Model, capture: Capture, minutes: int, t0: float = 0.0) -> float:
    t = t0
    for _ in range(minutes * 60):
        t += 1.0
        reading = capture.at(t / 60.0)
        m.ingest(Tick(t, {"s": ServerRead("s", SourceStatus(source="vllm", server="s", up=True), reading)}, (), ()))
    return t


def test_first_seen_under_load_the_small_cache_is_pressure_without_preemption_or_reference(tmp_path):
    # 96 blocks, 87 % recomputed, the one preemption taken away: only the residency record shows the pressure
    m = model(tmp_path)
    run(m, Capture("small-cache", kv=0.60, preemptions=False), 3)
    f = m.snapshot().servers[0]
    assert [p.evidence.residency_kind for p in m.servers["s"].pressure.points] == ["pressure"] * 3
    assert f.evidence.pressured == 3 and f.evidence.low_pressure == 0
    assert f.windows[0].residency_evidence == "pressure"
    assert f.regime == "above" and f.regime_state == "known"  # p95 0.60 under the configured 0.90: not below
    assert f.regime_reason.startswith("above: the engine's KV-block residency shows pressure")
    assert f.reference_share is None and f.reference_state == "unknown" and f.tax_state == "unknown"
    assert f.tax_reason.startswith("pressure known from the engine's KV-block residency (0.842 evictions per "
                                   "prompt block"), f.tax_reason
    assert "needs a low-pressure reference: no low-pressure window seen yet" in f.tax_reason
    assert "counted pressured" not in f.tax_reason  # an unknown tax contradicts nothing


def test_residency_pressure_in_a_window_without_tax_or_preemption_is_said(tmp_path):
    # a configured reference at the small cache's own share: the tax is ~0, the eviction record says pressure
    m = model(tmp_path, reference=8884 / 10260)
    run(m, Capture("small-cache", kv=0.60, preemptions=False), 2)
    f = m.snapshot().servers[0]
    assert f.tax_state == "known" and f.evidence.pressured == 2
    assert f.tax_reason.endswith("in a window with no preemption and no tax above noise: counted pressured")


def test_without_the_histograms_the_same_window_reads_below_and_says_how_to_know(tmp_path):
    m = model(tmp_path)
    run(m, Capture("small-cache", kv=0.60, preemptions=False, histograms=False), 3)
    f = m.snapshot().servers[0]
    assert f.regime == "below" and f.evidence.pressured == 0
    assert f.tax_state == "unknown"
    assert f.tax_reason.endswith("; start vLLM with --kv-cache-metrics to know now whether it is under pressure")


def test_the_large_cache_low_pressure_evidence_teaches_the_reference_above_the_absolute_levels(tmp_path):
    # KV p95 and max 0.82: over LOW_PRESSURE_P95 (0.50) and LOW_PRESSURE_MAX (0.80), under 0.90 - 0.05
    m = model(tmp_path)
    run(m, Capture("large-cache", kv=0.82), 3)
    f = m.snapshot().servers[0]
    assert [p.evidence.residency_kind for p in m.servers["s"].pressure.points] == ["low_pressure"] * 3
    assert f.reference_state == "known" and f.reference_windows == 3 and f.evidence.low_pressure == 3
    assert abs(f.reference_share - 5268 / 10260) < 1e-6  # the large-cache run's own local_compute share
    assert f.windows[0].recompute_tax is not None and abs(f.windows[0].recompute_tax) < 0.01
    assert f.regime == "below"


def test_without_the_histograms_the_same_windows_teach_nothing(tmp_path):
    m = model(tmp_path)
    run(m, Capture("large-cache", kv=0.82, histograms=False), 3)
    f = m.snapshot().servers[0]
    assert f.reference_share is None and f.evidence.low_pressure == 0


def test_low_pressure_evidence_does_not_lift_the_threshold_relative_margin(tmp_path):
    m = model(tmp_path)
    run(m, Capture("large-cache", kv=0.87), 2)  # over 0.90 - 0.05
    assert m.snapshot().servers[0].reference_share is None


def test_residency_pressure_is_no_low_pressure_window_even_at_low_kv(tmp_path):
    # KV 0.20, no preemption, nobody waiting: the old rule's quiet window; the eviction record says otherwise
    m = model(tmp_path)
    run(m, Capture("small-cache", kv=0.20, preemptions=False), 2)
    f = m.snapshot().servers[0]
    assert f.reference_share is None and f.evidence.low_pressure == 0 and f.regime == "above"


def test_the_reference_learned_on_the_large_cache_taxes_the_pressure_after_it(tmp_path):
    # one server, same epoch (the engine facts are the large capture's throughout), the small-cache workload after
    m = model(tmp_path)
    t = run(m, Capture("large-cache", kv=0.30), 3)
    small = Capture("small-cache", kv=0.60, preemptions=False)
    small.end = type(small.end)(counters=small.end.counters, gauges=small.end.gauges,
                                info=Capture("large-cache", 0.3).end.info, capabilities=small.end.capabilities)
    offset = {k: v for k, v in Capture("large-cache", 0.3).at(t / 60.0).counters.items()}
    base = small.at

    def shifted(minutes):
        r = base(minutes - t / 60.0)
        return type(r)(counters={k: v + offset.get(k, 0.0) for k, v in r.counters.items()}, gauges=r.gauges,
                       info=r.info, capabilities=r.capabilities)
    small.at = shifted
    run(m, small, 2, t)
    f = m.snapshot().servers[0]
    assert f.reference_state == "known"
    assert abs(f.windows[0].recompute_tax - (8884 - 5268) / 10260) < 0.01  # 0.352: small minus large share
    assert f.tax_state == "known" and "KV-block residency" not in f.tax_reason  # tax and residency agree


def test_low_pressure_evidence_contradicting_an_above_is_said(tmp_path):
    m = model(tmp_path)
    run(m, Capture("large-cache", kv=0.97), 2)
    f = m.snapshot().servers[0]
    # the threshold predicts; the engine's own record of low pressure is what the regime says, with why
    assert f.regime == "below" and f.regime_state == "provisional"
    assert "although p95 0.970 is above the threshold in use 0.900" in f.regime_reason
    assert "the engine's KV-block residency shows low pressure" in f.regime_reason


def test_disagreement_words():
    pressure, low = ResidencySign("pressure", "r", True), ResidencySign("low_pressure", "r", True)
    assert "counted pressured" in disagreement(pressure, None, False)
    assert disagreement(pressure, None, False, tax_known=False) == ""
    assert disagreement(pressure, 2.0, False) == "" and disagreement(low, 0.0, False) == ""
    assert "2.0 preemptions/min" in disagreement(low, 2.0, False)
    assert disagreement(None, 2.0, True) == ""


def book(tmp_path) -> ReferenceBook:
    return ReferenceBook(str(tmp_path / "state"), lambda: WALL)


def test_persisted_reference_windows_keep_the_residency_relaxation(tmp_path):
    (tmp_path / "state").mkdir()
    run(model(tmp_path, book(tmp_path)), Capture("large-cache", kv=0.82), 3)
    again = model(tmp_path, book(tmp_path))  # p95 0.82 > 0.50: held only because the engine said low pressure
    assert again.servers["s"].reference.windows == 3 and abs(again.servers["s"].reference.value - 0.5135) < 1e-3


def test_persisted_windows_keep_their_residency_kind_and_old_files_still_load(tmp_path):
    (tmp_path / "state").mkdir()
    m = model(tmp_path, book(tmp_path))
    run(m, Capture("small-cache", kv=0.60, preemptions=False), 2)
    path = tmp_path / "state" / STATE_FILE
    stored = json.loads(path.read_text())["servers"]["s"]["windows"]
    assert [w.get("residency") for w in stored] == ["pressure", "pressure"]
    restored = model(tmp_path, book(tmp_path))  # a restarted daemon: the windows are pressured evidence at once
    assert [p.evidence.residency_kind for p in restored.servers["s"].pressure.points] == ["pressure", "pressure"]
    old = {"p95": 0.5, "weight": 1.0, "at": WALL}  # a file written before the residency evidence
    assert parse_entry(old, WALL).evidence.residency_kind is None
    try:
        parse_entry({**old, "residency": "maybe"}, WALL)
    except ValueError as e:
        assert "residency" in str(e)
    else:
        raise AssertionError("an unknown residency kind was accepted")
    assert isinstance(parse_entry({**old, "residency": "low_pressure"}, WALL), PressurePoint)
