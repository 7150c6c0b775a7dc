"""The state directory: unwritable (the default falls back to the per-user one, a configured one is a reason),
locked against a second daemon, cleared of orphaned temporary files; a bad state file; a /healthz that fails
while the exposition cannot render. Mostly real `kvwatt run` subprocesses on loopback with the NVML double."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest
import requests

from exporter.idle.baseline import STATE_FILE
from exporter.runtime import atomic
from exporter.runtime.statedir import LOCK_FILE, open_state_dir, user_state_dir
from exporter.samples import reason_code
from tests.support.daemon import REPO, KvwattDaemon
from tests.support.fake_gpus import FakeGpus
from tests.support.loopback import MetricsServer

IDLE = ('vllm:num_requests_running{model_name="m",engine="0"} 0\n'
        'vllm:num_requests_waiting{model_name="m",engine="0"} 0\n'
        'vllm:generation_tokens_total{model_name="m",engine="0"} 7\n'
        'vllm:prompt_tokens_total{model_name="m",engine="0"} 21\n')
FAST_LEARNING = {"idle_settle": "1s", "idle_min_duration": "1s"}  # a learned baseline ~2.5 s after start


def gpus_at(tmp_path, name: str, watts: dict[str, float]) -> FakeGpus:
    gpus = FakeGpus(tmp_path / f"{name}.json", energy_read_latency=0)
    t0 = time.monotonic()
    for uuid, w in watts.items():
        gpus.add(uuid, power_mw=w * 1000, counter_follows_power=True, t0=t0)
    return gpus


def state_info(d: KvwattDaemon) -> dict | None:
    """The labels of kvwatt_source_info{source="state_dir"} with the whole reason from /api/status in place of
    the label's vocabulary word (checked here to be the reason's first word), None when absent."""
    hits = [dict(lab) for (n, lab), _ in d.metrics().items() if n == "kvwatt_source_info" and
            ("source", "state_dir") in lab]
    assert len(hits) <= 1
    if not hits:
        return None
    [status] = [s for s in d.status()["sources"] if s["source"] == "state_dir"]
    assert hits[0]["reason"] == status["reason_code"] == reason_code(status["reason"])
    return {**hits[0], "reason": status["reason"]}


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# --- opening the directory -----------------------------------------------------------------------------------
def test_default_dir_not_writable_falls_back_to_the_per_user_dir_and_says_so(tmp_path, caplog):
    (tmp_path / "file").write_text("")
    default = str(tmp_path / "file" / "kvwatt")  # like /var/lib/kvwatt for a user who is not root
    caplog.set_level(logging.INFO, "kvwatt.state")
    state = open_state_dir(default, env={"XDG_STATE_HOME": str(tmp_path / "xdg")}, default=default)
    try:
        assert (state.path, state.reason) == (str(tmp_path / "xdg" / "kvwatt"), "")
        assert os.path.isfile(os.path.join(state.path, LOCK_FILE))
        assert any("is not writable (Not a directory); using " + state.path in r.getMessage()
                   for r in caplog.records)
    finally:
        state.close()
    assert user_state_dir({"HOME": "/home/u"}) == "/home/u/.local/state/kvwatt"
    assert user_state_dir({"HOME": "/home/u", "XDG_STATE_HOME": "relative"}) == "/home/u/.local/state/kvwatt"


def test_a_configured_dir_that_cannot_be_written_is_a_reason_not_a_fallback(tmp_path):
    (tmp_path / "file").write_text("")
    configured = str(tmp_path / "file" / "state")
    state = open_state_dir(configured, env={"XDG_STATE_HOME": str(tmp_path / "xdg")}, default="/elsewhere")
    assert state.path == configured and state.lock_fd is None
    assert state.reason == f"not persisted: cannot write {configured} (Not a directory)"
    assert not (tmp_path / "xdg").exists()


def test_the_lock_admits_one_daemon_at_a_time(tmp_path):
    first = open_state_dir(str(tmp_path))
    second = open_state_dir(str(tmp_path))
    assert first.reason == ""
    assert second.reason == f"not persisted: {tmp_path} is in use by another kvwatt (pid {os.getpid()})"
    first.close()
    third = open_state_dir(str(tmp_path))
    assert third.reason == ""
    third.close()


def test_a_lock_file_that_is_a_symlink_is_not_followed(tmp_path, caplog):
    """issue 38: kvwatt.lock linked to another file had that file truncated to kvwatt's PID. Now the link is
    refused with one line (the baselines kept in memory) and its target is untouched."""
    state, victim = tmp_path / "state", tmp_path / "precious.txt"
    state.mkdir()
    victim.write_text("keep me\n")
    (state / LOCK_FILE).symlink_to(victim)
    with caplog.at_level(logging.WARNING, logger="kvwatt"):
        opened = open_state_dir(str(state))
    assert victim.read_text() == "keep me\n"
    assert opened.lock_fd is None and reason_code(opened.reason) == "not_persisted"
    assert opened.reason == (f"not persisted: cannot write {state / LOCK_FILE} (a symbolic link, not followed: "
                             "remove it)")
    assert [r.getMessage() for r in caplog.records if "symbolic link" in r.getMessage()] != []
    (state / LOCK_FILE).unlink()
    os.mkfifo(state / LOCK_FILE)  # nor a FIFO (opened read-write it does not block, but it locks nothing)
    assert "not a regular file" in open_state_dir(str(state)).reason


def test_only_orphaned_temporary_files_of_kvwatt_are_removed(tmp_path):
    def plant(name: str, age_seconds: float) -> None:
        (tmp_path / name).write_text("{")
        t = time.time() - age_seconds
        os.utime(tmp_path / name, (t, t))

    gone, alive = dead_pid(), os.getppid()
    orphans = {f".tmp-kvwatt-{gone}-abc123xy": 10,  # its writer is gone
               f".tmp-kvwatt-{os.getpid()}-abc123xy": 10,  # this process has written nothing yet: a past life's
               f".tmp-kvwatt-{alive}-old_1234": 3600,  # a live pid, but no write takes an hour
               ".tmp-k2j4_x9a": 3600}  # an old kvwatt's name (no pid), an hour old
    kept = {f".tmp-kvwatt-{gone}-fresh123": 0.5,  # maybe a write in flight in another pid namespace
            f".tmp-kvwatt-{alive}-writing1": 10,  # its writer runs
            ".tmp-k2j4_x9b": 60,  # an old kvwatt's name, but recent
            ".tmp-notes.txt": 3600, ".tmp-ab": 3600, "idle-baseline.json": 3600, "kvwatt.lock": 3600}
    for name, age in {**orphans, **kept}.items():
        plant(name, age)
    assert atomic.remove_orphans(str(tmp_path)) == len(orphans)
    assert sorted(os.listdir(tmp_path)) == sorted(kept)


# --- a real daemon ---------------------------------------------------------------------------------------------
def test_unwritable_state_dir_keeps_the_daemon_and_its_learned_baseline(tmp_path):
    """Was: the first learned baseline raised NotADirectoryError out of the tick (/healthz 503, a traceback)."""
    (tmp_path / "file").write_text("")
    state_dir = str(tmp_path / "file" / "state")
    gpus = gpus_at(tmp_path, "gpus", {"GPU-unwritable": 60.0})
    with MetricsServer(lambda: IDLE) as vllm, \
            KvwattDaemon(servers={"a": vllm.url}, config={"state_dir": state_dir, **FAST_LEARNING},
                         env=gpus.env(), interval="250ms") as d:
        d.wait_for(lambda d: d.value("kvwatt_gpu_idle_power_watts", uuid="GPU-unwritable") is not None,
                   timeout=20, what="a learned idle baseline")
        assert d.value("kvwatt_gpu_idle_power_watts", uuid="GPU-unwritable") == pytest.approx(60.0, rel=0.05)
        time.sleep(1.0)  # ticks after the baseline was learned (and not written)
        assert requests.get(d.url + "/healthz", timeout=5).status_code == 200
        info = state_info(d)
        assert info["state"] == "degraded"
        assert info["reason"] == f"not persisted: cannot write {state_dir} (Not a directory)"
        assert d.value("kvwatt_source_up", source="state_dir") == 1
        assert d.value("kvwatt_sample_duration_seconds", source="state_dir") is None  # no timed read
        assert d.proc.poll() is None
        log = d.log()
        assert "tick failed" not in log and "Traceback" not in log
        assert log.count("kept in memory only, not persisted") == 1


def test_second_daemon_on_one_state_dir_warns_and_does_not_write(tmp_path):
    state_dir = str(tmp_path / "shared")
    first_gpus = gpus_at(tmp_path, "first", {"GPU-first": 60.0})
    second_gpus = gpus_at(tmp_path, "second", {"GPU-second": 70.0})
    config = {"state_dir": state_dir, **FAST_LEARNING}
    with MetricsServer(lambda: IDLE) as vllm, \
            KvwattDaemon(servers={"a": vllm.url}, config=config, env=first_gpus.env(), interval="250ms") as one, \
            KvwattDaemon(servers={"a": vllm.url}, config=config, env=second_gpus.env(), interval="250ms") as two:
        for d, uuid in ((one, "GPU-first"), (two, "GPU-second")):
            d.wait_for(lambda d: d.value("kvwatt_gpu_idle_power_watts", uuid=uuid) is not None, timeout=20,
                       what=f"{uuid} learned")
        assert state_info(one)["state"] == "ok"
        reason = f"not persisted: {state_dir} is in use by another kvwatt (pid {one.proc.pid})"
        assert state_info(two) == {"source": "state_dir", "server": "", "state": "degraded", "reason": reason}
        assert two.log().count(reason.removeprefix("not persisted: ")) == 1
        stored = json.loads(open(os.path.join(state_dir, STATE_FILE)).read())["devices"]
        assert set(stored) == {"gpu:GPU-first"}  # the second daemon's baseline lives in its memory only
        assert requests.get(two.url + "/healthz", timeout=5).status_code == 200


WRITER = """
import sys, time
sys.path.insert(0, {repo!r})
from exporter.runtime import atomic
from exporter.idle.baseline import BaselineBook, IdleEstimate
book = BaselineBook({state!r})
estimates = lambda i: [IdleEstimate(f"gpu:GPU-{{n}}", 50.0 + i % 7, float(i), 30.0) for n in range(400)]
for i in range(3):  # whole writes first: the state file exists
    book.record(estimates(i), "learned")
