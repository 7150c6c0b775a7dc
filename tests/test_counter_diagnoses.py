"""Issue 38.9: a counter that misbehaves on its own is diagnosed as what it is, never as two processes behind
one URL. (a) vLLM's offload counters read from their other spelling (the flat 0.24+ series or the deprecated
vllm:kv_offload_total_bytes{transfer_type}) is the engine switching spelling: no delta across the switch, the
reason ``spelling_switching`` while it recurs; (b) the write counter going backwards while the other counters
climb is that counter's reset or regression: ``counter_regression``, no refill counted, and the write model is
not blamed ("not this model's shape"). Unit level on real-shaped expositions through sources.vllm and the
store, then end to end through a real `kvwatt run`."""

from __future__ import annotations

import re

import pytest

from exporter.derive import recompute
from exporter.samples import EngineInfo, EngineReading
from exporter.sources.expfmt import parse
from exporter.sources.vllm import extract
from exporter.store import ServerHistory
from tests.support import vllm_sim as sim
from tests.support.daemon import KvwattDaemon
from tests.support.loopback import MetricsServer

FLAT = re.compile(r"^vllm:kv_offload_(?:load|store)_(?:bytes|time)_(?:total|created)\{.*\n", re.M)
DEPRECATED = re.compile(r"^(vllm:kv_offload_total_bytes_total\{[^}]*\}) (\S+)$", re.M)
NO_FLOPS = re.compile(r"^vllm:estimated_flops_per_gpu.*\n", re.M)  # no FLOP counter: offload bytes dominate


def spelled(text: str, deprecated: bool) -> str:
    """The exposition with one spelling of the offload counters only; the deprecated one counts half the bytes
    (the two are separate series: nothing makes their values agree)."""
    text = NO_FLOPS.sub("", text)
    if not deprecated:
        return re.sub(r"^vllm:kv_offload_total_(?:bytes|time).*\n", "", text, flags=re.M)
    return DEPRECATED.sub(lambda m: f"{m.group(1)} {float(m.group(2)) * 0.5}", FLAT.sub("", text))


def alternating_spellings(reads: int):
    """(history, intervals, true store bytes per read) over ``reads`` 1 s reads of a steady offloading server."""
    eng = sim.SimEngine(sim.stable_high_pressure_on())
    h, out = ServerHistory(600, name="svc", windows=(60.0,)), []
    for t in range(1, reads + 1):
        eng.advance(1.0)
        out.append(h.add_reading(float(t), extract(parse(spelled(eng.render("0.33"), deprecated=bool(t % 2))))))
    return h, [iv for iv in out if iv is not None]


def test_offload_counters_switching_spelling_are_diagnosed_as_such_not_as_replicas(caplog):
    with caplog.at_level("INFO", logger="kvwatt.store"):
        h, ivs = alternating_spellings(20)
    assert not h.identity.problem, h.identity.problem  # today: identity_flapping ... point kvwatt at each replica
    assert h.spelling.problem.startswith("spelling_switching: "), h.spelling.problem
    assert "offload_store_bytes" in h.spelling.problem and "kv_offload_total_bytes" in h.spelling.problem
    # one process: its token counters count at every step; the offload counter never across a switch
    assert all(iv.deltas.get("generation_tokens", 0) > 0 for iv in ivs)
    assert all("offload_store_bytes" not in iv.deltas for iv in ivs)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("spelling_switching" in m for m in lines) == 1, lines  # said once, not per read
    assert not any("went down" in m or "replica" in m for m in lines), lines  # today: both, per read


def test_one_switch_of_spelling_is_one_line_and_no_condition(caplog):
    eng = sim.SimEngine(sim.stable_high_pressure_on())
    h = ServerHistory(600, name="svc")
    with caplog.at_level("INFO", logger="kvwatt.store"):
        for t in range(1, 16):
            eng.advance(1.0)
            iv = h.add_reading(float(t), extract(parse(spelled(eng.render("0.33"), deprecated=t > 5))))
            if t == 6:
                assert iv is not None and "offload_store_bytes" not in iv.deltas  # the switch: no delta
    assert not h.spelling.problem and not h.identity.problem
    assert 0 < iv.deltas["offload_store_bytes"] < 1e10  # counted again on the new spelling, never its level
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "switched the spelling of" in lines[0] and "offload_store_bytes (" in lines[0], lines


def test_a_flat_series_born_after_the_deprecated_one_at_zero_counts_from_zero(caplog):
    """vLLM 0.32 at start-up: the deprecated kv_offload_total_bytes at 0 (no transfer yet), then the flat series
    from its first transfer on, already holding that transfer's bytes. A switch away from a series that never
    counted is a birth, not a switch: the flat series counts from zero (the real ON engine's store bytes read
    15 % under its counter when the first transfer was dropped)."""
    eng = sim.SimEngine(sim.stable_high_pressure_on())
    h, flat_before = ServerHistory(600, name="svc"), None
    with caplog.at_level("INFO", logger="kvwatt.store"):
        for t in range(1, 10):
            eng.advance(1.0)
            text = spelled(eng.render("0.33"), deprecated=t <= 3)
            if t <= 3:  # no transfer yet: the deprecated series at 0
                text = DEPRECATED.sub(lambda m: f"{m.group(1)} 0.0", text)
            iv = h.add_reading(float(t), extract(parse(text)))
            flat = extract(parse(text)).counters.get("offload_store_bytes")
            if t == 4:  # the switch: the flat series' whole first value counts
                assert iv is not None and iv.deltas["offload_store_bytes"] == pytest.approx(flat), iv.deltas
            flat_before = flat
    assert flat_before and not h.spelling.problem and not h.identity.problem


