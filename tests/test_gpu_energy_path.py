"""bench/gpu_energy_path.py's harness without a GPU (--dry-run: kvwatt's NvmlSource over the tests' NVML double,
which stands in for a GPU this machine does not have): one JSON document with the read costs and the three
phases; bad input is one line and exit 2. Its figures on a real H200 are in docs/energy.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu_energy_path.py"


def test_dry_run_reads_the_double_through_kvwatts_source():
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--idle-seconds", "0.5", "--load-seconds",
                           "0.5"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["method"] == "counter" and report["read_costs"]["reads"] == 100
    assert report["read_costs"]["wall_ms"]["p50"] > 0  # the double costs what an H100 read costs
    for name in ("idle_before", "loaded", "idle_after"):
        assert report[name]["reads"] >= 2 and report[name]["seconds"] > 0, report[name]
    assert report["loaded"]["matrix_products"] > 0


def test_bad_input_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--load-seconds", "0"], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == ["gpu_energy_path: --idle-seconds and --load-seconds must be positive"]
