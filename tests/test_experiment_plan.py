"""Experiment plans: validation key by key (bad input: exit 2, one line naming the key), safe argv
substitution (no shell, one element per template element), and the seeded, blocked run order."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml
from kvwatt_lab.experiment.plan import load_plan, run_order, template_values
from kvwatt_lab.experiment.runner import launch_for
from kvwatt_lab.experiment.server import ServerProcess
from kvwatt_lab.experiment.template import render_argv, substitute

from exporter.cli import main
from exporter.config import ConfigError

SAMPLE = Path(__file__).parent / "data" / "office_work_8k.sample.jsonl"
REPO = Path(__file__).resolve().parents[1]

BASE = {
    "name": "study",
    "seed": 7,
    "repeats": 3,
    "vars": {"model": "meta-llama/Llama-3.1-8B-Instruct"},
    "phases": {"idle": "30s", "warmup": "1m", "measure": "5m", "cooldown": "45s"},
    "server": {"command": ["vllm", "serve", "{model}", "--port", "{port}", "--num-gpu-blocks-override", "{blocks}"],
               "port": 8000},
    "workload": {"trace": str(SAMPLE), "concurrency": 4, "length_scale": 0.05, "max_context": 3000},
    "conditions": [{"name": "large", "vars": {"blocks": 2000}},
                   {"name": "small", "vars": {"blocks": 128}},
                   {"name": "small-on", "baseline": "small", "vars": {"blocks": 128},
                    "args": ["--kv-offloading-size", "{gib}", "--kv-offloading-backend", "native"],
                    "env": {"NOTE": "run {run} of {condition}"}}],
}
BASE["conditions"][2]["vars"]["gib"] = 64


def write(tmp_path: Path, plan: dict | str) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(plan if isinstance(plan, str) else yaml.safe_dump(plan))
    return path


def cli(capsys, *argv) -> tuple[int, str]:
    code = main(["experiment", *map(str, argv)])
    return code, capsys.readouterr().err


def mutated(change) -> dict:
    plan = copy.deepcopy(BASE)
    change(plan)
    return plan


BAD = [
    ("unknown top-level key", lambda p: p.update(repeat=3), "repeat: unknown key"),
    ("unknown phase", lambda p: p["phases"].update(warm="10s"), "phases.warm: unknown key"),
    ("unknown condition key", lambda p: p["conditions"][1].update(basline="large"),
     "conditions[1].basline: unknown key"),
    ("missing command", lambda p: p["server"].pop("command"), "server.command: missing"),
    ("command as a shell string", lambda p: p["server"].update(command="vllm serve x"),
     "server.command: expected a list of argv strings (run without a shell)"),
    ("unknown placeholder", lambda p: p["conditions"][0]["vars"].pop("blocks"),
     "server.command[6] (condition large): unknown placeholder {blocks}"),
    ("placeholder with a format spec", lambda p: p["server"]["command"].__setitem__(4, "{port:05d}"),
     "server.command[4] (condition large): bad placeholder {port:05d}"),
    ("placeholder with attribute access", lambda p: p["conditions"][2]["args"].__setitem__(1, "{gib.real}"),
     "conditions[2].args[1]: bad placeholder {gib.real}"),
    ("unbalanced brace", lambda p: p["server"]["command"].append("{oops"),
     "server.command[7] (condition large): bad template"),
    ("bad duration", lambda p: p["phases"].update(measure="ten minutes"),
     "phases.measure: expected a duration like 30s or 5m"),
    ("zero idle", lambda p: p["phases"].update(idle=0), "phases.idle: must be greater than zero"),
    ("n < 1", lambda p: p.update(repeats=0), "repeats: must be >= 1"),
    ("n not an integer", lambda p: p.update(repeats="3"), "repeats: expected an integer"),
    ("unknown baseline", lambda p: p["conditions"][2].update(baseline="tiny"),
     "conditions[2].baseline: no other condition named 'tiny'"),
    ("baseline that is itself ON", lambda p: p["conditions"][1].update(baseline="small-on"),
     "conditions[1].baseline: 'small-on' has a baseline itself"),
    ("duplicate condition", lambda p: p["conditions"][1].update(name="large"),
     "conditions[1].name: duplicate condition name 'large'"),
    ("condition name YAML reads as a boolean", lambda p: p["conditions"][0].update(name=False),
     "conditions[0].name: expected a string, got False (YAML reads on/off/yes/no as booleans: quote it)"),
    ("reserved var", lambda p: p["vars"].update(port=1), "vars.port: reserved placeholder name"),
    ("missing trace", lambda p: p["workload"].update(trace="nowhere.jsonl"), "workload.trace: trace file"),
    ("context cap nothing fits", lambda p: p["conditions"][1].update(workload={"max_context": 10}),
     "conditions[1].workload.max_context: no session's first turn fits in 10 tokens"),
    ("bad port", lambda p: p["server"].update(port=70000), "server.port: expected a port 1-65535 or auto"),
    ("bad energy scope", lambda p: p.update(energy={"scope": "rack"}), "energy.scope: expected one of auto, gpu, host"),
    ("no conditions", lambda p: p.update(conditions=[]), "conditions: expected a non-empty list"),
    ("bad url", lambda p: p["server"].update(url="localhost:{port}"),
     "server.url (condition large): expected an http(s) URL"),
]


@pytest.mark.parametrize("what, change, message", BAD, ids=[b[0] for b in BAD])
def test_bad_plan_exits_2_with_one_line_naming_the_key(tmp_path, capsys, what, change, message):
    code, err = cli(capsys, write(tmp_path, mutated(change)), "--dry-run")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kvwatt: error: " + message), lines[0]


def test_invalid_yaml_and_missing_file(tmp_path, capsys):
    code, err = cli(capsys, write(tmp_path, "server: [unclosed\n"), "--dry-run")
    assert code == 2 and "not valid YAML" in err and len(err.strip().splitlines()) == 1
    code, err = cli(capsys, tmp_path / "absent.yaml", "--dry-run")
    assert code == 2 and "cannot read" in err


def test_bad_plan_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    code, _ = cli(capsys, write(tmp_path, mutated(lambda p: p.update(repeats=0))), "--out", out)
    assert code == 2 and not out.exists()


def test_valid_plan_resolves_defaults_and_paths(tmp_path):
    plan = load_plan(str(write(tmp_path, BASE)))
    assert (plan.phases.settle_seconds, plan.phases.idle_seconds, plan.phases.cooldown_seconds) == (5.0, 30.0, 45.0)
    assert plan.phases.measure_seconds == 300.0 and plan.sample_interval_seconds == 1.0
    assert plan.out_dir == str(tmp_path / "plan-results")
    small_on = plan.condition("small-on")
    assert small_on.baseline == "small" and small_on.workload.concurrency == 4
    assert plan.energy.scope == "auto" and plan.energy.basis == "marginal"


# ---------------------------------------------------------------------------------------------------------
# substitution
# ---------------------------------------------------------------------------------------------------------
NASTY = "a b; touch {marker} && echo $(id) `uname` 'q' \"dq\" | cat > x"


def test_values_are_substituted_verbatim_one_element_each():
    templates = ["--flag", "{v}", "pre-{v}-post", "{{literal}}", "{a}{b}"]
    argv = render_argv(templates, {"v": NASTY, "a": "1", "b": "2"}, "server.command")
    assert argv == ["--flag", NASTY, f"pre-{NASTY}-post", "{literal}", "12"]
    with pytest.raises(ConfigError, match=r"server.command\[1\]: unknown placeholder \{w\}"):
        render_argv(["x", "{w}"], {}, "server.command")
    assert substitute("{x}", {"x": "{y}"}, "k") == "{y}"  # a value is never re-expanded


def test_substituted_command_runs_without_a_shell(tmp_path):
    marker = tmp_path / "marker"
    dump = tmp_path / "argv.json"
    script = "import json, sys; json.dump(sys.argv[1:], open(sys.argv[1], 'w'))"
    argv = render_argv([sys.executable, "-c", script, "{dump}", "{payload}", "--x={payload}"],
                       {"dump": str(dump), "payload": NASTY.replace("{marker}", str(marker))}, "server.command")
    server = ServerProcess(argv, {}, str(tmp_path / "log"))
    server.start()
    server.proc.wait(timeout=30)
    payload = NASTY.replace("{marker}", str(marker))
    assert json.loads(dump.read_text()) == [str(dump), payload, f"--x={payload}"]
    assert not marker.exists(), "a shell ran the command"


def test_launch_substitutes_builtins_per_run(tmp_path):
    plan = load_plan(str(write(tmp_path, BASE)))
    run = run_order(plan)[0]
    condition = plan.condition("small-on")
    launch = launch_for(plan, condition, run, 8123, "/out/runs/x")
    assert launch.argv == ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct", "--port", "8123",
                           "--num-gpu-blocks-override", "128", "--kv-offloading-size", "64",
                           "--kv-offloading-backend", "native"]
    assert launch.url == "http://127.0.0.1:8123"
    assert launch.env == {"NOTE": f"run {run.run_id} of small-on"}
    assert template_values(plan, condition, run, 1, "/d")["plan_dir"] == str(tmp_path)


# ---------------------------------------------------------------------------------------------------------
# run order
# ---------------------------------------------------------------------------------------------------------
def order_ids(tmp_path, seed: int) -> list[str]:
    return [r.run_id for r in run_order(load_plan(str(write(tmp_path, {**BASE, "seed": seed}))))]


def test_run_order_is_a_blocked_shuffle_fixed_by_the_seed(tmp_path):
    first = order_ids(tmp_path, 7)
    assert first == order_ids(tmp_path, 7)
    assert len(first) == 9 and Counter(r.rsplit("-r", 1)[0] for r in first) == {"large": 3, "small": 3, "small-on": 3}
    for repeat in (1, 2, 3):  # each block of three holds every condition once, all of repeat r
        block = first[(repeat - 1) * 3:repeat * 3]
        assert sorted(block) == sorted(f"{c}-r{repeat}" for c in ("large", "small", "small-on"))
    orders = {tuple(order_ids(tmp_path, seed)) for seed in range(10)}
    assert len(orders) > 3, "the seed does not change the order"


def test_run_order_does_not_depend_on_hash_randomisation(tmp_path):
    path = write(tmp_path, BASE)
    code = ("import json, sys; from kvwatt_lab.experiment.plan import load_plan, run_order; "
            "print(json.dumps([r.run_id for r in run_order(load_plan(sys.argv[1]))]))")
    outs = {subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=REPO,
                           env={**os.environ, "PYTHONHASHSEED": str(h)}, check=True).stdout for h in (1, 2)}
    assert len(outs) == 1 and json.loads(outs.pop()) == order_ids(tmp_path, 7)


def test_example_offload_plan_is_valid(capsys):
    code = main(["experiment", str(REPO / "examples" / "experiment-offload.yaml"), "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0
    plan = load_plan(str(REPO / "examples" / "experiment-offload.yaml"))
    on = [c for c in plan.conditions if c.baseline]
    assert on and all(plan.condition(c.baseline).baseline is None for c in on)
    assert out.count("argv: vllm serve meta-llama/Llama-3.1-8B-Instruct") == len(plan.conditions) * plan.repeats
    assert "--kv-offloading-size 64 --kv-offloading-backend native" in out
    assert "--enable-mfu-metrics" in out
