"""The live, per-server KV-pressure learners (model/pressure/, methods.md s10) through the real Model: the
threshold located from the server's own 1-minute windows, the regime flag's hysteresis on the p95 interval, the
reference share learned only from true low pressure, and its persistence (model/reference_book.py).

The engine is a scripted EngineReading stream (kvwatt's own keys, as the vLLM adapter produces them): the
behaviours under test need pressure levels chosen per minute, which no engine can be steered to exactly. The
real engine's version of the same run is bench/threshold_live.py."""

from __future__ import annotations

import json
import random

import pytest

from exporter.config import from_mapping
from exporter.figures import ServerFigures
from exporter.model import Model
from exporter.model.pressure import P95, predicted_regime
from exporter.model.reference_book import STATE_FILE, ReferenceBook
from exporter.samples import EngineInfo, EngineReading, ServerRead, SourceStatus, Tick

WALL = 1_750_000_000.0


class Engine:
    """A server's cumulative counters, advanced one second at a time at the chosen pressure."""

    def __init__(self, seed: int = 1):
        self.c = {"preemptions": 0.0, "prompt_local_compute": 0.0, "prompt_local_cache_hit": 0.0,
                  "prompt_external_kv_transfer": 0.0, "generation_tokens": 0.0}
        self.rng = random.Random(seed)
        self.carry = 0.0
        self.waiting_capacity = 0.0  # requests waiting for KV capacity (vllm:num_requests_waiting_by_reason)

    def second(self, kv: float, share: float, preemptions_per_minute: float = 0.0,
               prompt_per_second: float = 1000.0) -> EngineReading:
        self.c["prompt_local_compute"] += prompt_per_second * share
        self.c["prompt_local_cache_hit"] += prompt_per_second * (1 - share)
        self.c["generation_tokens"] += 100.0 if prompt_per_second else 0.0
        self.carry += preemptions_per_minute / 60.0
        whole = int(self.carry)
        self.c["preemptions"] += whole
        self.carry -= whole
        running = 4.0 if prompt_per_second else 0.0
        gauges = {"kv_usage": kv, "running": running, "waiting": self.waiting_capacity,
                  "waiting_capacity": self.waiting_capacity}  # vLLM >= 0.20 says why requests wait
        return EngineReading(counters=dict(self.c), gauges=gauges, info=EngineInfo(),
                             capabilities=frozenset({"token_sources"}))


def model(tmp_path, refs: ReferenceBook | None = None, **cfg) -> Model:
    mapping = {"servers": [{"name": "s", "url": "http://127.0.0.1:9"}], "windows": ["1m"],
               "state_dir": str(tmp_path / "state"), "nvml": False, "powercap_root": str(tmp_path / "none")}
    mapping.update(cfg)
    return Model(from_mapping(mapping), wall_clock=lambda: WALL, references=refs)


class Run:
    def __init__(self, m: Model, engine: Engine | None = None):
        self.m, self.engine, self.t = m, engine or Engine(), 0.0

    def seconds(self, n: int, kv, share: float, preemptions_per_minute: float = 0.0, each=None,
                prompt_per_second: float = 1000.0) -> None:
        for _ in range(n):
            self.t += 1.0
            level = kv() if callable(kv) else kv
            reading = self.engine.second(level, share, preemptions_per_minute, prompt_per_second)
            self.m.ingest(Tick(self.t, {"s": ServerRead("s", SourceStatus(source="vllm", server="s",
                                                                          up=True), reading)}, (), ()))
            if each:
                each(self.fig())

    def fig(self) -> ServerFigures:
        return self.m.snapshot().servers[0]


def test_regime_flips_only_outside_the_p95_interval():
    assert predicted_regime(P95(0.92, 0.91, 0.95), 0.90, False) is True
    assert predicted_regime(P95(0.89, 0.85, 0.90), 0.90, True) is False  # upper bound at the threshold: below
    assert predicted_regime(P95(0.91, 0.88, 0.93), 0.90, False) is False  # straddles: previous holds
    assert predicted_regime(P95(0.89, 0.88, 0.93), 0.90, True) is True
    assert predicted_regime(P95(0.91, 0.88, 0.93), 0.90, None) is True  # no previous: the point estimate
    assert predicted_regime(P95(None, None, None), 0.90, True) is None


