"""`kvwatt experiment` end to end with a stand-in server (tests/support/loopback.py: starts in
~0.5 s, serves completions and vLLM-style /metrics) and the RAPL test double driven by a power model from
the server's own counters. The same protocol as the real-engine test, in seconds: full runs and the power double here; a
server that fails to start, one killed mid-measurement, kvwatt itself killed or terminated, and --resume after each in
tests/test_experiment_resume.py (two files, so the slow tier's workers run them side by side)."""

from __future__ import annotations

import math
import re
import sys

import pytest
import yaml
from kvwatt_lab.experiment.plan import load_plan, run_order

from tests.support.engine import free_port
from tests.support.experiment import (
    FAKE_SERVER,
    SAMPLE_TRACES,
    is_png,
    load_state,
    pids_serving,
    report_json,
    run_experiment,
    write_plan,
)
from tests.support.power_driver import PowerDriver
from tests.support.powercap import PowercapTree

pytestmark = pytest.mark.slow  # each test runs a real experiment (subprocesses, fake servers) for 6-45 s

IDLE_WATTS, JOULES_PER_TOKEN, JOULES_PER_PREFILL_TOKEN = 30.0, 0.2, 0.002
# The RAPL double is written by a Python thread every 50 ms; on a loaded machine it can lag a few hundred ms,
# which over windows of seconds shifts energy between neighbouring intervals: hence loose tolerances here
# (tests/test_experiment_engine.py measures over longer windows).
ENERGY_TOLERANCE = 0.15
PHASES = {"settle": "0.5s", "idle": "3s", "warmup": "1s", "measure": "4s", "cooldown": "0.5s"}
SHORT = {"settle": "0s", "idle": "0.5s", "warmup": "0.5s", "measure": "2s", "cooldown": "0s"}
OFF = {"kv": 0.5, "hit": 0.8, "external": 0.0, "preempt": 0, "extra": "--seconds-per-token=0.002"}
ON = {"kv": 0.95, "hit": 0.3, "external": 0.6, "preempt": 5, "extra": "--seconds-per-token=0.002"}


def plan_for(tmp_path, port, conditions, repeats=1, seed=0, phases=SHORT, powercap_root=None):
    command = [sys.executable, str(FAKE_SERVER), "--port", "{port}", "--kv-usage", "{kv}",
               "--cache-hit-ratio", "{hit}", "--external-ratio", "{external}", "--preempt-every", "{preempt}",
               "{extra}"]
    return write_plan(
        tmp_path / "plan.yaml", name="fake", seed=seed, repeats=repeats, sample_interval="250ms", phases=phases,
        server={"command": command, "port": port, "startup_timeout": "20s", "stop_timeout": "5s",
                "unresponsive_timeout": "10s"},
        workload={"trace": str(SAMPLE_TRACES), "concurrency": 3, "length_scale": 0.05, "latency_scale": 0.05,
                  "max_context": 2000},
        energy={"nvml": False, "powercap_root": powercap_root or str(tmp_path / "no-rapl"), "min_load": "1s"},
        conditions=conditions)


@pytest.fixture
def rapl(tmp_path):
    tree = PowercapTree(tmp_path / "host")
    return tree, tree.add_zone("package-0")


