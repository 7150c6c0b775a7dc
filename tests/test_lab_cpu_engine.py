"""`make lab`'s model step (python -m kvwatt_lab.cpu_engine): one line and exit 2 without the CPU engine; with it,
the tiny model the examples name (built once, then found)."""

from __future__ import annotations

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