def test_a_noisy_series_near_the_threshold_does_not_flip(tmp_path):
    run = Run(model(tmp_path, kv_pressure_threshold_source="configured"))
    rng = random.Random(3)
    run.seconds(120, 0.5, 0.3)
    assert run.fig().windows[0].above_threshold is False
    flags, naive = [], []

    def each(f):
        w = f.windows[0]
        flags.append(w.above_threshold)
        naive.append(w.kv_usage_p95 > 0.90)
        assert w.kv_usage_p95_low <= w.kv_usage_p95 <= w.kv_usage_p95_high

    # uniform on [0.70, 0.9105]: the 1-minute p95 wanders around 0.90 on sampling noise alone
    run.seconds(60, lambda: rng.uniform(0.70, 0.9105), 0.3)
    flags.clear(), naive.clear()
    run.seconds(600, lambda: rng.uniform(0.70, 0.9105), 0.3, each=each)
    flips = sum(a != b for a, b in zip(naive, naive[1:]))
    assert flips >= 4, "the series must really cross the threshold on noise for this test to mean anything"
    assert set(flags) == {False}
    # clearly above the threshold, while the engine shows no pressure: the threshold only predicts; the regime
    # stays below and says why (provisional)
    run.seconds(60, lambda: rng.uniform(0.93, 0.99), 0.3)
    f = run.fig()
    assert f.windows[0].above_threshold is False and f.regime_state == "provisional"
    assert "is above the threshold in use 0.900: the threshold predicts pressure the engine does not show" in \
        f.regime_reason
    run.engine.waiting_capacity = 2.0  # now requests wait for KV capacity: above, whatever the threshold
    run.seconds(60, lambda: rng.uniform(0.93, 0.99), 0.3)
    f = run.fig()
    assert f.windows[0].above_threshold is True and f.regime_state == "known"


def test_threshold_located_from_the_servers_own_windows_and_used_by_the_regime(tmp_path, caplog):
    caplog.set_level("INFO", logger="kvwatt.pressure")
    run = Run(model(tmp_path))
    run.seconds(5 * 60, lambda: 0.40 + 0.02 * run.engine.rng.random(), 0.30)
    f = run.fig()
    assert f.located is None and f.threshold_source == "configured" and f.threshold_in_use == 0.90
    assert f.reference_windows >= 3 and f.reference_share == pytest.approx(0.30)
    run.seconds(5 * 60, lambda: 0.80 + 0.02 * run.engine.rng.random(), 0.30, preemptions_per_minute=3.0)
    f = run.fig()
    loc = f.located
    assert loc is not None and loc.method == "preemption_onset"
    assert 0.42 <= loc.ratio <= 0.80 and loc.low <= 0.42 and loc.high >= 0.80 and loc.points >= 8
    assert f.threshold_source == "located" and f.threshold_in_use == loc.ratio
    assert f.windows[0].above_threshold is True  # p95 ~0.82 < the configured 0.90, above the located one
    assert f.reference_share == pytest.approx(0.30)  # preempting windows never taught it
    lines = [r.getMessage() for r in caplog.records if r.name == "kvwatt.pressure"]
    assert len(lines) == 1 and lines[0].startswith("s: KV-pressure threshold located at p95 0.")  # once, not per window


def test_idle_and_half_seen_windows_are_no_evidence(tmp_path):
    run = Run(model(tmp_path))
    run.seconds(10 * 60, 0.0, 0.0, prompt_per_second=0.0)  # an idle server: no pressure either way
    assert run.fig().evidence_windows == 0 and run.fig().reference_share is None
    run.seconds(3 * 60, 0.40, 0.30)
    run.seconds(3 * 60, 0.80, 0.30, preemptions_per_minute=3.0)
    f = run.fig()
    assert f.evidence_windows == 6 and f.located.ratio == pytest.approx(0.60, abs=0.01)


def test_reference_survives_a_threshold_located_just_above_bursty_low_load(tmp_path):
    # the real engine at one session: KV usage is 0 most of each minute with short peaks, so the p95 is ~0 but
    # its upper bound is near the peak; a threshold located at ~0.25 must not drop those windows
    run = Run(model(tmp_path))
    run.seconds(4 * 60, lambda: 0.31 if run.t % 20 == 0 else 0.0, 0.06)
    f = run.fig()
    assert f.windows[0].kv_usage_p95_high >= 0.3 and f.reference_share == pytest.approx(0.06)
    run.seconds(3 * 60, 0.50, 0.40)  # a tax, no preemption
    f = run.fig()
    assert f.located.method == "tax_onset" and f.located.ratio == pytest.approx(0.25, abs=0.02)
    assert f.reference_share == pytest.approx(0.06) and f.windows[0].recompute_tax == pytest.approx(0.34)


