"""Two processes behind one URL: a changing process identity is its own condition. No counter
delta across it, the server degraded (reason identity_flapping) and logged once; a single restart is still a
restart. Unit level on ServerHistory, then end to end: the real daemon reading one loopback URL that alternates
two expositions."""

from pathlib import Path

import pytest

from exporter.samples import EngineInfo, EngineReading
from exporter.store import ServerHistory
from tests.conftest import FIXTURES
from tests.support.daemon import KvwattDaemon
from tests.support.expositions import offset_counters
from tests.support.loopback import MetricsServer

LOW = [p.read_text() for p in sorted((FIXTURES / "low-pressure").glob("*.prom"))]
SGLANG = sorted((FIXTURES.parent / "sglang" / "normal").glob("*.prom"))[0].read_text()
WALL = 1.8e9


def reading(g, start, engine="vllm", model="m", wall=None):
    return EngineReading(counters={"g": g}, gauges={}, info=EngineInfo(model_name=model,
                                                                       process_start_time_seconds=start),
                         engine=engine, read_wall=wall)


def deltas_of(h, readings):
    return [None if iv is None else iv.deltas.get("g") for iv in
            (h.add_reading(h.last_t + 1.0, r) for r in readings)]


def test_two_replicas_alternating_give_no_delta_across_the_change_and_one_warning(caplog):
    h = ServerHistory(600, name="svc")
    h.add_reading(0.0, reading(1e9, WALL - 3600, wall=WALL))
    with caplog.at_level("INFO", logger="kvwatt.store"):
        ds = deltas_of(h, [reading(5e8 + 300 * t if t % 2 else 1e9 + 300 * t, WALL - (1800 if t % 2 else 3600),
                                   wall=WALL + t) for t in range(1, 21)])
    assert all(d is None for d in ds), ds  # never B's 500,000,000 as one step's increase
    assert h.identity.problem.startswith("identity_flapping: ") and "each replica" in h.identity.problem
    assert sum("identity_flapping" in r.getMessage() for r in caplog.records) == 1
    lines = [r.getMessage() for r in caplog.records]  # the first change, then the condition: 2 lines in 20 reads
    assert len(lines) == 2 and "process identity changed (process start" in lines[0], lines


def test_an_engine_alternating_between_vllm_and_sglang_gives_no_delta():
    h = ServerHistory(600, name="svc")
    h.add_reading(0.0, reading(1e9, None, "vllm"))
    ds = deltas_of(h, [reading(5e8 if t % 2 else 1e9 + t, None, "sglang" if t % 2 else "vllm") for t in range(1, 9)])
    assert all(d is None for d in ds), ds
    assert h.identity.problem


def test_a_counter_going_down_and_back_without_any_identity_is_flapping():
    h = ServerHistory(600, name="svc")
    h.add_reading(0.0, reading(1e9, None))
    ds = deltas_of(h, [reading(5e8 + t if t % 2 else 1e9 + 300 * t, None) for t in range(1, 9)])
    assert all(d is None for d in ds), ds  # today: 500,000,600 every other step
    assert h.identity.problem


def test_a_single_restart_is_still_a_restart_and_the_condition_clears():
    h = ServerHistory(600, name="one")
    h.add_reading(0.0, reading(1e6, WALL - 3600, wall=WALL))
    h.add_reading(1.0, reading(1e6 + 100, WALL - 3600, wall=WALL + 1))
    iv = h.add_reading(2.0, reading(170, WALL + 1.5, wall=WALL + 2))  # new process, started after the last read
    assert iv.deltas["g"] == 170 and h.restarts == 1 and not h.identity.problem
    ds = deltas_of(h, [reading(170 + 10 * t, WALL + 1.5, wall=WALL + 2 + t) for t in range(1, 30)])
    assert ds == [10] * 29


def test_a_replacement_already_running_at_the_previous_read_is_one_unknown_step_not_flapping(caplog):
    h = ServerHistory(600, name="svc")  # a rolling update: the new pod started a minute before the old one's last read
    h.add_reading(0.0, reading(1e9, WALL - 3600, wall=WALL))
    with caplog.at_level("INFO", logger="kvwatt.store"):
        ds = deltas_of(h, [reading(5e6 + 10 * t, WALL - 60, wall=WALL + t) for t in range(1, 12)])
    assert ds == [None] + [10] * 10 and not h.identity.problem
    assert [r.getMessage() for r in caplog.records] == \
        ["svc: process identity changed (process start 1799996400 -> 1799999940): no counter delta for this step"]


