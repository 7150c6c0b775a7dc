"""An engine start time that moves forward without a restart (store/identity.py): an engine host's clock ahead (a
step of +2 h), or a start time re-derived at each scrape (1 s later at every read). A process cannot start after
the read that saw it, and on a restart a value is an increase only where the counters went down: no step may
count a counter's whole value (the old rule gave 1.95e8 and 9.98e8 generated tokens/s against a true 100), log a
line per read, start an evidence epoch per read, latch a false collapse, or let `kvwatt baseline record` write a
profile of such steps. Unit level on ServerHistory, the real Model, and the real command over loopback HTTP."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from exporter.recording import profile as P
from exporter.samples import EngineInfo, EngineReading, ServerRead, SourceStatus, Tick
from exporter.store import ServerHistory
from tests.support import vllm_sim as sim
from tests.support.loopback import FakeVllm
from tests.test_threshold_live import WALL, Engine, model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOURS = 3 * 3600.0  # the process ran this long before the test's first read: its counters are large


def reading(g, start, wall):
    return EngineReading(counters={"g": g}, gauges={}, info=EngineInfo(model_name="m",
                                                                       process_start_time_seconds=start),
                         read_wall=wall)


def test_a_start_time_stepping_two_hours_into_the_future_counts_the_rise_not_the_counter(caplog):
    h = ServerHistory(600, name="s")
    g0 = 100.0 * HOURS
    h.add_reading(0.0, reading(g0, WALL - 3600, WALL))  # started an hour ago; then its host's clock jumps 2 h
    with caplog.at_level("INFO", logger="kvwatt.store"):
        ds = [h.add_reading(float(t), reading(g0 + 100 * t, WALL - 3600 + (7200 if t >= 3 else 0), WALL + t))
              .deltas.get("g") for t in range(1, 20)]
    assert ds == [100.0] * 19  # the old rule: 1,080,300 at t=3 (the whole counter), 1.95e8/s in a short window
    assert h.restarts == 0 and not h.identity.problem
    assert h.identity.process_start == WALL - 3600  # the start kvwatt holds for the process did not move
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "moved forward" in lines[0] and "steady again" in lines[1], lines


def test_a_start_time_re_derived_at_each_scrape_counts_nothing_extra_and_says_it_once(caplog):
    h = ServerHistory(600, name="s")
    g0 = 100.0 * HOURS
    h.add_reading(0.0, reading(g0, WALL - 0.2, WALL))  # each scrape says: started just now
    with caplog.at_level("INFO", logger="kvwatt.store"):
        ds = [h.add_reading(float(t), reading(g0 + 100 * t, WALL + t - 0.2, WALL + t)).deltas.get("g")
              for t in range(1, 60)]
    assert ds == [100.0] * 59 and h.restarts == 0 and not h.identity.problem
    assert len(caplog.records) == 1, [r.getMessage() for r in caplog.records]  # not one line per read


def test_a_real_restart_still_counts_from_zero():
    h = ServerHistory(600, name="s")
    h.add_reading(0.0, reading(1e6, WALL - HOURS, WALL))
    h.add_reading(1.0, reading(1e6 + 100, WALL - HOURS, WALL + 1))
    iv = h.add_reading(2.0, reading(60, WALL + 1.5, WALL + 2))  # started after the last read, counters fell
    assert iv.deltas["g"] == 60 and h.restarts == 1 and h.identity.process_start == WALL + 1.5
    iv = h.add_reading(3.0, reading(160, WALL + 1.5, WALL + 3))
    assert iv.deltas["g"] == 100


class CreepingEngine(Engine):
    """The scripted engine of test_threshold_live, offloading on, whose exposition says at every read that the
    process started 0.2 s before it (read_wall: the real reads' wall time), until ``creep_until``."""

    def __init__(self, creep_until: float = float("inf")):
        super().__init__()
        self.wall, self.creep_until, self.start = WALL, WALL + creep_until, WALL
        for key in self.c:
            self.c[key] = 100.0 * HOURS  # hours of counters before the first read

    def second(self, *a, **kw):
        r = super().second(*a, **kw)
        self.wall += 1.0
        if self.wall <= self.creep_until:
            self.start = self.wall - 0.2
        info = EngineInfo(model_name="m", offload_enabled=True, offload_buffer_bytes=2.0 ** 34,
                          process_start_time_seconds=self.start)
        return EngineReading(counters=r.counters, gauges=r.gauges, info=info, capabilities=r.capabilities,
                             read_wall=self.wall)


def test_the_model_under_a_creeping_start_keeps_its_epoch_rates_and_collapse(tmp_path, caplog):
    caplog.set_level("INFO")
    m = model(tmp_path, windows=["1m"])
    eng = CreepingEngine(creep_until=10 * 60)  # then the start time holds still: the rates fall to the truth
    collapsed = []
    for t in range(1, 15 * 60):
        m.ingest(Tick(float(t), {"s": ServerRead("s", SourceStatus(source="vllm", server="s", up=True), eng.second(
            0.6, 0.2))},
                      (), ()))
        collapsed.append(m.servers["s"].collapse.conditions.get("throughput_collapsed"))
        if t in (300, 15 * 60 - 1):  # while it creeps, and after
            rate = m.snapshot().servers[0].windows[0].generation_tokens_per_second
            assert rate == pytest.approx(100.0), (t, rate)  # the old rule: 1.2e6 while it creeps
    f = m.snapshot().servers[0]
    assert f.epoch_cause == "first reading"
    assert sum("new evidence epoch" in r.getMessage() for r in caplog.records) == 0  # the old rule: one per read
    assert True not in collapsed  # the old rule latched "throughput collapsed" for two reference windows


def _record(url: str, out, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exporter", "baseline", "record", "--server", f"off={url}",
                           "--duration", "4s", "--window", "1s", "--interval", "200ms", "--out", str(out),
                           "--state-dir", str(tmp_path / "s"), "--powercap-root", str(tmp_path / "n")],
                          cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "KVWATT_FAKE_NVML_STATE": str(tmp_path / "absent.json")})


def test_baseline_record_writes_no_profile_from_a_creeping_start_time(tmp_path):
    """The simulated vLLM (tests/support/vllm_sim.py) over real HTTP, its process start re-derived at each
    scrape as 'now', after hours of counters: the profile's tokens/s are the engine's, not the counters'."""
    with FakeVllm(sim.low_pressure_off()) as fv:
        eng = fv.engine
        eng.advance(600.0)  # ten minutes of counters before recording starts
        render = eng.render

        def creeping(*a, **kw):
            eng.created = time.time() + 20.0 - 0.2  # rendered as process_start_time_seconds = created - 20
            return render(*a, **kw)

        eng.render = creeping
        out = tmp_path / "p.json"
        r = _record(fv.url, out, tmp_path)
    assert r.returncode == 0, r.stderr
    rates = [b.tokens_per_second for b in P.load(str(out)).bands if b.windows]
    assert rates and max(rates) < 1.5 * 1500.0, rates  # the old rule: ~1e7 tokens/s
