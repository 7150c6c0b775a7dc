"""Experiment plan sweeps (lab/kvwatt_lab/experiment/sweep.py): a matrix of concurrency x KV size x buffer x ON/OFF
expands into conditions and ON/OFF pairs with their parameters; bad sweeps exit 2 with one line naming the key;
--dry-run prints the matrix and the estimated wall time; a swept experiment runs end to end against the
stand-in server (tests/support/loopback.py) with every run's parameters in its results."""

from __future__ import annotations

import copy
import re
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml
from kvwatt_lab.experiment.plan import STOP_ESTIMATE_SECONDS, load_plan, run_order
from kvwatt_lab.experiment.runner import launch_for

from exporter.cli import main
from exporter.rules.limits import MAX_RUNS
from tests.support.engine import free_port
from tests.support.experiment import FAKE_SERVER, SAMPLE_TRACES, load_state, report_json, run_experiment, write_plan

BASE = {
    "name": "sweep",
    "seed": 3,
    "repeats": 2,
    "vars": {"model": "m"},
    "phases": {"settle": "5s", "idle": "30s", "warmup": "1m", "measure": "5m", "cooldown": "45s"},
    "server": {"command": ["vllm", "serve", "{model}", "--port", "{port}"], "port": 8000, "startup_estimate": "50s"},
    "workload": {"trace": str(SAMPLE_TRACES), "concurrency": 4, "length_scale": 0.05, "max_context": 3000},
    "sweep": {"concurrency": [2, 4], "kv_blocks": [2000, 128], "buffer_gib": [32, 64]},
}


def write(tmp_path: Path, plan: dict) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


def mutated(change) -> dict:
    plan = copy.deepcopy(BASE)
    change(plan)
    return plan


def test_the_matrix_expands_into_off_and_on_conditions_paired_at_the_same_concurrency_and_kv_size(tmp_path):
    plan = load_plan(str(write(tmp_path, BASE)))
    by = {c.name: c for c in plan.conditions}
    assert len(by) == 2 * 2 * (1 + 2)  # per (concurrency, KV size): one OFF and one ON per buffer
    on = by["on-c2-kv128-buf64"]
    assert on.baseline == "off-c2-kv128" and by["off-c2-kv128"].baseline is None
    assert on.params == {"offload": "on", "concurrency": 2, "kv_blocks": 128, "buffer_gib": 64.0}
    assert by["off-c4-kv2000"].params == {"offload": "off", "concurrency": 4, "kv_blocks": 2000}
    assert on.workload.concurrency == 2 and by["off-c4-kv2000"].workload.concurrency == 4
    run = next(r for r in run_order(plan) if r.condition == on.name)
    argv = launch_for(plan, on, run, 8000, "/out/runs/x").argv
    assert argv == ["vllm", "serve", "m", "--port", "8000", "--num-gpu-blocks-override", "128",
                    "--kv-offloading-size", "64", "--kv-offloading-backend", "native"]
    off = by["off-c4-kv2000"]
    assert launch_for(plan, off, run, 8000, "/x").argv[5:] == ["--num-gpu-blocks-override", "2000"]
    # the study's blocked shuffle: each repeat holds every condition once
    order = run_order(plan)
    assert len(order) == 24 and Counter(r.condition for r in order[:12]) == Counter(list(by))


def test_kv_axis_follows_the_command_template(tmp_path):
    placed = mutated(lambda p: p["server"]["command"].extend(["--num-gpu-blocks-override={kv_blocks}"]))
    plan = load_plan(str(write(tmp_path, placed)))
    c = plan.condition("off-c2-kv128")
    assert launch_for(plan, c, run_order(plan)[0], 8000, "/x").argv[5:] == ["--num-gpu-blocks-override=128"]

    def gmu(p):
        p["sweep"] = {"gpu_memory_utilization": [0.2, 0.35]}
    plan = load_plan(str(write(tmp_path, mutated(gmu))))
    assert [c.name for c in plan.conditions] == ["off-gmu0.2", "off-gmu0.35"]
    c = plan.condition("off-gmu0.35")
    assert c.params == {"offload": "off", "concurrency": 4, "gpu_memory_utilization": 0.35}
    assert launch_for(plan, c, run_order(plan)[0], 8000, "/x").argv[5:] == ["--gpu-memory-utilization", "0.35"]


def test_listed_conditions_carry_parameters_too(tmp_path):
    def listed(p):
        p.pop("sweep")
        p["conditions"] = [{"name": "off", "params": {"kv_blocks": 256}},
                           {"name": "on", "baseline": "off", "workload": {"concurrency": 6}}]
    plan = load_plan(str(write(tmp_path, mutated(listed))))
    assert plan.condition("off").params == {"offload": "off", "concurrency": 4, "kv_blocks": 256}
    assert plan.condition("on").params == {"offload": "on", "concurrency": 6}