def test_configured_source_keeps_the_threshold_but_the_engine_decides(tmp_path):
    run = Run(model(tmp_path, kv_pressure_threshold_source="configured"))
    run.seconds(5 * 60, 0.40, 0.30)
    run.seconds(5 * 60, 0.80, 0.30, preemptions_per_minute=3.0)
    f = run.fig()
    assert f.located is not None  # still located and exported ...
    assert f.threshold_source == "configured" and f.threshold_in_use == 0.90
    # ... the configured 0.90 predicts, but sustained preemptions are pressure whatever the threshold in use
    assert f.windows[0].above_threshold is True and f.regime_state == "known"
    assert f.regime_reason == "above: 3.0 preemptions/min; p95 0.800 is under the threshold in use 0.900"


def test_reference_learns_only_true_low_pressure_and_within_minutes(tmp_path):
    run = Run(model(tmp_path))
    run.seconds(59, 0.30, 0.70)
    assert run.fig().reference_share is None  # the first window is still open
    run.seconds(1, 0.30, 0.70)
    f = run.fig()
    assert f.reference_share == pytest.approx(0.70) and f.reference_kind == "learned"  # one minute in
    run.seconds(60, 0.30, 0.70)
    # preemption onset under the configured threshold (the real engine's case: share 0.751 vs 0.724)
    run.seconds(4 * 60, 0.60, 0.75, preemptions_per_minute=1.0)
    # a tax with no preemption at all, p95 still low
    run.seconds(4 * 60, 0.60, 0.90)
    # no preemption, no tax, but p95 within the margin of the threshold in use
    run.seconds(2 * 60, 0.88, 0.80)
    f = run.fig()
    assert f.reference_share == pytest.approx(0.70) and f.reference_windows == 2
    assert f.windows[0].recompute_tax == pytest.approx(0.10, abs=0.01)


def test_reference_persists_and_is_back_at_once_after_a_restart(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    refs = ReferenceBook(str(state), lambda: WALL)
    run = Run(model(tmp_path, refs))
    run.seconds(4 * 60, 0.30, 0.65)
    stored = json.loads((state / STATE_FILE).read_text())
    assert [e["share"] for e in stored["servers"]["s"]] == [pytest.approx(0.65)] * 4
    assert {e["at"] for e in stored["servers"]["s"]} == {WALL}
    again = Run(model(tmp_path, ReferenceBook(str(state), lambda: WALL)))
    again.seconds(2, 0.95, 0.9)  # under pressure right after the restart: the tax is there at once
    f = again.fig()
    assert f.reference_share == pytest.approx(0.65) and f.reference_windows == 4
    assert f.windows[0].recompute_tax == pytest.approx(0.25)


def test_bad_reference_file_and_failed_write_are_state_dir_reasons(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / STATE_FILE).write_text(json.dumps({"version": 1, "servers": {
        "s": [{"share": 0.4, "p95": 0.3, "at": WALL - 60}, {"share": 7, "p95": 0.3, "at": WALL}]}}))
    m = model(tmp_path, ReferenceBook(str(state), lambda: WALL))
    assert m.servers["s"].reference.value == pytest.approx(0.4)  # the good entry is kept
    st = next(s for s in m.snapshot().sources if s.source == "state_dir")
    assert st.state == "degraded" and "1 bad entries (s[1]: share 7 is outside [0, 1])" in st.reason
    (state / STATE_FILE).write_text("{not json")
    m = model(tmp_path, ReferenceBook(str(state), lambda: WALL))
    st = next(s for s in m.snapshot().sources if s.source == "state_dir")
    assert st.state == "degraded" and "ignored:" in st.reason and m.servers["s"].reference.value is None
    # a write that fails: kept in memory, said once as a reason
    (state / STATE_FILE).unlink()
    (state / STATE_FILE).mkdir()  # a directory where the file goes: the atomic rename fails
    run = Run(model(tmp_path, ReferenceBook(str(state), lambda: WALL)))
    run.seconds(130, 0.3, 0.5)
    st = next(s for s in run.m.snapshot().sources if s.source == "state_dir")
    assert "not persisted: writing" in st.reason and run.fig().reference_share == pytest.approx(0.5)


def test_read_only_state_dir_never_writes_the_reference(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    run = Run(model(tmp_path, ReferenceBook(str(state), lambda: WALL, read_only_reason="locked")))
    run.seconds(130, 0.3, 0.5)
    assert not (state / STATE_FILE).exists() and run.fig().reference_share == pytest.approx(0.5)