# --- (b) a write counter going backwards ------------------------------------------------------------------
WRITE_PER_SECOND = 4e8  # bytes/s; the write counter dominates the engine's counter sum (no FLOP, no offload)


def write_reading(t: int, glitch: bool) -> EngineReading:
    """Steady counters at 1 s reads; a glitching read shows the write counter 30 % below its level."""
    writes = WRITE_PER_SECOND * (100 + t) * (0.7 if glitch else 1.0)
    counters = {"generation_tokens": 500.0 * t, "prompt_tokens": 2000.0 * t, "prompt_local_compute": 2000.0 * t,
                "engine_write_bytes": writes, "preemptions": 0.0}
    return EngineReading(counters=counters, gauges={"running": 4.0, "waiting": 0.0},
                         info=EngineInfo(model_name="m", process_start_time_seconds=1.7e9))


def test_a_write_counter_going_backwards_is_its_regression_not_flapping(caplog):
    h = ServerHistory(600, name="svc", windows=(60.0,))
    with caplog.at_level("INFO", logger="kvwatt.store"):
        for t in range(0, 31):
            h.add_reading(float(t), write_reading(t, glitch=t % 5 == 3))  # back at its level the next read
    assert not h.identity.problem, h.identity.problem  # today: identity_flapping (went down and came back)
    assert h.regression.problem.startswith("counter_regression: "), h.regression.problem
    assert "engine_write_bytes" in h.regression.problem
    agg = h.aggregate(60.0)
    assert agg.delta("generation_tokens") == 500.0 * 30  # the other counters: every step counted
    # no refill of a drop counted: the write total is the true increase (each glitch's step folded into the next)
    assert agg.delta("engine_write_bytes") == pytest.approx(WRITE_PER_SECOND * 30)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("counter_regression" in m for m in lines) == 1, lines
    assert not any("flapping" in m or "re-based" in m for m in lines), lines


def test_a_window_whose_write_counter_went_back_does_not_blame_the_model():
    """A lasting drop of the write counter alone: the step it fell has tokens but no write increase, so the
    window's writes fall short of its tokens. Today the check of the write model fails ("not this model's
    shape"); it must name the counter instead and check nothing: judged by a known write model, the figure stays
    unknown with the counter's reason, never the model's shape."""
    h = ServerHistory(600, name="svc", windows=(60.0,))
    for t in range(0, 31):
        r = write_reading(t, glitch=t >= 20)  # from t=20 on the write counter stays 30 % low
        h.add_reading(float(t), r)
    per_token = WRITE_PER_SECOND / 2500.0  # the model's bytes per scheduled token, logits term 0
    fig = recompute.preemption_recompute(h.aggregate(60.0), per_token, 0.0, 60.0)
    model = recompute.WriteModel(bytes_per_token=per_token, bytes_per_logits_token=0.0, source="config.json",
                                 state="known")
    judged = recompute.judged(fig, model)
    assert fig.state == "unknown" and judged.state == "unknown", fig
    assert "went backwards" in fig.reason and "shape" not in judged.reason, judged.reason


# --- end to end ---------------------------------------------------------------------------------------------
class Spellings:
    """A steady offloading vLLM 0.33 on one URL whose offload counters come in the other spelling at each read."""

    def __init__(self):
        self.eng, self.i = sim.SimEngine(sim.stable_high_pressure_on()), 0

    def __call__(self) -> str:
        self.i += 1
        self.eng.advance(0.1)
        return spelled(self.eng.render("0.33"), deprecated=bool(self.i % 2))


@pytest.mark.slow  # real time: ~5 s of reads
def test_daemon_reports_a_switching_spelling_not_identity_flapping():
    src = Spellings()
    with MetricsServer(src) as srv, KvwattDaemon(servers={"svc": srv.url}, interval="100ms",
                                                 config={"windows": ["1m"]}) as d:
        d.wait_for(lambda d: src.i > 30, what="30 reads")
        status = next(s for s in d.status()["servers"] if s["server"] == "svc")
        log = d.log()
    assert status["state"] == "degraded" and status["reason_code"] == "spelling_switching", status
    assert "replica" not in status["reason"] and "two spellings" in status["reason"], status["reason"]
    assert log.count("spelling_switching") == 1 and "identity_flapping" not in log, log[-3000:]


WRITES = re.compile(r"^(vllm:estimated_write_bytes_per_gpu_total\{[^}]*\}) (\S+)$", re.M)


class WriteGlitch:
    """A steady vLLM 0.33 without offloading or a FLOP counter (the write counter dominates its counters) whose
    write counter reads 30 % low at every fourth read."""

    def __init__(self):
        self.eng, self.i = sim.SimEngine(sim.low_pressure_off()), 0

    def __call__(self) -> str:
        self.i += 1
        self.eng.advance(0.5)
        text = NO_FLOPS.sub("", self.eng.render("0.33"))
        if self.i % 4 == 0:
            text = WRITES.sub(lambda m: f"{m.group(1)} {float(m.group(2)) * 0.7}", text)
        return text


@pytest.mark.slow  # real time: ~5 s of reads
def test_daemon_reports_a_write_counter_going_backwards_as_its_regression():
    src = WriteGlitch()
    with MetricsServer(src) as srv, KvwattDaemon(servers={"svc": srv.url}, interval="100ms",
                                                 config={"windows": ["1m"]}) as d:
        d.wait_for(lambda d: src.i > 30, what="30 reads")
        status = next(s for s in d.status()["servers"] if s["server"] == "svc")
        log = d.log()
    assert status["state"] == "degraded" and status["reason_code"] == "counter_regression", status
    assert "engine_write_bytes" in status["reason"] and "replica" not in status["reason"], status["reason"]
    assert log.count("counter_regression") == 1 and "identity_flapping" not in log, log[-3000:]