BAD = [
    ("empty sweep", lambda p: p.update(sweep=None), "sweep: expected a mapping"),
    ("unknown sweep key", lambda p: p["sweep"].update(blocks=[1]), "sweep.blocks: unknown key"),
    ("empty axis", lambda p: p["sweep"].update(kv_blocks=[]), "sweep.kv_blocks: expected a non-empty list"),
    ("axis not a list", lambda p: p["sweep"].update(concurrency=4), "sweep.concurrency: expected a non-empty list"),
    ("value twice", lambda p: p["sweep"].update(kv_blocks=[128, 128]), "sweep.kv_blocks[1]: 128 is listed twice"),
    ("zero concurrency", lambda p: p["sweep"].update(concurrency=[0]), "sweep.concurrency[0]: must be >= 1"),
    ("utilisation above 1", lambda p: p["sweep"].update(kv_blocks=None) or p["sweep"].pop("kv_blocks")
     or p["sweep"].update(gpu_memory_utilization=[1.5]), "sweep.gpu_memory_utilization[0]: must be <= 1"),
    ("two KV axes", lambda p: p["sweep"].update(gpu_memory_utilization=[0.3]),
     "sweep.gpu_memory_utilization: one KV-size axis per sweep"),
    ("ON without OFF", lambda p: p["sweep"].update(offload=["on"]), "sweep.offload: ON conditions are compared"),
    ("bad offload word", lambda p: p["sweep"].update(offload=["off", "maybe"]),
     "sweep.offload[1]: expected off or on"),
    ("buffer without ON", lambda p: p["sweep"].update(offload=[False]),
     "sweep.buffer_gib: only ON conditions have an offload buffer"),
    ("ON without a buffer", lambda p: p["sweep"].pop("buffer_gib") and p["sweep"].update(offload=[False, True]),
     "sweep.buffer_gib: ON conditions need a buffer size"),
    ("no axis", lambda p: p.update(sweep={"offload": ["off"]}), "sweep: no axis to sweep"),
    ("flag already in the command", lambda p: p["server"]["command"].extend(["--num-gpu-blocks-override", "64"]),
     "sweep.kv_blocks: server.command already sets --num-gpu-blocks-override"),
    ("plan var named like an axis", lambda p: p["vars"].update(kv_blocks=1), "vars.kv_blocks: also a sweep axis"),
    ("offload args with an unknown placeholder", lambda p: p["sweep"].update(offload_args=["--x", "{nope}"]),
     "sweep.offload_args[1]: unknown placeholder {nope}"),
    ("name taken by a listed condition", lambda p: p.update(conditions=[{"name": "off-c2-kv128"}]),
     "sweep: expands into a condition named 'off-c2-kv128', as conditions[0] is already named"),
    ("more conditions than runs allowed", lambda p: p["sweep"].update(kv_blocks=list(range(1, 5002))),
     f"sweep: 30006 conditions, more than the limit of {MAX_RUNS} runs"),
    ("neither conditions nor sweep", lambda p: p.pop("sweep"), "conditions: missing (list the conditions, or give"),
    ("bad startup estimate", lambda p: p["server"].update(startup_estimate="soon"),
     "server.startup_estimate: expected a duration"),
]


