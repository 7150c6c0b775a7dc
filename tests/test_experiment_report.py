"""The report from synthetic finished runs: Table 1 and Table 2 numbers checked against hand calculation of
methods.md s2 (dE%, dTPS% and the delta-method SE), OFF-only plans, scope choice, files and plots."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from exporter.cli import main
from exporter.experiment import report
from exporter.experiment.plan import load_plan, run_order
from exporter.experiment.state import ExperimentState

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "tests" / "data" / "office_work_8k.sample.jsonl"

# Synthetic per-run figures: ON (offload) against its OFF baseline, three runs each, plus an unpaired OFF.
JPT = {"off-c6": [0.30, 0.32, 0.34], "on-c6": [0.24, 0.25, 0.26], "off-c2": [0.40, 0.41, 0.42]}
TPS = {"off-c6": [100.0, 110.0, 120.0], "on-c6": [130.0, 132.0, 134.0], "off-c2": [50.0, 50.0, 50.0]}
KV = {"off-c6": [0.93, 0.94, 0.95], "on-c6": [0.90, 0.91, 0.92], "off-c2": [0.80, 0.82, 0.84]}
PREEMPT = {"off-c6": [50, 55, 60], "on-c6": [0, 1, 2], "off-c2": [0, 0, 0]}
SHARES = {"off-c6": (0.213, 0.787, 0.0), "on-c6": (0.032, 0.803, 0.165), "off-c2": (0.039, 0.961, 0.0)}

# Hand calculation (methods.md s2), J/token: ON mean 0.25, SE = 0.01/sqrt(3) = 0.0057735;
# OFF mean 0.32, SE = 0.02/sqrt(3) = 0.0115470.
#   dE%  = (0.32 - 0.25) / 0.32 * 100 = 21.875
#   SE   = 100 * (0.25/0.32) * sqrt((0.0057735/0.25)^2 + (0.0115470/0.32)^2)
#        = 78.125 * sqrt(0.00053333 + 0.00130208) = 78.125 * 0.0428422 = 3.34705
# tokens/s: ON 132, SE 2/sqrt(3) = 1.15470; OFF 110, SE 10/sqrt(3) = 5.77350.
#   dTPS% = (132 - 110) / 110 * 100 = 20.0
#   SE    = 100 * (132/110) * sqrt((1.15470/132)^2 + (5.77350/110)^2) = 120 * 0.0532104 = 6.38524
DE, DE_SE, DTPS, DTPS_SE = 21.875, 3.34705, 20.0, 6.38524


def plan_file(tmp_path: Path, conditions: list[dict], repeats: int = 3, **extra) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({
        "name": "synthetic", "seed": 2, "repeats": repeats,
        "server": {"command": ["serve", "--port", "{port}"]},
        "workload": {"trace": str(SAMPLE), "length_scale": 0.05}, "conditions": conditions, **extra}))
    return path


def synthetic_run(condition: str, repeat: int, scopes=("gpu", "host")) -> dict:
    i = repeat - 1
    compute, cache, external = SHARES[condition]
    energy = {s: {"joules_per_token": JPT[condition][i] * 2, "marginal_joules_per_token": JPT[condition][i]}
              for s in scopes}
    energy.get("host", {}).update(marginal_joules_per_token=JPT[condition][i] / 10, joules_per_token=1.0)
    return {"run": f"{condition}-r{repeat}", "condition": condition, "repeat": repeat, "startup_seconds": 30.0,
            "window": {"kv_usage_p95_ratio": KV[condition][i], "preemptions": PREEMPT[condition][i],
                       "preemptions_per_minute": PREEMPT[condition][i] / 5,   # over the 300 s window
                       "tokens_per_second": TPS[condition][i], "covered_seconds": 300.0,
                       "prompt_token_shares": {"local_compute": compute, "local_cache_hit": cache,
                                               "external_kv_transfer": external},
                       "prompt_tokens_by_source": {"local_compute": compute * 1000, "local_cache_hit": cache * 1000,
                                                   "external_kv_transfer": external * 1000},
                       "energy": energy}}


def state_for(tmp_path: Path, plan_path: Path, runs: list[dict]) -> Path:
    plan = load_plan(str(plan_path))
    out = tmp_path / "out"
    state = ExperimentState.new(str(out), plan, run_order(plan))
    for r in runs:
        state.finished[r["run"]] = r
    state.save()
    return out


PAIRED = [{"name": "off-c6"}, {"name": "on-c6", "baseline": "off-c6"}, {"name": "off-c2"}]


def paired_runs(scopes=("gpu", "host")) -> list[dict]:
    return [synthetic_run(c, r, scopes) for c in JPT for r in (1, 2, 3)]


def tables(data: dict) -> dict[str, tuple[list[str], list[list[str]]]]:
    return {title: (header, rows) for title, header, rows in report.build(data)["tables"]}


def test_table1_matches_the_hand_calculation(tmp_path):
    out = state_for(tmp_path, plan_file(tmp_path, PAIRED), paired_runs())
    model = report.build(ExperimentState.load(str(out)).data)
    on = next(s for s in model["conditions"] if s["condition"] == "on-c6")["comparison"]
    assert on["energy_scope"] == "gpu" and on["energy_basis"] == "marginal"
    assert on["dE_percent"] == pytest.approx(DE, abs=1e-4)
    assert on["dE_se_percent"] == pytest.approx(DE_SE, abs=1e-4)
    assert on["dTPS_percent"] == pytest.approx(DTPS, abs=1e-4)
    assert on["dTPS_se_percent"] == pytest.approx(DTPS_SE, abs=1e-4)
    assert (on["n_on"], on["n_off"]) == (3, 3)
    header, rows = next(v for k, v in tables(model_data(out)).items() if k.startswith("Table 1"))
    # units in the headers only; ± SE for KV p95 and preemptions too; above/below the configured threshold
    # (two OFF conditions and one pair cannot locate one)
    assert header == ["condition", "baseline", "KV p95 (%)", "regime (configured threshold 90.0 %)",
                      "preemptions per window", "tokens/s", "J/token (marginal, gpu)", "dE (%)", "dTPS (%)",
                      "n (ON / OFF runs)"]
    assert rows == [
        ["off-c6", "–", "94.0 ± 0.6", "above", "55 ± 2.9", "110.0 ± 5.8", "0.32 ± 0.012", "n/a", "n/a", "3"],
        ["on-c6", "off-c6", "91.0 ± 0.6", "above", "1 ± 0.58", "132.0 ± 1.2", "0.25 ± 0.0058", "+21.9 ± 3.3",
         "+20.0 ± 6.4", "3 / 3"],
        ["off-c2", "–", "82.0 ± 1.2", "below", "0 ± 0", "50.0 ± 0.0", "0.41 ± 0.0058", "n/a", "n/a", "3"]]


def model_data(out: Path) -> dict:
    return ExperimentState.load(str(out)).data


def test_table2_shows_the_decomposition_off_vs_on_and_unpaired_conditions(tmp_path):
    out = state_for(tmp_path, plan_file(tmp_path, PAIRED), paired_runs())
    t = tables(model_data(out))
    header, rows = t["Table 2: token-source decomposition, OFF vs ON (shares of prompt tokens)"]
    assert header == ["condition", "OFF compute (%)", "OFF cache (%)", "ON compute (%)", "ON cache (%)",
                      "ON external (%)", "n (ON / OFF runs)"]
    assert rows == [["on-c6 vs off-c6", "21.3 ± 0.0", "78.7 ± 0.0", "3.2 ± 0.0", "80.3 ± 0.0", "16.5 ± 0.0",
                     "3 / 3"]]
    # every OFF condition with its tax against the same workload's low-pressure reference (off-c2: p95 0.82,
    # no preemptions): 21.3 - 3.9 = 17.4 pp, the study's office c=4 figure
    header, rows = t["Table 2b: OFF conditions, token sources and the recomputation tax between them"]
    assert header == ["condition", "KV p95 (%)", "preemptions per minute", "compute (%)", "cache (%)",
                      "external (%)", "recomputation tax (pp)", "tax reference", "n (runs)"]
    assert [r[0] for r in rows] == ["off-c6", "off-c2"]
    assert rows[0][3] == "21.3 ± 0.0" and rows[0][6:8] == ["+17.4 ± 0.0", "off-c2"]
    assert rows[1][6:8] == ["+0.0 ± n/a", "off-c2"]


def test_scope_falls_back_to_host_when_a_run_lacks_gpu_energy(tmp_path):
    runs = paired_runs()
    runs[4] = synthetic_run("on-c6", 2, scopes=("host",))
    out = state_for(tmp_path, plan_file(tmp_path, PAIRED), runs)
    on = next(s for s in report.build(model_data(out))["conditions"] if s["condition"] == "on-c6")["comparison"]
    assert on["energy_scope"] == "host"
    assert on["dE_percent"] == pytest.approx(DE, abs=1e-4)  # host figures are the GPU ones / 10: same ratio


def test_total_basis_and_a_single_run_per_side(tmp_path):
    plan = plan_file(tmp_path, PAIRED[:2], repeats=1, energy={"basis": "total", "scope": "gpu"})
    out = state_for(tmp_path, plan, [synthetic_run("off-c6", 1), synthetic_run("on-c6", 1)])
    on = next(s for s in report.build(model_data(out))["conditions"] if s["condition"] == "on-c6")["comparison"]
    assert on["dE_percent"] == pytest.approx((0.60 - 0.48) / 0.60 * 100)  # total J/token = 2 x marginal here
    assert on["dE_se_percent"] is None
    rows = next(v for k, v in tables(model_data(out)).items() if k.startswith("Table 1"))[1]
    assert rows[1][7] == "+20.0 ± n/a" and rows[1][9] == "1 / 1"


def test_off_only_plan_marks_savings_na_and_lists_shares_per_condition(tmp_path):
    plan = plan_file(tmp_path, [{"name": "off-c6"}, {"name": "off-c2"}])
    out = state_for(tmp_path, plan, [synthetic_run(c, r) for c in ("off-c6", "off-c2") for r in (1, 2, 3)])
    t = tables(model_data(out))
    rows = next(v for k, v in t.items() if k.startswith("Table 1"))[1]
    assert [r[7:9] for r in rows] == [["n/a", "n/a"], ["n/a", "n/a"]]
    header, rows = t["Table 2: token-source decomposition and recomputation tax by condition (shares of prompt "
                     "tokens)"]
    assert header[3:7] == ["compute (%)", "cache (%)", "external (%)", "recomputation tax (pp)"]
    assert [r[:1] + r[3:8] for r in rows] == [["off-c6", "21.3 ± 0.0", "78.7 ± 0.0", "0.0 ± 0.0", "+17.4 ± 0.0", "off-c2"],
                                              ["off-c2", "3.9 ± 0.0", "96.1 ± 0.0", "0.0 ± 0.0", "+0.0 ± n/a", "off-c2"]]


def test_files_plots_and_standalone_entry_points(tmp_path, capsys):
    plan = plan_file(tmp_path, PAIRED)
    out = state_for(tmp_path, plan, paired_runs()[:7])  # two runs of off-c2 still to come
    proc = subprocess.run([sys.executable, "-m", "exporter.experiment.report", str(out)], capture_output=True,
                          text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    for name in ("savings_vs_kv_p95.png", "energy_throughput_bars.png", "frontier.png", "mechanism.png"):
        data = (out / "plots" / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000
    assert not (out / "plots" / "buffer_size.png").exists()  # one buffer size only
    md, html_text = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert "![Figure 1. Energy saving of offloading, dE %" in md and "](plots/savings_vs_kv_p95.png)" in md
    assert "Not drawn: buffer_size.png: no OFF condition with ON conditions at two or more buffer sizes" in md
    assert 'src="plots/frontier.png"' in html_text and "<td>+21.9 ± 3.3</td>" in html_text
    assert "Runs finished: 7 of 9." in md and "INCOMPLETE: runs are still pending" in md
    with open(out / "runs.csv", newline="") as f:
        runs = list(csv.DictReader(f))
    assert len(runs) == 7 and runs[0]["gpu_marginal_joules_per_token"]
    with open(out / "conditions.csv", newline="") as f:
        conditions = {r["condition"]: r for r in csv.DictReader(f)}
    assert float(conditions["on-c6"]["dE_percent"]) == pytest.approx(DE, abs=1e-4)
    assert conditions["off-c6"]["dE_percent"] == ""
    data = json.loads((out / "report.json").read_text())
    assert data["complete"] is False and len(data["runs"]) == 7
    (out / "report.md").unlink()
    assert main(["experiment", str(plan), "--out", str(out), "--report-only"]) == 0
    assert (out / "report.md").is_file()


def test_report_only_without_an_experiment_is_bad_input(tmp_path, capsys):
    plan = plan_file(tmp_path, PAIRED)
    assert main(["experiment", str(plan), "--out", str(tmp_path / "none"), "--report-only"]) == 2
    assert "holds no experiment" in capsys.readouterr().err
