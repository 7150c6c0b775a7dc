"""The experiment state file: transitions, atomic and kill-safe writes, what --resume accepts, the lock,
and stopping a server left behind by a killed experiment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from kvwatt_lab.experiment.plan import load_plan, run_order
from kvwatt_lab.experiment.server import group_alive, process_start_ticks
from kvwatt_lab.experiment.state import DirectoryLock, ExperimentState, open_state, reap_leftover_server

from exporter.config import ConfigError

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "tests" / "data" / "office_work_8k.sample.jsonl"


def make_plan(tmp_path: Path, blocks_small: int = 128, measure: str = "5m"):
    data = {"seed": 1, "repeats": 2, "phases": {"measure": measure},
            "server": {"command": ["serve", "--blocks", "{blocks}", "--port", "{port}"]},
            "workload": {"trace": str(SAMPLE), "length_scale": 0.05},
            "conditions": [{"name": "large", "vars": {"blocks": 2000}},
                           {"name": "small", "vars": {"blocks": blocks_small}}]}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_plan(str(path))


def test_transitions_are_saved_at_once(tmp_path):
    plan = make_plan(tmp_path)
    order = run_order(plan)
    state = open_state(str(tmp_path / "out"), plan, order, resume=False)
    first, second = order[0], order[1]
    state.start(first)
    assert ExperimentState.load(state.out_dir).in_progress == first.run_id
    state.finish(first, {"run": first.run_id, "condition": first.condition, "repeat": 1})
    state.start(second)
    state.fail(second, "server exited with status 1")
    stored = ExperimentState.load(state.out_dir)
    assert list(stored.finished) == [first.run_id] and stored.in_progress is None
    assert stored.data["failed"] == {"run": second.run_id, "error": "server exited with status 1",
                                     "unix": pytest.approx(time.time(), abs=60)}
    assert [r.run_id for r in stored.pending()] == [r.run_id for r in order[1:]]


def test_a_failed_write_leaves_the_previous_state(tmp_path, monkeypatch):
    plan = make_plan(tmp_path)
    order = run_order(plan)
    state = open_state(str(tmp_path / "out"), plan, order, resume=False)
    before = Path(state.path).read_bytes()

    def crash(*args):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        state.finish(order[0], {"run": order[0].run_id, "condition": order[0].condition, "repeat": 1})
    monkeypatch.undo()
    assert Path(state.path).read_bytes() == before
    assert [p.name for p in Path(state.out_dir).iterdir()] == ["state.json"]  # no temporary file left


WRITER = """
import sys
from kvwatt_lab.experiment.plan import load_plan, run_order
from kvwatt_lab.experiment.state import open_state
plan = load_plan(sys.argv[1])
state = open_state(sys.argv[2], plan, run_order(plan), resume=True)
i = len(state.finished)
print("ready", flush=True)
while True:
    run = state.order[i % len(state.order)]
    state.start(run)
    state.finish(run, {"run": run.run_id, "condition": run.condition, "repeat": run.repeat, "i": i,
                       "padding": "x" * 20000})
    i += 1
"""


def test_kill_9_at_any_moment_leaves_a_loadable_state(tmp_path):
    plan = make_plan(tmp_path)
    out = tmp_path / "out"
    open_state(str(out), plan, run_order(plan), resume=False)
    for delay in (0.05, 0.13, 0.21, 0.34, 0.5):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, plan.path, str(out)], cwd=REPO,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        stored = ExperimentState.load(str(out))  # raises on a torn file
        assert json.loads(Path(stored.path).read_text())["version"] == 1
        assert all(r["padding"] == "x" * 20000 for r in stored.finished.values())


def test_resume_accepts_only_changes_that_touch_no_finished_run(tmp_path):
    out = str(tmp_path / "out")
    plan = make_plan(tmp_path)
    order = run_order(plan)
    state = open_state(out, plan, order, resume=False)
    with pytest.raises(ConfigError, match="already holds an experiment"):
        open_state(out, plan, order, resume=False)
    large = next(r for r in order if r.condition == "large")
    state.start(large)
    state.finish(large, {"run": large.run_id, "condition": "large", "repeat": large.repeat})

    changed = make_plan(tmp_path, blocks_small=96)  # 'small' has no finished run: fine
    resumed = open_state(out, changed, run_order(changed), resume=True)
    assert list(resumed.finished) == [large.run_id]
    assert resumed.data["plan"]["conditions"][1]["vars"] == {"blocks": "96"}

    with pytest.raises(ConfigError, match="protocol .* changed"):
        other = make_plan(tmp_path, measure="10m")
        open_state(out, other, run_order(other), resume=True)
    make_plan(tmp_path)
    path = tmp_path / "plan.yaml"
    path.write_text(path.read_text().replace("2000", "1000"))
    with pytest.raises(ConfigError, match="condition 'large' changed"):
        open_state(out, load_plan(str(path)), order, resume=True)


def test_one_experiment_per_output_directory(tmp_path):
    with DirectoryLock(str(tmp_path)):
        with pytest.raises(ConfigError, match="in use by another kvwatt experiment"):
            with DirectoryLock(str(tmp_path)):
                pass
    with DirectoryLock(str(tmp_path)):  # released
        pass


def test_resume_stops_the_server_left_by_a_killed_experiment_and_nothing_else(tmp_path):
    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                               "time.sleep(60)"], start_new_session=True)
    try:
        time.sleep(0.5)
        other_process = {"server_pid": leader.pid, "server_start_ticks": process_start_ticks(leader.pid) - 1}
        assert not reap_leftover_server(other_process)  # a recycled pid: left alone
        assert group_alive(leader.pid)
        ours = {"server_pid": leader.pid, "server_start_ticks": process_start_ticks(leader.pid)}
        assert reap_leftover_server(ours)
        assert not group_alive(leader.pid), "the server's child survived"
    finally:
        if leader.poll() is None:
            os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()