@pytest.mark.parametrize("what, change, message", BAD, ids=[b[0] for b in BAD])
def test_bad_sweep_exits_2_with_one_line_naming_the_key(tmp_path, capsys, what, change, message):
    code = main(["experiment", str(write(tmp_path, mutated(change))), "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kvwatt: error: " + message), lines[0]


def test_dry_run_prints_the_matrix_the_order_and_the_estimated_wall_time(tmp_path, capsys):
    code = main(["experiment", str(write(tmp_path, BASE)), "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0
    assert "12 conditions x 2 repeats = 24 runs" in out
    header = next(line for line in out.splitlines() if line.startswith("condition "))
    assert header.split() == ["condition", "offload", "concurrency", "kv_blocks", "buffer_gib", "baseline"]
    row = next(line for line in out.splitlines() if line.startswith("on-c4-kv128-buf32 "))
    assert row.split() == ["on-c4-kv128-buf32", "on", "4", "128", "32", "off-c4-kv128"]
    assert out.count("argv: ") == 24
    # per run: start-up 50 + settle 5 + idle 30 + warm-up 60 + measure 300 + one 1 s tick + cool-down 45 + stop
    per_run = 50 + 5 + 30 + 60 + 300 + 1 + 45 + STOP_ESTIMATE_SECONDS
    total = round(24 * per_run)
    m = re.search(r"estimated wall time: (\d+) h (\d+) min (\d+) s \(24 runs x (\d+) min (\d+) s", out)
    assert m, out[-400:]
    h, mi, s, rm, rs = map(int, m.groups())
    assert (h * 3600 + mi * 60 + s, rm * 60 + rs) == (total, round(per_run))
    assert "start-up 50 s" in out and "measurement 5 min 01 s" in out


@pytest.mark.slow
def test_a_swept_experiment_runs_its_pairs_and_records_their_parameters(tmp_path):
    """concurrency [1, 3] x ON/OFF against the stand-in server; ON's offload_args turn on its external
    (offloaded) prompt tokens, so each ON run must show them and each OFF run none."""
    port = free_port()
    plan = write_plan(
        tmp_path / "plan.yaml", name="fake-sweep", seed=1, repeats=1, sample_interval="250ms",
        phases={"settle": "0s", "idle": "0.5s", "warmup": "0.5s", "measure": "2s", "cooldown": "0s"},
        server={"command": [sys.executable, str(FAKE_SERVER), "--port", "{port}", "--seconds-per-token=0.002"],
                "port": port, "startup_timeout": "20s", "stop_timeout": "5s", "unresponsive_timeout": "10s"},
        workload={"trace": str(SAMPLE_TRACES), "length_scale": 0.05, "latency_scale": 0.05, "max_context": 2000},
        energy={"nvml": False, "powercap_root": str(tmp_path / "no-rapl"), "min_load": "1s"},
        sweep={"concurrency": [1, 3], "buffer_gib": [8], "offload_args": ["--external-ratio", "0.5"]})
    out = tmp_path / "out"
    done = run_experiment(plan, "--out", str(out), timeout=180)
    assert done.returncode == 0, done.stderr
    finished = load_state(out)["finished"]
    assert sorted(finished) == ["off-c1-r1", "off-c3-r1", "on-c1-buf8-r1", "on-c3-buf8-r1"]
    for run_id, r in finished.items():
        on = run_id.startswith("on-")
        expected = {"offload": "on" if on else "off", "concurrency": 1 if "-c1" in run_id else 3}
        assert r["params"] == ({**expected, "buffer_gib": 8.0} if on else expected)
        assert r["replay"]["concurrency"] == expected["concurrency"]
        external = r["window"]["prompt_token_shares"]["external_kv_transfer"]
        assert (external > 0.3) if on else external == 0, (run_id, external)
    state_conditions = {c["name"]: c for c in load_state(out)["plan"]["conditions"]}
    assert state_conditions["on-c3-buf8"]["params"]["concurrency"] == 3
    by = {c["condition"]: c for c in report_json(out)["conditions"]}
    assert by["on-c1-buf8"]["baseline"] == "off-c1" and by["on-c3-buf8"]["baseline"] == "off-c3"


@pytest.mark.engine  # the tiny model is built with the CPU engine's python, as `make lab` does
def test_the_example_kv_sweep_loads_and_estimates_its_wall_time(capsys):
    """As written, after `make lab` (the CPU engine in .venv-vllm, the tiny model in /tmp/kvwatt-tiny-llama)."""
    from kvwatt_lab.cpu_engine import build_tiny_model
    build_tiny_model()
    example = Path(__file__).resolve().parents[1] / "examples" / "sweep-kv-cpu.yaml"
    plan = load_plan(str(example))
    assert [c.params["kv_blocks"] for c in plan.conditions] == [2000, 512, 256, 192, 128]
    assert all(c.params["offload"] == "off" and c.baseline is None for c in plan.conditions)
    assert main(["experiment", str(example), "--dry-run"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "5 conditions x 2 repeats = 10 runs" in out and "estimated wall time: 23 min 20 s" in out


def test_dry_run_prints_shared_settings_once_and_checks_the_engine_and_model(tmp_path, capsys):
    """Paths resolve against the plan file; a missing engine or model fails the dry run (exit 2), not the run's
    first condition; the environment every run shares is printed once."""
    plan = mutated(lambda p: p.update(server={**p["server"], "env": {"A": "1", "B": "2"},
                                               "command": ["../venv/bin/python", "-m", "vllm", "--model",
                                                           str(tmp_path / "model"), "--port", "{port}"]}))
    plan_dir = tmp_path / "plans"
    plan_dir.mkdir()
    code = main(["experiment", str(write(plan_dir, plan)), "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 2
    assert f"the server's program {tmp_path / 'venv' / 'bin' / 'python'} does not exist" in err  # plan-relative
    assert f"the model directory {tmp_path / 'model'} does not exist" in err and "make lab" in err
    assert out.count("environment of every run: A=1 B=2") == 1 and "    env:" not in out
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").symlink_to(sys.executable)
    (tmp_path / "model").mkdir()
    assert main(["experiment", str(write(plan_dir, plan)), "--dry-run"]) == 0
    plan["server"]["command"][4] = "../model"  # a --model path is the plan file's too
    assert main(["experiment", str(write(plan_dir, plan)), "--dry-run"]) == 0
    assert f"--model {tmp_path / 'model'} " in capsys.readouterr().out
