"""The lab's power double (kvwatt_lab/experiment/power_double.py, plan key ``energy.power_double``): a RAPL
package zone whose counter follows a stated cost model driven by an engine's own /metrics counters, read by
kvwatt's real RaplSource. It is a double BY DESIGN: no machine here has RAPL or a GPU, and a CPU engine's
study still needs an energy that follows the engine's work (generated tokens, vLLM's FLOPs estimate, the
offload tier's bytes). These tests run it against a loopback /metrics whose counters they set, and check the
plan keys that declare it and the report's marking of every figure it feeds."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from kvwatt_lab.experiment import plots, report, tables
from kvwatt_lab.experiment.plan import load_plan
from kvwatt_lab.experiment.power_double import GIB, POLL_SECONDS, PowerDouble, PowerModel, Spread
from kvwatt_lab.experiment.state import ExperimentState

from exporter.config import ConfigError
from exporter.sources.rapl import MAX_PLAUSIBLE_WATTS, RaplSource
from tests.support.loopback import MetricsServer
from tests.test_experiment_report import PAIRED, paired_runs, plan_file, state_for

SAMPLE = Path(__file__).resolve().parent / "data" / "office_work_8k.sample.jsonl"
MODEL = PowerModel(idle_watts=50.0, joules_per_generated_token=0.25, joules_per_gflop=20.0,
                   joules_per_gib_transferred=1000.0)
DOUBLE = {"idle_watts": 50, "joules_per_generated_token": 0.25, "joules_per_gflop": 20,
          "joules_per_gib_transferred": 1000}


def exposition(generated: float, flops: float, stored: float | None, loaded: float | None) -> str:
    """A vLLM 0.32-shaped exposition; the kv_offload series appear only after the first transfer (None)."""
    labels = 'engine="0",model_name="tiny"'
    lines = ["# TYPE vllm:generation_tokens_total counter", f"vllm:generation_tokens_total{{{labels}}} {generated}",
             "# TYPE vllm:estimated_flops_per_gpu_total counter",
             f"vllm:estimated_flops_per_gpu_total{{{labels}}} {flops}"]
    for name, value in (("store", stored), ("load", loaded)):
        if value is not None:
            lines += [f"# TYPE vllm:kv_offload_{name}_bytes_total counter",
                      f"vllm:kv_offload_{name}_bytes_total{{{labels}}} {value}"]
    return "\n".join(lines) + "\n"


def _counter_uj(path: Path) -> int:
    return int(path.read_text())


def test_the_double_charges_idle_power_and_the_engine_work_it_reads(tmp_path):
    counters = {"text": exposition(1000, 5e9, None, None)}
    with MetricsServer(lambda: counters["text"]) as engine:
        double = PowerDouble(MODEL, engine.url, str(tmp_path / "double"))
        with double as root:
            # kvwatt's real RAPL source finds the double's zone
            zones = RaplSource(root)
            status, readings = zones.read(time.monotonic())
            assert status.up and [r.device for r in readings] == ["rapl:package-0:package"]
            time.sleep(1.0)   # the poller's first reading is its base: work before it is not charged
            e0, t0 = _counter_uj(double.energy_path), time.monotonic()
            # 400 tokens generated, 3 GFLOP, and the offload series appear with 0.5 GiB stored, 0.25 GiB loaded
            counters["text"] = exposition(1400, 8e9, 0.5 * GIB, 0.25 * GIB)
            time.sleep(1.5)
            e1, t1 = _counter_uj(double.energy_path), time.monotonic()
    work = 400 * 0.25 + 3 * 20.0 + 0.75 * 1000.0
    assert work == pytest.approx(MODEL.work_joules(400, 3e9, 0.75 * GIB))
    charged = (e1 - e0) / 1e6 - MODEL.idle_watts * (t1 - t0)
    # the idle term accrues with the clock, read 20 ms apart at most on each side
    assert charged == pytest.approx(work, abs=MODEL.idle_watts * 0.2)
    assert not double.process.is_alive()


def test_a_counter_that_goes_down_is_a_new_engine_and_is_never_charged_negatively(tmp_path):
    counters = {"text": exposition(5000, 9e9, None, None)}
    with MetricsServer(lambda: counters["text"]) as engine:
        double = PowerDouble(MODEL, engine.url, str(tmp_path / "double"))
        with double:
            time.sleep(1.0)
            e0, t0 = _counter_uj(double.energy_path), time.monotonic()
            counters["text"] = exposition(10, 1e6, None, None)   # a restarted engine
            time.sleep(1.0)
            e1, t1 = _counter_uj(double.energy_path), time.monotonic()
    assert (e1 - e0) / 1e6 == pytest.approx(MODEL.idle_watts * (t1 - t0), abs=MODEL.idle_watts * 0.2)


def _plan(tmp_path: Path, energy: dict) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({"server": {"command": ["serve", "--port", "{port}"]},
                                    "workload": {"trace": str(SAMPLE), "length_scale": 0.05},
                                    "conditions": [{"name": "off"}], "energy": energy}))
    return path


def test_the_plan_declares_the_double_and_its_protocol_includes_it(tmp_path):
    plan = load_plan(str(_plan(tmp_path, {"nvml": False, "power_double": DOUBLE})))
    assert plan.energy.power_double == MODEL
    assert plan.to_json()["energy"]["power_double"] == DOUBLE
    other = load_plan(str(_plan(tmp_path, {"nvml": False, "power_double": {**DOUBLE, "idle_watts": 60}})))
    assert other.fingerprints()["protocol"] != plan.fingerprints()["protocol"]   # --resume refuses a change
    without = load_plan(str(_plan(tmp_path, {"nvml": False})))
    assert "power_double" not in without.to_json()["energy"]   # plans without one hash as before


@pytest.mark.parametrize("energy, words", [
    ({"power_double": DOUBLE}, "energy.power_double: needs energy.nvml: false"),
    ({"nvml": False, "powercap_root": "/sys/class/powercap", "power_double": DOUBLE},
     "energy.powercap_root: not with energy.power_double"),
    ({"nvml": False, "power_double": {"joules_per_gflop": 1}}, "energy.power_double.idle_watts: missing"),
    ({"nvml": False, "power_double": {**DOUBLE, "watts": 1}}, "energy.power_double.watts: unknown key"),
    ({"nvml": False, "power_double": {**DOUBLE, "joules_per_gflop": -1}},
     "energy.power_double.joules_per_gflop: must be >= 0"),
    ({"nvml": False, "power_double": {**DOUBLE, "idle_watts": ".nan"}}, "energy.power_double.idle_watts"),
    ({"nvml": False, "power_double": [50]}, "energy.power_double"),
])
def test_a_bad_power_double_is_one_clear_line(tmp_path, energy, words):
    with pytest.raises(ConfigError) as e:
        load_plan(str(_plan(tmp_path, energy)))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_report_marks_every_energy_figure_of_a_power_double(tmp_path):
    plan = plan_file(tmp_path, PAIRED, energy={"nvml": False, "power_double": DOUBLE})
    out = state_for(tmp_path, plan, paired_runs())
    model = report.build(ExperimentState.load(str(out)).data)
    assert model["summary"][1].startswith("ENERGY FROM A POWER DOUBLE, not measured: 50 W idle + 0.25 J per "
                                          "generated token + 20 J per GFLOP")
    by_title = {t: h for t, h, _ in model["tables"]}
    assert by_title[next(t for t in by_title if t.startswith("Table 1:"))][-3] == "dE (%, power double)"
    assert "J/token (marginal, gpu, power double)" in by_title["Table 1b: every condition's own figures"]
    assert tables.energy_words({"energy": {"power_double": None}}) == ""
    figs = {name: fig for name, _, fig in plots.figures(model)}
    for name in plots.ENERGY_FIGURES:
        if name in figs:
            assert "[energy: power double]" in figs[name].axes[0].get_title(), name
    assert "[energy: power double]" not in figs["mechanism.png"].axes[0].get_title()


def _with_flops(runs: list[dict], preemptions: float) -> list[dict]:
    for r in runs:
        r["window"].update(flops_per_generated_token=2e6 * (3 if r["condition"] == "off-c6" else 1),
                           preemptions=preemptions, preemptions_per_minute=preemptions / 5)
    return runs


@pytest.mark.parametrize("preemptions, words", [
    (4, "36 preemptions in the measurement windows: vLLM 0.32 counts a request's first prefill only"),
    (0, "No run preempted in its measurement window: Table 2's shares"),
])
def test_the_report_says_what_first_prefill_counting_means_for_table_2(tmp_path, preemptions, words):
    """vLLM 0.32 counts a request's first prefill only: Table 2c shows the re-prefill in FLOPs; the summary says
    what the shares miss (or that they miss nothing)."""
    out = state_for(tmp_path, plan_file(tmp_path, PAIRED), _with_flops(paired_runs(), preemptions))
    model = report.build(ExperimentState.load(str(out)).data)
    assert any(line.startswith(words) for line in model["summary"]), model["summary"]
    title, header, rows = next(t for t in model["tables"] if t[0].startswith("Table 2c"))
    assert header[3:6] == ["OFF FLOPs per generated token (MFLOP)", "ON FLOPs per generated token (MFLOP)",
                           "dFLOPs (%)"]
    # ON 2 MFLOP against OFF 6 MFLOP per generated token: -66.7 %
    (row,) = rows
    assert row[0] == "on-c6 vs off-c6" and row[3:] == ["6 ± 0", "2 ± 0", "-66.7 ± 0.0", "3 / 3"]
    assert row[1].startswith(f"{preemptions / 5:g} ± ") and row[2].startswith(f"{preemptions / 5:g} ± ")


def test_work_found_after_a_late_answer_is_spread_over_the_gap_not_charged_in_one_step():
    """An engine that answers /metrics 3 s late: its 3 s of work (1,200 J) charged at once would be a 1.2 kW
    step, which kvwatt's RAPL source drops as implausible (> 1 kW), losing that energy; spread over the gap it is
    400 W, as a real counter would have shown it."""
    spread = Spread()
    spread.add(10.0, 3.0, 1200.0)
    assert spread.released(10.0) == 0.0
    assert spread.released(11.0) == pytest.approx(400.0)   # 400 W, under the RAPL source's 1 kW bound
    assert spread.released(13.0) == pytest.approx(1200.0) and spread.released(99.0) == pytest.approx(1200.0)
    spread.add(20.0, 0.0, 10.0)   # a gap shorter than one poll: over one poll interval at least
    assert spread.released(20.0 + POLL_SECONDS) == pytest.approx(1210.0)
    assert MAX_PLAUSIBLE_WATTS == 1000.0


def test_a_burst_above_the_cap_is_carried_forward_never_above_the_rapl_sources_bound():
    """vLLM's FLOPs estimate, priced, can exceed 1 kW for a second on a busy engine; kvwatt would drop such a
    step. The double releases at most MAX_WATTS - idle for work and carries the rest forward."""
    from kvwatt_lab.experiment.power_double import MAX_WATTS

    spread = Spread(MAX_WATTS - 70.0)
    spread.released(0.0)
    spread.add(0.0, 1.0, 2000.0)   # 2 kJ of work found for one second
    steps = [spread.released(i * 0.02) for i in range(0, 301)]   # the writer's 20 ms ticks over 6 s
    per_second = [(steps[i + 50] - steps[i]) / 1.0 for i in range(0, 250, 50)]
    assert max(per_second) + 70.0 == pytest.approx(MAX_WATTS) and MAX_WATTS < MAX_PLAUSIBLE_WATTS
    assert steps[-1] == pytest.approx(2000.0)   # nothing lost, only late
    # 2 kJ due within 1 s, released at 830 W: due work waited until ~2.4 s (said at the run's end), not after
    assert spread.capped_seconds == pytest.approx(2000.0 / (MAX_WATTS - 70.0), abs=0.05)
    within = Spread(MAX_WATTS - 70.0)
    within.released(0.0)
    within.add(0.0, 1.0, 500.0)
    for i in range(301):
        within.released(i * 0.02)
    assert within.capped_seconds == 0.0