def test_flapping_clears_after_quiet_readings(caplog):
    h = ServerHistory(600, name="svc")
    h.add_reading(0.0, reading(1e9, WALL - 3600, wall=WALL))
    deltas_of(h, [reading(5e8 if t % 2 else 1e9, WALL - (1800 if t % 2 else 3600), wall=WALL + t)
                  for t in range(1, 6)])
    assert h.identity.problem
    with caplog.at_level("INFO", logger="kvwatt.store"):
        ds = [h.add_reading(10.0 + t, reading(1e9 + t, WALL - 1800, wall=WALL + 10 + t)).deltas.get("g")
              for t in range(12)]
    assert not h.identity.problem and ds[1:] == [1.0] * 11
    assert sum("one process identity again" in r.getMessage() for r in caplog.records) == 1


def test_two_replicas_with_the_same_start_void_the_first_switch_up():
    """The identity cannot tell them apart: the first switch up to the other replica's level looks like a
    burst and was counted (998,132 tokens/s against a true 100) and kept for the window; it is voided once the
    counters fall back to the first replica's level, in the window, its grid bucket and the row alike."""
    h = ServerHistory(600, name="svc", windows=(60.0,), grids=(30.0,))
    h.add_reading(0.0, reading(1e9, WALL - 3600, wall=WALL))
    ds = deltas_of(h, [reading((1e9 if t % 2 == 0 else 2e9) + 100 * t, WALL - 3600, wall=WALL + t)
                       for t in range(1, 40)])
    assert ds[0] == 1e9 + 100  # the switch up, as it came: nothing could tell it from a burst yet
    assert h.identity.problem.startswith("identity_flapping")
    assert [iv.deltas.get("g") for iv in h.intervals][0] is None  # voided at the next read
    assert max(iv.deltas.get("g") or 0.0 for iv in h.intervals) < 1e3
    assert (h.aggregate(60.0).delta("g") or 0.0) < 1e3
    assert all((b.agg.delta("g") or 0.0) < 1e3 for b in h.buckets(30.0, 0.0, 40.0))


@pytest.mark.parametrize("levels", [
    [0, 0, 0, 5000, 5100, 5200, 5300, 5400],  # idle, then a burst of load: kept
    [1e6 + 100 * t for t in range(8)] + [30.0, 130.0],  # a climb, then a genuine reset to ~0
    [0, 0, 5000, 5000, 0, 100],  # a fresh engine's first burst, then a reset to zero
])
def test_a_burst_or_a_reset_voids_nothing(levels):
    h = ServerHistory(600, name="one")
    h.add_reading(0.0, reading(levels[0], WALL - 3600, wall=WALL))
    ds = deltas_of(h, [reading(g, WALL - 3600, wall=WALL + t) for t, g in enumerate(levels[1:], start=1)])
    kept = [iv.deltas.get("g") for iv in h.intervals]
    assert kept == ds and not h.identity.problem


def _replica_b(text: str) -> str:
    """Another replica of the same model: started at another time, served 1e9 more tokens."""
    text = offset_counters(text, 1e9)
    return text.replace("process_start_time_seconds 1.79529530976e+09", "process_start_time_seconds 1.795e+09")


class Alternate:
    """One URL, two processes: each request answered by the other one (round robin)."""

    def __init__(self, a: str, b: str):
        self.texts, self.i = (a, b), 0

    def __call__(self):
        self.i += 1
        return self.texts[self.i % 2]


@pytest.mark.parametrize("other", ["replica", "same_start", "sglang"])
def test_daemon_behind_one_url_with_two_processes_is_degraded_not_inflated(other):
    a = LOW[-1]
    b = {"replica": _replica_b(a), "same_start": offset_counters(a, 1e9), "sglang": SGLANG}[other]
    assert "1.79529530976e+09" in a and ("1.79529530976e+09" in b) == (other == "same_start")
    alt = Alternate(b, a) if other == "same_start" else Alternate(a, b)  # same start: the lower one first
    with MetricsServer(alt) as srv, KvwattDaemon(servers={"svc": srv.url}, interval="100ms",
                                                 config={"windows": ["1m"]}) as d:
        d.wait_for(lambda d: alt.i > 30, what="30 alternating reads")
        rate = d.value("kvwatt_generation_tokens_per_second", server="svc", window="1m")
        assert rate is None or rate == 0.0  # both processes idle: no true increase, never 1e9 per step
        status = next(s for s in d.status()["servers"] if s["server"] == "svc")
        assert status["state"] == "degraded" and status["reason_code"] == "identity_flapping", status
        assert "each replica" in status["reason"]
        assert d.value("kvwatt_source_info", source="vllm", server="svc", reason="identity_flapping") == 1
        log = Path(d.log_path).read_text()
        assert log.count("identity_flapping") == 1, log[-3000:]
