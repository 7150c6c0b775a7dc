"""Run every benchmark and print their figures (make bench)."""

import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for script in sorted(HERE.glob("bench_*.py")):
    print(f"== {script.name}", flush=True)
    sys.argv = [str(script)]
    runpy.run_path(str(script), run_name="__main__")
