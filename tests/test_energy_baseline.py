"""Idle baseline: the learner state machine (driven without time passing) and its persistence."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from exporter.idle.baseline import STATE_FILE, UNKNOWN_HOLD_SECONDS, BaselineBook, IdleEstimate, IdleLearner

REPO = Path(__file__).resolve().parents[1]
G, H = "gpu:GPU-a", "rapl:package-0:package"


def run(learner, start, end, idle, watts=None, temps=None, step=1.0):
    """Feed one tick per ``step`` seconds over (start, end]; returns every estimate handed out."""
    out, t = [], start
    watts = watts or {G: 60.0, H: 40.0}
    while t < end - 1e-9:
        t += step
        joules = {d: (None if w is None else w * step) for d, w in watts.items()}
        out += learner.feed(t, idle, joules, temps)
    return out


def test_learns_after_settle_and_min_duration():
    lr = IdleLearner(settle_seconds=30, min_seconds=30)
    assert run(lr, 0, 10, idle=False, watts={G: 400.0, H: 150.0}) == []
    assert run(lr, 10, 69, idle=True) == []  # 30 s settle (10..40), then only 29 s of samples
    assert lr.state == "measuring"
    got = run(lr, 69, 70, idle=True)
    assert {e.device: (e.watts, e.duration_seconds) for e in got} == {G: (60.0, 30.0), H: (40.0, 30.0)}


def test_settle_excludes_the_high_clocks_after_work():
    lr = IdleLearner(settle_seconds=30, min_seconds=30)
    run(lr, 0, 1, idle=False)
    run(lr, 1, 31, idle=True, watts={G: 200.0, H: 40.0})  # clocks still high: must not count
    got = run(lr, 31, 61, idle=True)
    assert [e.watts for e in got if e.device == G] == [60.0]


def test_interrupted_stretch_commits_nothing_and_settles_again():
    lr = IdleLearner(settle_seconds=10, min_seconds=30)
    run(lr, 0, 1, idle=False)
    assert run(lr, 1, 30, idle=True) == []  # 10 s settle + 19 s measured
    assert run(lr, 30, 31, idle=False) == []  # a request came: too short, discarded
    assert lr.state == "busy" and lr.acc == {}
    assert run(lr, 31, 70, idle=True) == []  # settle again (31..41), then 29 s
    assert len(run(lr, 70, 71, idle=True)) == 2


def test_device_without_sample_does_not_count_those_seconds():
    lr = IdleLearner(settle_seconds=0, min_seconds=30)
    run(lr, 0, 1, idle=False)
    got = run(lr, 1, 31, idle=True, watts={G: 60.0, H: None})  # RAPL unreadable: unknown, not 0 W
    assert [e.device for e in got] == [G]
    got = run(lr, 31, 61, idle=True)
    assert [(e.device, e.watts, e.duration_seconds) for e in got] == [(H, 40.0, 30.0)]



def test_a_short_unanswered_gap_leaves_the_stretch_standing_and_counts_for_no_device():
    """A busy server's /metrics can miss a read: unknown is not busy. Those steps count for no device (their
    joules are not idle evidence), the stretch goes on, and its next answer's interval spans the gap."""
    lr = IdleLearner(settle_seconds=0, min_seconds=30)
    run(lr, 0, 1, idle=False)
    assert run(lr, 1, 21, idle=True) == []  # 20 s measured
    assert run(lr, 21, 21 + UNKNOWN_HOLD_SECONDS, idle=None, watts={G: 500.0, H: 500.0}) == []  # not counted
    assert lr.state == "measuring"
    got = run(lr, 21 + UNKNOWN_HOLD_SECONDS, 31 + UNKNOWN_HOLD_SECONDS, idle=True)
    assert {e.device: (e.watts, e.duration_seconds) for e in got} == {G: (60.0, 30.0), H: (40.0, 30.0)}


