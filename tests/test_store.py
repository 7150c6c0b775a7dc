"""Window store: counter resets, restarts mid-window, gap-free energy attribution, bounded history."""

from exporter.samples import DeviceReading, EngineInfo, EngineReading
from exporter.store import DeviceTracker, ServerHistory, counter_deltas, engine_deltas


def reading(counters, gauges=None, start=None):
    return EngineReading(counters=dict(counters), gauges=dict(gauges or {}),
                         info=EngineInfo(process_start_time_seconds=start))


def test_counter_reset_re_bases_never_a_negative_or_catch_up_delta():
    assert counter_deltas({"g": 1000}, {"g": 30}, restarted=False) == {}  # unknown this step
    assert counter_deltas({"g": 1000}, {"g": 1010}, restarted=False) == {"g": 10}
    assert counter_deltas({"g": 1000}, {"g": 30}, restarted=True) == {"g": 30}  # new process: from zero


def test_per_engine_deltas_an_engine_vanishing_reappearing_or_resetting_adds_nothing():
    big = 1e9  # what each engine served before
    prev = {"0": {"g": big, "p": 5.0}, "1": {"g": big}}
    assert engine_deltas(prev, {"0": {"g": big + 100, "p": 5.0}, "1": {"g": big + 50}}, False) == {"g": 150, "p": 0}
    assert engine_deltas(prev, {"0": {"g": big + 100, "p": 5.0}}, False) == {"g": 100, "p": 0}  # 1 vanished
    assert engine_deltas({"0": {"g": big}}, {"0": {"g": big + 100}, "1": {"g": big}}, False) == {"g": 100}  # back
    assert engine_deltas(prev, {"0": {"g": big + 100}, "1": {"g": 7.0}}, False) == {"g": 100}  # 1 reset
    assert engine_deltas(prev, {"0": {"g": 3.0}, "1": {"g": 7.0}}, False) == {}  # both reset: unknown
    assert engine_deltas(prev, {"0": {"g": 3.0}, "1": {"g": 7.0}}, True) == {"g": 10}  # new process


def test_history_of_two_engines_counts_no_catch_up_and_logs_the_change_once(caplog):
    h = ServerHistory(max_age_seconds=600, name="dp")
    both = lambda g0, g1: EngineReading(counters={"g": g0 + g1}, gauges={}, info=EngineInfo(),
                                        engine_counters={"0": {"g": g0}, "1": {"g": g1}})
    one = lambda g0: EngineReading(counters={"g": g0}, gauges={}, info=EngineInfo(), engine_counters={"0": {"g": g0}})
    h.add_reading(0.0, both(1e9, 1e9))
    with caplog.at_level("INFO", logger="kvwatt.store"):
        deltas = [h.add_reading(float(t), r).deltas.get("g") for t, r in
                  enumerate([both(1e9 + 100, 1e9 + 100), one(1e9 + 200), one(1e9 + 300), both(1e9 + 400, 2e9),
                             both(1e9 + 500, 2e9 + 100), both(1e9 + 600, 10.0)], start=1)]
    assert deltas == [200, 100, 100, 100, 200, 100]
    assert h.restarts == 1  # engine 1's reset; vanishing and reappearing are not restarts
    lines = [r.getMessage() for r in caplog.records]
    assert sum("vanished" in m for m in lines) == 1 and sum("appeared" in m for m in lines) == 1
    assert sum("went down" in m for m in lines) == 1 and all(m.startswith("dp: ") for m in lines)


def test_a_counter_seen_for_the_first_time_has_no_delta_yet():
    assert counter_deltas({}, {"g": 5}, restarted=False) == {}


def test_server_restart_mid_window_counts_from_zero_only_where_the_counters_went_down():
    h = ServerHistory(max_age_seconds=600)
    h.add_reading(0.0, reading({"g": 100, "p": 40}, start=1000.0))
    h.add_reading(1.0, reading({"g": 150, "p": 40}, start=1000.0))
    iv = h.add_reading(2.0, reading({"g": 30, "p": 45}, start=2000.0))  # restarted: g counts from zero again
    assert iv.deltas == {"g": 30, "p": 5}  # p did not go down: its rise, never its whole value
    assert [i.deltas["g"] for i in h.window(2.0, 60)] == [50, 30]
    assert h.restarts == 1


def test_a_start_time_moving_forward_while_the_counters_climb_is_the_same_process():
    h = ServerHistory(max_age_seconds=600)  # a new process already past the old counters at its first read
    h.add_reading(0.0, reading({"g": 100}, start=1000.0))  # is not one; the old rule counted 170 here
    h.add_reading(1.0, reading({"g": 150}, start=1000.0))
    iv = h.add_reading(2.0, reading({"g": 170}, start=2000.0))
    assert iv.deltas["g"] == 20 and h.restarts == 0


def test_window_selects_recent_intervals_and_history_is_bounded_by_age():
    h = ServerHistory(max_age_seconds=10)
    for t in range(0, 30):
        h.add_reading(float(t), reading({"g": t * 10.0}, {"kv_usage": t / 100}))
    assert len(h.window(29.0, 5)) == 5
    assert all(iv.t1 >= 19.0 for iv in h.intervals)  # older than max age dropped