def stall(tmp, path):  # the temporary file is written and fsynced, the rename not done: kill -9 lands here
    print("mid-write", flush=True)
    time.sleep(60)
atomic.os.replace = stall
book.record(estimates(3), "learned")
"""


def kvwatt_tmp_files(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(".tmp-"))


def test_orphans_of_killed_writes_are_removed_at_start(tmp_path):
    state = tmp_path / "state"
    for _ in range(3):  # kill -9 a writer mid-write (between its temporary file and the rename), three times
        proc = subprocess.Popen([sys.executable, "-c", WRITER.format(repo=str(REPO), state=str(state))],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "mid-write"
        proc.kill()
        proc.wait()
        proc.stdout.close()
    orphans = kvwatt_tmp_files(state)
    assert len(orphans) == 3 and all(n.startswith(atomic.TMP_PREFIX) for n in orphans)
    (state / ".tmp-notes.txt").write_text("someone else's")  # not a name kvwatt writes: kept
    time.sleep(atomic.FRESH_SECONDS)
    with KvwattDaemon(config={"state_dir": str(state), "nvml": False}, interval="250ms") as d:
        assert kvwatt_tmp_files(state) == [".tmp-notes.txt"]
        assert f"removed {len(orphans)} orphaned temporary files" in d.log()
        json.loads((state / STATE_FILE).read_text())  # the state file itself is whole and kept


def test_bad_state_file_entries_are_dropped_and_the_daemon_serves(tmp_path):
    """Was: watts "abc" or measured_at "yesterday" failed every tick (never healthy); -50 W and 1e308 W exported."""
    good, bad = "GPU-good", {"GPU-abc": {"watts": "abc"}, "GPU-yesterday": {"measured_at": "yesterday"},
                             "GPU-negative": {"watts": -50}, "GPU-huge": {"watts": 1e308}}
    gpus = gpus_at(tmp_path, "gpus", {u: 100.0 for u in (good, *bad)})
    now = time.time()
    entry = {"watts": 55.0, "method": "measured", "measured_at": now - 3600, "duration_seconds": 30.0,
             "temperature_celsius": 33.0}
    state = tmp_path / "state"
    state.mkdir()
    atomic.write_json(str(state / STATE_FILE), {"version": 1, "devices": {
        f"gpu:{good}": entry, **{f"gpu:{u}": {**entry, **over} for u, over in bad.items()}}})
    with MetricsServer(lambda: IDLE) as vllm, \
            KvwattDaemon(servers={"a": vllm.url}, config={"state_dir": str(state)}, env=gpus.env(),
                         interval="250ms") as d:
        d.wait_for(lambda d: d.value("kvwatt_gpu_idle_power_watts", uuid=good) == 55.0,
                   what="the good baseline")
        for uuid in bad:
            assert d.value("kvwatt_gpu_idle_power_watts", uuid=uuid) is None
            assert d.value("kvwatt_idle_baseline_age_seconds", device=f"gpu:{uuid}") is None
        assert 3600 <= d.value("kvwatt_idle_baseline_age_seconds", device=f"gpu:{good}") < 3700
        info = state_info(d)
        assert info["state"] == "degraded" and info["reason"].startswith(f"dropped: {state / STATE_FILE}: 4 bad")

        # the live reload (BaselineBook.refresh_if_changed) checks the same way
        atomic.write_json(str(state / STATE_FILE), {"version": 1, "devices": {
            f"gpu:{good}": {**entry, "watts": 61.0}, "gpu:GPU-abc": {**entry, "watts": "oops"}}})
        d.wait_for(lambda d: d.value("kvwatt_gpu_idle_power_watts", uuid=good) == 61.0, what="the reload")
        reason = state_info(d)["reason"]
        assert reason.startswith(f"dropped: {state / STATE_FILE}: 1 bad entries (gpu:GPU-abc: watts 'oops'")
        time.sleep(1.0)
        assert requests.get(d.url + "/healthz", timeout=5).status_code == 200
        log = d.log()
        assert "tick failed" not in log
        assert log.count("4 bad entries") == 1 and log.count("1 bad entries") == 1  # one warning per change


def test_healthz_fails_while_the_exposition_cannot_render(tmp_path):
    flag = tmp_path / "fail-render"
    with MetricsServer(lambda: IDLE) as vllm, \
            KvwattDaemon(servers={"a": vllm.url}, config={"nvml": False}, interval="250ms",
                         module="tests.support.faulty_render", env={"KVWATT_FAIL_RENDER": str(flag)}) as d:
        assert d.value("kvwatt_source_up", source="vllm", server="a") == 1
        flag.write_text("")
        d.wait_for(lambda d: requests.get(d.url + "/healthz", timeout=5).status_code == 503, timeout=10,
                   what="/healthz 503")
        time.sleep(1.0)  # several failing ticks
        assert requests.get(d.url + "/healthz", timeout=5).status_code == 503
        metrics = requests.get(d.url + "/metrics", timeout=5)  # the last good exposition, still served
        assert metrics.status_code == 200 and b"kvwatt_source_up" in metrics.content
        assert d.log().count("tick failed") == 1  # logged when it starts failing, not per tick
        flag.unlink()
        d.wait_for(lambda d: requests.get(d.url + "/healthz", timeout=5).status_code == 200, timeout=10,
                   what="/healthz 200 again")


def test_baseline_idle_with_an_unwritable_state_dir_is_one_line_and_exit_2(tmp_path):
    """Was: measured for --duration, then a NotADirectoryError traceback."""
    (tmp_path / "file").write_text("")
    gpus = gpus_at(tmp_path, "gpus", {"GPU-cmd": 60.0})
    out = subprocess.run([sys.executable, "-m", "exporter", "baseline", "idle", "--duration", "1s", "--settle",
                          "0", "--no-server-check", "--state-dir", str(tmp_path / "file" / "state"),
                          "--powercap-root", str(tmp_path / "none")], env={**os.environ, **gpus.env()},
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"kvwatt: error: state_dir: cannot write {tmp_path / 'file' / 'state'} (Not a directory)")
    assert "Traceback" not in out.stderr


def test_only_a_failed_bind_is_reported_as_cannot_serve(tmp_path):
    """'cannot serve on HOST:PORT' (exit 2) was printed for any OSError, a state dir's 'Not a directory' too."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "exporter", "run", "--listen", f"127.0.0.1:{port}",
                              "--state-dir", str(tmp_path / "state"), "--server", "a=http://127.0.0.1:9"],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() if " level=error " in line]
    assert len(errors) == 1 and f"cannot serve on 127.0.0.1:{port}: " in errors[0] and "in use" in errors[0]
    assert "Traceback" not in out.stderr