def test_a_long_unanswered_gap_ends_the_stretch_and_work_after_it_too():
    lr = IdleLearner(settle_seconds=5, min_seconds=30)
    run(lr, 0, 1, idle=False)
    run(lr, 1, 20, idle=True)
    assert run(lr, 20, 21 + UNKNOWN_HOLD_SECONDS, idle=None) == []  # longer than the hold: over, too short
    assert lr.state == "busy" and lr.acc == {}
    lr = IdleLearner(settle_seconds=0, min_seconds=30)
    run(lr, 0, 1, idle=False)
    run(lr, 1, 20, idle=True)
    run(lr, 20, 22, idle=None)
    assert run(lr, 22, 23, idle=False) == [] and lr.state == "busy"  # the gap's interval showed work


def test_the_shared_devices_are_idle_only_when_every_server_is():
    from exporter.model.energy import everyone_idle

    assert everyone_idle({"a": True, "b": True}) is True
    assert everyone_idle({"a": True, "b": None}) is None  # one did not answer: unknown, not busy
    assert everyone_idle({"a": False, "b": None}) is False
    assert everyone_idle({}) is False


def test_a_server_that_did_not_answer_is_unknown_not_busy():
    from exporter.model.energy import is_idle
    from exporter.samples import Interval, SourceStatus

    up, down = SourceStatus(source="vllm", server="a",
                            up=True), SourceStatus(source="vllm", server="a", up=False, reason="timeout")
    quiet = Interval(t0=9.0, t1=10.0, deltas={"generation_tokens": 0.0, "prompt_tokens": 0.0},
                     gauges={"running": 0.0, "waiting": 0.0})
    assert is_idle(up, quiet, 10.0) is True
    assert is_idle(down, quiet, 11.0) is None and is_idle(up, quiet, 11.0) is None  # no interval ending at t
    busy = Interval(t0=9.0, t1=10.0, deltas={"generation_tokens": 12.0}, gauges={"running": 1.0, "waiting": 0.0})
    assert is_idle(up, busy, 10.0) is False

def test_long_stretch_refreshes_and_commits_at_its_end():
    lr = IdleLearner(settle_seconds=0, min_seconds=30, refresh_seconds=100)
    run(lr, 0, 1, idle=False)
    got = run(lr, 1, 31, idle=True, watts={G: 60.0})
    assert [e.duration_seconds for e in got] == [30.0]
    got = run(lr, 31, 131, idle=True, watts={G: 60.0})
    assert [e.duration_seconds for e in got] == [130.0]
    run(lr, 131, 151, idle=True, watts={G: 66.0})
    got = run(lr, 151, 152, idle=False)  # end of stretch: what grew since the last estimate
    assert [(e.duration_seconds, round(e.watts, 6)) for e in got] == [(150.0, round((130 * 60 + 20 * 66) / 150, 6))]


def test_temperature_is_averaged():
    lr = IdleLearner(settle_seconds=0, min_seconds=3)
    run(lr, 0, 1, idle=False)
    lr.feed(2, True, {G: 60.0}, {G: 30.0})
    lr.feed(3, True, {G: 60.0}, {G: 32.0})
    (e,) = lr.feed(4, True, {G: 60.0}, {G: 34.0})
    assert e.temperature_celsius == 32.0


# --- the book -------------------------------------------------------------------------------------------
def test_persisted_with_time_duration_temperature_method_and_age(tmp_path):
    now = [1_700_000_000.0]
    book = BaselineBook(str(tmp_path), wall_clock=lambda: now[0])
    book.load()
    book.record([IdleEstimate(G, 61.5, 45.0, 33.0)], "learned")
    data = json.loads((tmp_path / STATE_FILE).read_text())
    assert data == {"version": 1, "devices": {G: {"watts": 61.5, "method": "learned", "measured_at": now[0],
                                                  "duration_seconds": 45.0, "temperature_celsius": 33.0}}}
    now[0] += 3600
    again = BaselineBook(str(tmp_path), wall_clock=lambda: now[0])  # a restart
    again.load()
    b = again.get(G)
    assert (b.watts, b.method, b.duration_seconds, b.temperature_celsius) == (61.5, "learned", 45.0, 33.0)
    assert b.age_seconds(now[0]) == 3600.0


