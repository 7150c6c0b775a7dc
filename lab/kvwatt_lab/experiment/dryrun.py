"""`kvwatt experiment PLAN --dry-run`: the conditions with their parameters (the expanded sweep), the run order
with every run's argv, and the estimated wall time of the whole plan. Nothing runs."""

from __future__ import annotations

import os

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
    print(f"run order (each repeat holds every condition once, shuffled with seed {plan.seed}):")
    for index, run in enumerate(order, start=1):
        condition = plan.condition(run.condition)
        run_dir = os.path.join(out_dir, "runs", run.run_id)
        launch = launch_for(plan, condition, run, plan.server.port or 0, run_dir)
        port_note = "" if plan.server.port else "  (port: a free one at run time; 0 shown)"
        print(f"[{index}] {run.run_id}  {redacted_url(launch.url)}{port_note}")
        print("    argv: " + " ".join(_quote(a) for a in launch.argv))
        for k, v in sorted(launch.env.items()):
            print(f"    env: {k}={v}")
    print()
    print(estimate_line(plan, len(order)))
    return 0


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
