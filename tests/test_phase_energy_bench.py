"""bench/phase_energy_gpu.py --dry-run: the GPU harness runs and checks itself on CPU (torch from the vLLM
environment, the only one with torch here): a tiny model, a power double with known per-token costs, the mixed
windows through kvwatt's estimator. Bad input exits 2 with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kvwatt_lab.cpu_engine import vllm_python

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "phase_energy_gpu.py"
TORCH_PYTHON = vllm_python()  # the CPU engine's Python (make lab / make test install it): it has torch


def _run(*args, python=TORCH_PYTHON, timeout=240):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([python, str(BENCH), *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.engine  # runs the vLLM venv's python (the one with torch); no engine is started
@pytest.mark.slow
def test_dry_run_recovers_the_doubles_costs():
    r = _run("--dry-run")
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout)
    assert d["ok"] and d["estimate"]["state"] == "known"
    for phase, cost in (("prompt_computed", 0.03), ("generated", 0.4)):
        assert abs(d["phases"][phase]["estimate"] - cost) <= 0.05 * cost, d["phases"][phase]


def test_bad_input_exits_2_with_one_line():
    r = _run("--dry-run", "--windows", "3", python=sys.executable, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "phase_min_windows" in r.stderr