def test_configured_override_wins_by_device_index_or_uuid(tmp_path):
    book = BaselineBook(str(tmp_path), {"gpu:1": 70.0, "GPU-b": 80.0, H: 35.0})
    book.load()
    book.record([IdleEstimate(G, 61.5, 45.0)], "measured")
    assert book.get(G, {"gpu": "0", "uuid": "GPU-a"}).method == "measured"
    assert book.get("gpu:GPU-c", {"gpu": "1", "uuid": "GPU-c"}).watts == 70.0
    assert book.get("gpu:GPU-b", {"gpu": "2", "uuid": "GPU-b"}).watts == 80.0
    b = book.get(H, {"zone": "package-0", "domain": "package"})
    assert (b.watts, b.method, b.age_seconds(time.time())) == (35.0, "configured", None)


def test_concurrent_command_result_is_kept_and_reloaded(tmp_path):
    daemon_book = BaselineBook(str(tmp_path), wall_clock=lambda: 1000.0)
    daemon_book.load()
    daemon_book.record([IdleEstimate(G, 60.0, 30.0)], "learned")
    command_book = BaselineBook(str(tmp_path), wall_clock=lambda: 2000.0)
    command_book.load()
    command_book.record([IdleEstimate(H, 41.0, 30.0)], "measured")
    assert daemon_book.refresh_if_changed() and daemon_book.get(H).watts == 41.0
    daemon_book.record([IdleEstimate(G, 62.0, 30.0)], "learned")  # must not drop the command's H
    final = BaselineBook(str(tmp_path))
    final.load()
    assert final.get(H).watts == 41.0 and final.get(G).watts == 62.0


def test_corrupt_or_foreign_file_is_ignored_not_fatal(tmp_path):
    (tmp_path / STATE_FILE).write_text("{not json")
    book = BaselineBook(str(tmp_path))
    book.load()
    assert book.stored() == {} and "ignored" in book.load_error
    (tmp_path / STATE_FILE).write_text(json.dumps({"version": 99, "devices": {}}))
    book.load()
    assert "unknown version" in book.load_error


WRITER = """
import sys
sys.path.insert(0, {repo!r})
from exporter.idle.baseline import BaselineBook, IdleEstimate
book = BaselineBook({state!r})
book.load()
i = 0
book.record([IdleEstimate(f"gpu:GPU-{{n}}", 50.0, 0.0, 30.0) for n in range(200)], "learned")
print("ready", flush=True)  # a whole file exists: every kill below lands on a rewrite of it
while True:
    i += 1
    book.record([IdleEstimate(f"gpu:GPU-{{n}}", 50.0 + i % 7, float(i), 30.0) for n in range(200)], "learned")
"""


def test_kill_9_mid_write_leaves_a_parsable_file(tmp_path):
    state = tmp_path / "state"
    path = state / STATE_FILE
    for attempt in range(12):
        proc = subprocess.Popen([sys.executable, "-c", WRITER.format(repo=str(REPO), state=str(state))],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.05 + 0.037 * attempt)  # land the kill at different points of the write cycle
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        data = json.loads(path.read_text())  # never half a file
        assert len(data["devices"]) == 200
        book = BaselineBook(str(state))
        book.load()
        assert book.load_error == "" and len(book.stored()) == 200


# --- a state file written by hand, or by a broken tool, must never reach the figures ------------------------
NOW = 1_700_000_000.0


def _entry(**over):
    return {"watts": 55.0, "method": "learned", "measured_at": NOW - 60, "duration_seconds": 40.0,
            "temperature_celsius": 31.0, **over}


BAD_ENTRIES = {
    "gpu:GPU-str": _entry(watts="abc"),  # was a TypeError in the tick loop
    "gpu:GPU-when": _entry(measured_at="yesterday"),  # was a TypeError in every snapshot
    "gpu:GPU-neg": _entry(watts=-50),
    "gpu:GPU-huge": _entry(watts=1e308),
    "gpu:GPU-bigint": _entry(watts=10**400),  # json reads it as an int; float() of it overflows
    "gpu:GPU-bool": _entry(watts=True),
    "gpu:GPU-method": _entry(method="guessed"),
    "gpu:GPU-future": _entry(measured_at=NOW + 10 * 86400),
    "gpu:GPU-temp": _entry(temperature_celsius="hot"),
    "gpu:GPU-missing": {"watts": 50.0, "method": "learned"},
    "gpu:GPU-list": [50.0],
}


