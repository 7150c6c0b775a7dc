"""Run every benchmark (bench/bench_*.py, each with its defaults) and print their figures (make bench).

    .venv/bin/python bench/run_all.py [NAME ...]      # e.g. run_all.py bench_derive: only those

Each script runs as __main__ in this process, one after the other; a script whose main() returns a dict has
it collected and written, all together, to $KVWATT_BENCH_JSON when that is set. A failing script is
reported and the others still run; the exit status is 1 if any failed.
"""

import json
import os
import runpy
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    wanted = {Path(a).stem for a in sys.argv[1:]}
    results, failed = {}, []
    for script in sorted(HERE.glob("bench_*.py")):
        if wanted and script.stem not in wanted:
            continue
        print(f"== {script.name}", flush=True)
        start = time.monotonic()
        sys.argv = [str(script)]
        try:
            ns = runpy.run_path(str(script), run_name="bench")  # define, do not run
            main_fn = ns.get("main")
            if main_fn is None:
                runpy.run_path(str(script), run_name="__main__")
            else:
                results[script.stem] = main_fn()
        except Exception:
            traceback.print_exc()
            failed.append(script.name)
        print(f"({script.name}: {time.monotonic() - start:.0f} s)\n", flush=True)
    out = os.environ.get("KVWATT_BENCH_JSON")
    if out:
        Path(out).write_text(json.dumps(results, indent=2, default=str))
    if failed:
        print("failed:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
