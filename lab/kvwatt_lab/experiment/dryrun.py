"""`kvwatt experiment PLAN --dry-run`: the conditions with their parameters (the expanded sweep), the run order
with every run's argv, and the estimated wall time of the whole plan. Nothing runs."""

from __future__ import annotations

import os
import shutil
import sys

from exporter.config import redacted_url
from kvwatt_lab.experiment.plan import STOP_ESTIMATE_SECONDS, Plan, run_order
from kvwatt_lab.experiment.runner import launch_for


def dry_run(plan: Plan, out_dir: str) -> int:
    order = run_order(plan)
    print(f"plan {plan.name}: {len(plan.conditions)} conditions x {plan.repeats} repeats = {len(order)} runs; "
          f"output {out_dir}")
    print()
    for line in condition_table(plan):
        print(line)
    print()
    launches = [(run, launch_for(plan, plan.condition(run.condition), run, plan.server.port or 0,
                                 os.path.join(out_dir, "runs", run.run_id))) for run in order]
    shared = shared_env([launch for _, launch in launches])
    if shared:
        print("environment of every run: " + " ".join(f"{k}={v}" for k, v in sorted(shared.items())))
    port_note = "" if plan.server.port else " (port 0 shown: a free one at run time)"
    print(f"run order (each repeat holds every condition once, shuffled with seed {plan.seed}){port_note}:")
    for index, (run, launch) in enumerate(launches, start=1):
        print(f"[{index}] {run.run_id}  {redacted_url(launch.url)}")
        print("    argv: " + " ".join(_quote(a) for a in launch.argv))
        for k, v in sorted(launch.env.items()):
            if k not in shared:
                print(f"    env: {k}={v}")
    print()
    print(estimate_line(plan, len(order)))
    argv = launches[0][1].argv if launches else []
    program = argv[0] if argv else ""
    if program and "/" not in program and shutil.which(program) is None:  # may be the GPU node's, not this one's
        print(f"note: the server's program {program} is not on PATH here; the plan runs where it is",
              file=sys.stderr)
    missing = missing_files(argv)
    for line in missing:
        print(f"kvwatt: experiment: {line}", file=sys.stderr)
    return 2 if missing else 0


def shared_env(launches: list) -> dict[str, str]:
    """The environment entries every run has with the same value (printed once)."""
    if not launches:
        return {}
    first = launches[0].env
    return {k: v for k, v in first.items() if all(launch.env.get(k) == v for launch in launches[1:])}


def missing_files(argv: list[str]) -> list[str]:
    """What the real run would fail on at its first condition: the server's program and its --model directory,
    when given as paths (a bare program name may be on another machine's PATH, and a model name such as
    meta-llama/... is fetched by the engine: neither is refused)."""
    out = []
    program = argv[0] if argv else ""
    if "/" in program and not os.access(program, os.X_OK):
        out.append(f"the server's program {program} does not exist or is not executable (the CPU engine: make lab)")
    model = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--model"), None)
    if model and model.startswith(("/", "./", "../")) and not os.path.isdir(model):
        out.append(f"the model directory {model} does not exist (the lab's tiny model: make lab)")
    return out


def condition_table(plan: Plan) -> list[str]:
    """One row per condition: its parameters (offload, concurrency, the swept KV size and buffer) and baseline."""
    keys: list[str] = []
    for c in plan.conditions:
        keys += [k for k in c.params if k not in keys]
    header = ["condition", *keys, "baseline"]
    rows = [[c.name, *(_cell(c.params.get(k)) for k in keys), c.baseline or "-"] for c in plan.conditions]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]


def run_seconds(plan: Plan) -> dict[str, float]:
    """Expected seconds of one run by step: start-up and stop are estimates, the phases are the plan's own
    (measurement + one sample interval, the tick that closes the window)."""
    p = plan.phases
    return {"start-up": plan.server.startup_estimate_seconds, "settle": p.settle_seconds, "idle": p.idle_seconds,
            "warm-up": p.warmup_seconds, "measurement": p.measure_seconds + plan.sample_interval_seconds,
            "cool-down": p.cooldown_seconds, "stop": STOP_ESTIMATE_SECONDS}


def estimate_line(plan: Plan, runs: int) -> str:
    steps = run_seconds(plan)
    per_run = sum(steps.values())
    parts = " + ".join(f"{name} {format_seconds(s)}" for name, s in steps.items() if s > 0)
    return (f"estimated wall time: {format_seconds(per_run * runs)} ({runs} runs x {format_seconds(per_run)}: "
            f"{parts}; start-up is server.startup_estimate, stop ~{STOP_ESTIMATE_SECONDS:g} s)")


def format_seconds(seconds: float) -> str:
    """3725 -> "1 h 02 min 05 s", 95 -> "1 min 35 s", 4.5 -> "4.5 s"."""
    if seconds < 60:
        return f"{seconds:g} s"
    whole = round(seconds)
    h, rest = divmod(whole, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"{h} h {m:02d} min {s:02d} s"
    return f"{m} min {s:02d} s"


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return "-" if value is None else str(value)


def _quote(arg: str) -> str:
    """Display only: an element with spaces or quotes printed as a Python string literal."""
    return repr(arg) if not arg or any(c in arg for c in " \t\"'\\;&|$`") else arg
