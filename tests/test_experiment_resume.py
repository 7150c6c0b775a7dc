"""`kvwatt experiment`'s failure paths end to end with a stand-in server (tests/support/loopback.py) and the plans
of tests/test_experiment_runner.py: a server that fails to start, a changed condition, a server killed
mid-measurement, kvwatt itself killed or terminated, and --resume after each; the dry run and the progress lines
of a slow start. (A file of its own so that the slow tier's workers run it beside the runner's full runs.)"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest
import yaml
from kvwatt_lab.experiment.plan import load_plan, run_order

from tests.support.engine import free_port
from tests.support.experiment import FAKE_SERVER, kill_server_group, load_state, pids_serving, run_experiment
from tests.test_experiment_runner import OFF, ON, SHORT, plan_for

pytestmark = pytest.mark.slow  # each test runs a real experiment (subprocesses, fake servers) for 6-45 s


def _seed_with_first(conditions, tmp_path, port, first: str) -> int:
    """A plan seed whose shuffled order starts with condition ``first``."""
    for seed in range(50):
        plan = plan_for(tmp_path, port, conditions, seed=seed)
        if run_order(load_plan(str(plan)))[0].condition == first:
            return seed
    raise AssertionError("no seed puts it first")


def test_server_that_fails_to_start_stops_the_experiment_and_resume_runs_the_rest(tmp_path):
    port = free_port()
    good, bad = {"name": "good", "vars": OFF}, {"name": "bad", "vars": {**OFF, "extra": "--fail-start"}}
    seed = _seed_with_first([good, bad], tmp_path, port, "good")
    plan = plan_for(tmp_path, port, [good, bad], seed=seed)
    out = tmp_path / "out"
    failed = run_experiment(plan, "--out", str(out), timeout=120)
    assert failed.returncode == 1, failed.stderr
    assert "run bad-r1 failed: server exited with status 2 before" in failed.stderr
    assert "unrecognized arguments: --fail-start" in failed.stderr  # the server log's tail
    state = load_state(out)
    assert list(state["finished"]) == ["good-r1"] and state["failed"]["run"] == "bad-r1"
    report = (out / "report.md").read_text()
    assert "INCOMPLETE: run bad-r1 failed: server exited with status 2" in report and "| good |" in report
    good_result = (out / "runs" / "good-r1" / "result.json").read_text()

    # a finished run's condition is untouched; fixing the failed one is allowed on resume
    plan = plan_for(tmp_path, port, [good, {"name": "bad", "vars": OFF}], seed=seed)
    resumed = run_experiment(plan, "--out", str(out), "--resume", timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert "[1/2] good-r1" not in resumed.stderr and "[2/2] bad-r1" in resumed.stderr
    assert (out / "runs" / "good-r1" / "result.json").read_text() == good_result
    assert (out / "runs" / "bad-r1.aborted-1" / "server.log").is_file()
    assert sorted(load_state(out)["finished"]) == ["bad-r1", "good-r1"]


def test_changing_a_finished_condition_refuses_to_resume(tmp_path):
    port = free_port()
    out = tmp_path / "out"
    plan = plan_for(tmp_path, port, [{"name": "a", "vars": OFF}])
    assert run_experiment(plan, "--out", str(out), timeout=60).returncode == 0
    again = run_experiment(plan, "--out", str(out), timeout=60)
    assert again.returncode == 2 and "already holds an experiment" in again.stderr
    plan = plan_for(tmp_path, port, [{"name": "a", "vars": {**OFF, "kv": 0.7}}])
    changed = run_experiment(plan, "--out", str(out), "--resume", timeout=60)
    assert changed.returncode == 2
    assert changed.stderr.strip().splitlines() == [
        "kvwatt: error: --resume: condition 'a' changed (server command, arguments, vars, env or workload) but "
        "has finished runs; restore it or use another --out"]


def test_server_killed_during_measurement_keeps_finished_runs_and_resume_redoes_it(tmp_path):
    port = free_port()
    plan = plan_for(tmp_path, port, [{"name": "solo", "vars": OFF}], repeats=2)
    out = tmp_path / "out"
    killed = []

    def kill_in_second_measurement(line, proc):
        if "solo-r2: measuring" in line:
            time.sleep(0.5)
            killed.extend(kill_server_group(port))

    failed = run_experiment(plan, "--out", str(out), on_line=kill_in_second_measurement, timeout=120)
    assert killed, "the server was not found to kill"
    assert failed.returncode == 1, failed.stderr
    assert "run solo-r2 failed: server was killed by SIGKILL during the measurement phase" in failed.stderr
    state = load_state(out)
    assert list(state["finished"]) == ["solo-r1"] and state["failed"]["run"] == "solo-r2"
    assert "| solo | – |" in (out / "report.md").read_text()
    resumed = run_experiment(plan, "--out", str(out), "--resume", timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming: 1 of 2 runs finished" in resumed.stderr and "[1/2]" not in resumed.stderr
    assert sorted(load_state(out)["finished"]) == ["solo-r1", "solo-r2"]


@pytest.mark.parametrize("sig, code", [(signal.SIGKILL, -9), (signal.SIGTERM, 143)])
def test_kvwatt_killed_mid_run_leaves_a_valid_state_and_resume_redoes_the_run(tmp_path, sig, code):
    port = free_port()
    plan = plan_for(tmp_path, port, [{"name": "solo", "vars": OFF}], repeats=2)
    out = tmp_path / "out"

    def signal_kvwatt(line, proc):
        if "solo-r2: measuring" in line:
            proc.send_signal(sig)

    stopped = run_experiment(plan, "--out", str(out), on_line=signal_kvwatt, timeout=120)
    assert stopped.returncode == code, stderr_tail(stopped)
    state = load_state(out)  # parses: written atomically
    assert list(state["finished"]) == ["solo-r1"] and state["in_progress"]["run"] == "solo-r2"
    if sig == signal.SIGTERM:
        assert not pids_serving(port), "SIGTERM must stop the server"
    else:
        assert pids_serving(port), "after SIGKILL of kvwatt its server is left running (resume stops it)"
    resumed = run_experiment(plan, "--out", str(out), "--resume", timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert "solo-r2 was interrupted and is redone" in resumed.stderr
    assert sorted(load_state(out)["finished"]) == ["solo-r1", "solo-r2"]
    assert (out / "runs" / "solo-r2.aborted-1").is_dir()
    assert not pids_serving(port)


def stderr_tail(run) -> str:
    return run.stderr[-2000:]


def test_dry_run_prints_the_runs_and_writes_nothing(tmp_path):
    plan = plan_for(tmp_path, 8123, [{"name": "off", "vars": OFF}, {"name": "on", "baseline": "off", "vars": ON}],
                    repeats=2)
    proc = subprocess.run([sys.executable, "-m", "exporter", "experiment", str(plan), "--dry-run", "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, cwd=str(FAKE_SERVER.parents[2]))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("argv: ") == 4 and "--port 8123 --kv-usage 0.95" in proc.stdout
    assert not (tmp_path / "out").exists()
    order = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("[")]
    assert order == [r.run_id for r in run_order(load_plan(str(plan)))]


def test_a_slow_engine_start_and_the_measurement_say_where_they_are(tmp_path):
    """An engine that takes 3 s to answer /health and a 4 s measurement: progress lines during both (a quarter of
    the expected time apart, 1 s here), not silence until the run ends."""
    port = free_port()
    plan = plan_for(tmp_path, port, [{"name": "off", "vars": {**OFF, "extra": "--startup-seconds=3"}}],
                    phases={**SHORT, "measure": "4s"})
    data = yaml.safe_load(plan.read_text())
    data["server"]["startup_estimate"] = "4s"
    plan.write_text(yaml.safe_dump(data, sort_keys=False))
    done = run_experiment(plan, "--out", str(tmp_path / "out"), timeout=120)
    assert done.returncode == 0, done.stderr
    starting = [x for x in done.stderr.splitlines() if "server starting: " in x and "s so far (estimate 4 s" in x]
    measuring = re.findall(r"measuring: (\d+) of 4 s, (\d+) requests answered", done.stderr)
    assert len(starting) >= 2, done.stderr
    assert len(measuring) >= 2 and int(measuring[-1][0]) >= 2, done.stderr