def test_paired_experiment_measures_energy_pressure_and_token_sources(tmp_path, rapl):
    tree, zone = rapl
    port = free_port()
    plan = plan_for(tmp_path, port, [{"name": "off", "vars": OFF}, {"name": "on", "baseline": "off", "vars": ON}],
                    repeats=2, seed=4, phases=PHASES, powercap_root=tree.root)
    out = tmp_path / "out"
    driver = PowerDriver(tree, zone, f"http://127.0.0.1:{port}", IDLE_WATTS, JOULES_PER_TOKEN,
                         JOULES_PER_PREFILL_TOKEN)
    driver.start()
    try:
        done = run_experiment(plan, "--out", str(out), timeout=180)
    finally:
        driver.stop()
    assert done.returncode == 0, done.stderr
    state = load_state(out)
    runs = [state["finished"][r.run_id] for r in run_order(load_plan(str(plan)))]
    assert [r["run"] for r in runs] == [r["run_id"] for r in state["order"]]
    for r in runs:
        w = r["window"]
        # P_idle measured in the idle phase: the power model's idle watts
        assert r["idle"]["watts"]["rapl:package-0:package"] == pytest.approx(IDLE_WATTS, rel=ENERGY_TOLERANCE)
        # marginal J/token from the RAPL double vs the power model over the run's own counters
        counts = w["prompt_tokens_by_source"]
        expected = JOULES_PER_TOKEN + JOULES_PER_PREFILL_TOKEN * counts["local_compute"] / w["generation_tokens"]
        assert w["energy"]["host"]["marginal_joules_per_token"] == pytest.approx(expected, rel=ENERGY_TOLERANCE), \
            r["run"]
        assert w["covered_seconds"] == pytest.approx(4.0, abs=0.6)
    by = {c["condition"]: c for c in report_json(out)["conditions"]}
    assert by["on"]["kv_usage_p95_ratio"]["mean"] == pytest.approx(0.95)
    assert by["off"]["kv_usage_p95_ratio"]["mean"] == pytest.approx(0.5)
    assert by["on"]["preemptions"]["mean"] > 0 and by["off"]["preemptions"]["mean"] == 0
    assert by["on"]["share_external_kv_transfer"]["mean"] == pytest.approx(0.6, abs=0.01)
    assert by["off"]["share_local_cache_hit"]["mean"] == pytest.approx(0.8, abs=0.01)
    # dE% from the runs' J/token by methods.md s2, independently of the report code
    x = {c: [r["window"]["energy"]["host"]["marginal_joules_per_token"] for r in runs if r["condition"] == c]
         for c in ("on", "off")}
    mean = {c: sum(v) / len(v) for c, v in x.items()}
    se = {c: math.sqrt(sum((a - mean[c]) ** 2 for a in v) / (len(v) - 1) / len(v)) for c, v in x.items()}
    cmp = by["on"]["comparison"]
    assert cmp["energy_scope"] == "host"
    assert cmp["dE_percent"] == pytest.approx((mean["off"] - mean["on"]) / mean["off"] * 100)
    assert cmp["dE_se_percent"] == pytest.approx(100 * mean["on"] / mean["off"] * math.sqrt(
        (se["on"] / mean["on"]) ** 2 + (se["off"] / mean["off"]) ** 2))
    assert cmp["dE_percent"] > 0  # the ON stand-in computes far fewer prompt tokens per generated token
    md = (out / "report.md").read_text()
    # units in the headers, ± SE in the cells (KV p95, preemptions), above/below the threshold
    assert re.search(r"\| on \| off \| [^|]+ \| 95\.0 ± 0\.0 \| above \| [\d.]+ ± [\d.]+ \|", md), md
    assert "| on vs off | 20.0 ± 0.0 | 80.0 ± 0.0 |" in md
    for name in ("savings_vs_kv_p95.png", "energy_throughput_bars.png", "frontier.png", "mechanism.png"):
        assert is_png(out / "plots" / name)
        assert f'src="plots/{name}"' in (out / "report.html").read_text()
    assert len((out / "runs.csv").read_text().splitlines()) == 5
    assert not pids_serving(port), "a server was left running"


DOUBLE = {"idle_watts": 30.0, "joules_per_generated_token": 0.2, "joules_per_gflop": 4.0,
          "joules_per_gib_transferred": 0.0}
FLOPS_PER_TOKEN = 2e6


def test_a_power_double_plays_each_runs_energy_from_its_engines_counters(tmp_path):
    """energy.power_double: each run gets its own double (a RAPL zone in its run directory, following the
    server's generated tokens and FLOPs estimate), read by the real RaplSource; the report says so."""
    port = free_port()
    plan = plan_for(tmp_path, port, [{"name": "off", "vars": OFF},
                                     {"name": "on", "baseline": "off", "vars": ON}], repeats=1, phases=PHASES)
    data = yaml.safe_load(plan.read_text())
    data["server"]["command"] += ["--flops-per-token", str(FLOPS_PER_TOKEN)]
    data["energy"] = {"nvml": False, "min_load": "1s", "power_double": DOUBLE}
    plan.write_text(yaml.safe_dump(data))
    out = tmp_path / "out"
    done = run_experiment(plan, "--out", str(out), timeout=180)
    assert done.returncode == 0, done.stderr
    state = load_state(out)
    for run in state["finished"].values():
        w = run["window"]
        assert (out / "runs" / run["run"] / "power-double" / "sys/class/powercap/intel-rapl:0").is_symlink()
        assert run["idle"]["watts"]["rapl:package-0:package"] == pytest.approx(DOUBLE["idle_watts"],
                                                                               rel=ENERGY_TOLERANCE)
        counts = w["prompt_tokens_by_source"]
        flops = FLOPS_PER_TOKEN * (counts["local_compute"] + w["generation_tokens"])
        assert w["flops_per_generated_token"] == pytest.approx(flops / w["generation_tokens"], rel=0.02)
        expected = (DOUBLE["joules_per_generated_token"]
                    + DOUBLE["joules_per_gflop"] * flops / 1e9 / w["generation_tokens"])
        assert w["energy"]["host"]["marginal_joules_per_token"] == pytest.approx(expected, rel=ENERGY_TOLERANCE)
    md = (out / "report.md").read_text()
    assert "ENERGY FROM A POWER DOUBLE, not measured: 30 W idle" in md and "dE (%, power double)" in md
    assert not pids_serving(port)