def test_ill_typed_or_out_of_range_entries_are_dropped_with_one_warning(tmp_path, caplog):
    (tmp_path / STATE_FILE).write_text(json.dumps({"version": 1, "devices": {G: _entry(), **BAD_ENTRIES}}))
    book = BaselineBook(str(tmp_path), wall_clock=lambda: NOW)
    book.load()
    book.load()  # the same problems again: no second warning
    assert set(book.stored()) == {G} and book.watts(G) == 55.0
    for device in BAD_ENTRIES:
        assert book.get(device) is None
    assert book.load_error.startswith(f"dropped: {tmp_path / STATE_FILE}: 11 bad entries (")
    assert "watts 'abc' is not a finite number" in book.load_error
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "11 bad entries" in warnings[0].getMessage()
    st = book.status()
    assert (st.source, st.up, st.state, st.reason) == ("state_dir", True, "degraded", book.load_error)
    nan = float("nan")
    assert json.dumps(nan) == "NaN"  # json writes (and reads) NaN: it must be refused on read too
    (tmp_path / STATE_FILE).write_text(json.dumps({"version": 1, "devices": {G: _entry(watts=nan)}}))
    book.load()
    assert book.stored() == {} and "watts nan is not a finite number" in book.load_error


def test_live_reload_validates_and_keeps_the_good_entries(tmp_path):
    book = BaselineBook(str(tmp_path), wall_clock=lambda: NOW)
    book.load()
    book.record([IdleEstimate(G, 61.5, 45.0)], "learned")
    assert book.status().state == "ok"
    data = json.loads((tmp_path / STATE_FILE).read_text())
    data["devices"][H] = _entry(measured_at="yesterday")  # another process replaces the file
    (tmp_path / "replacement").write_text(json.dumps(data))
    os.replace(tmp_path / "replacement", tmp_path / STATE_FILE)
    assert book.refresh_if_changed()
    assert book.watts(G) == 61.5 and book.get(H) is None and "1 bad entries" in book.load_error
    book.record([IdleEstimate(H, 40.0, 30.0)], "learned")  # rewrites the file with valid entries only
    assert book.status().state == "ok"
    again = BaselineBook(str(tmp_path), wall_clock=lambda: NOW)
    again.load()
    assert again.load_error == "" and set(again.stored()) == {G, H}


def test_a_failed_write_is_a_reason_and_the_baseline_stays_in_force(tmp_path, caplog):
    (tmp_path / "file").write_text("")
    book = BaselineBook(str(tmp_path / "file" / "state"), wall_clock=lambda: NOW)  # a path under a file
    book.load()
    assert book.load_error == ""  # no file is no problem; the directory's own check says the rest
    new = book.record([IdleEstimate(G, 61.5, 45.0)], "learned")  # raised NotADirectoryError before
    assert [b.watts for b in new] == [61.5] and book.watts(G) == 61.5
    book.record([IdleEstimate(G, 62.0, 45.0)], "learned")
    assert book.watts(G) == 62.0
    assert book.write_error.startswith("not persisted: writing ") and "Not a directory" in book.write_error
    assert book.status().state == "degraded" and book.status().reason == book.write_error
    assert len([r for r in caplog.records if "not persisted" in r.getMessage()]) == 1  # once, not per write


def test_read_only_book_keeps_baselines_in_memory_and_writes_nothing(tmp_path):
    book = BaselineBook(str(tmp_path), wall_clock=lambda: NOW, read_only_reason="not persisted: locked")
    book.load()
    book.record([IdleEstimate(G, 61.5, 45.0)], "learned")
    assert book.watts(G) == 61.5 and not (tmp_path / STATE_FILE).exists()
    assert book.status().reason == "not persisted: locked"
    owner = BaselineBook(str(tmp_path), wall_clock=lambda: NOW + 1)  # the daemon holding the lock writes
    owner.load()
    owner.record([IdleEstimate(H, 40.0, 30.0)], "learned")
    assert book.refresh_if_changed()  # follows the owner's file, keeps what only it has learned
    assert (book.watts(G), book.watts(H)) == (61.5, 40.0)