def test_an_outage_interval_is_not_stretched_into_a_short_window():
    h = ServerHistory(max_age_seconds=600)
    h.add_reading(0.0, reading({"g": 0}))
    iv = h.add_reading(100.0, reading({"g": 50}))  # 100 s without a successful read
    assert iv.seconds == 100.0
    assert h.window(100.0, 60) == []  # started before the window: excluded, not prorated


def test_energy_accumulates_across_missed_reads_and_a_gap_voids_the_scope():
    h = ServerHistory(max_age_seconds=600)
    h.add_reading(0.0, reading({"g": 0}))
    h.add_energy("gpu", 100.0, 60.0)
    h.add_energy("gpu", 110.0, 60.0)  # the server's read failed on this tick: energy carried over
    h.add_energy("host", 20.0, None)
    iv = h.add_reading(2.0, reading({"g": 10}))
    assert iv.energy_joules == {"gpu": 210.0, "host": 20.0}
    assert iv.idle_joules == {"gpu": 120.0}
    h.add_energy("gpu", 100.0, 60.0)
    h.add_energy("gpu", None, None)  # one tick without a GPU sample: the whole span is unknown
    iv = h.add_reading(4.0, reading({"g": 20}))
    assert "gpu" not in iv.energy_joules


def test_device_tracker_drops_discontinuities_and_rebases_after_a_missing_read():
    tr = DeviceTracker()
    mk = lambda j, cont=True: [DeviceReading(device="gpu:a", kind="gpu", labels={}, joules_total=j, continuous=cont)]
    assert tr.deltas(mk(10.0)) == {"gpu:a": None}  # first sight
    assert tr.deltas(mk(15.0)) == {"gpu:a": 5.0}
    assert tr.deltas(mk(None)) == {"gpu:a": None}
    assert tr.deltas(mk(40.0)) == {"gpu:a": None}  # no catch-up delta over the missing tick
    assert tr.deltas(mk(42.0)) == {"gpu:a": 2.0}
    assert tr.deltas(mk(50.0, cont=False)) == {"gpu:a": None}
    assert tr.deltas(mk(49.0)) == {"gpu:a": None}  # a decrease is a reset, never negative


def test_device_tracker_spans_time_each_step_by_the_readings_own_read_at():
    tr = DeviceTracker()
    mk = lambda j, at: [DeviceReading(device="gpu:a", kind="gpu", labels={}, joules_total=j, read_at=at)]
    assert tr.spans(mk(10.0, 100.0)) == {"gpu:a": None}  # first sight
    assert tr.spans(mk(85.0, 101.5)) == {"gpu:a": (75.0, 1.5)}  # seconds from read_at, not from the tick
    assert tr.spans(mk(None, None)) == {"gpu:a": None}
    assert tr.spans(mk(90.0, 103.0)) == {"gpu:a": None}  # re-based after the missing read
    assert tr.spans(mk(95.0, 104.0)) == {"gpu:a": (5.0, 1.0)}
    assert tr.spans(mk(96.0, None)) == {"gpu:a": None}  # a sample without its time is not a span


def test_registered_windows_slide_on_advance_even_without_a_reading():
    h = ServerHistory(max_age_seconds=600, windows=(10.0,), grids=(5.0,))
    for t in range(0, 21):
        h.add_reading(float(t), reading({"g": t * 2.0}, {"kv_usage": t / 100}))
    assert h.aggregate(10.0).n == 10 and h.aggregate(10.0).delta("g") == 20.0
    h.advance(25.0)  # the server's reads failed for 5 s: the window still moves on
    assert h.aggregate(10.0).n == 5 and list(h.aggregate(10.0).intervals) == h.window(25.0, 10.0)
    assert [(b.t0, b.t1) for b in h.buckets(5.0, 10.0, 25.0)] == [(10, 15), (15, 20)]  # [20, 25) had none
    assert h.aggregate(7.0).n == len(h.window(25.0, 7.0))  # unregistered: built from the list


def test_a_reading_without_counters_is_no_engine_change(caplog):
    h = ServerHistory(max_age_seconds=600, name="s")
    one = lambda g: EngineReading(counters={"g": g}, gauges={}, info=EngineInfo(), engine_counters={"0": {"g": g}})
    h.add_reading(0.0, one(10.0))
    with caplog.at_level("INFO", logger="kvwatt.store"):
        assert h.add_reading(1.0, EngineReading(counters={}, gauges={"kv_usage": 0.5}, info=EngineInfo())).deltas == {}
        assert h.add_reading(2.0, one(20.0)).deltas == {}  # back: re-based, no catch-up of 10
        assert h.add_reading(3.0, one(25.0)).deltas == {"g": 5.0}
    assert [r.getMessage() for r in caplog.records] == ["s: engine(s) ['0'] vanished: they count for nothing "
                                                        "until they are back",
                                                        "s: engine(s) ['0'] appeared: their counters start from "
                                                        "this reading"]
