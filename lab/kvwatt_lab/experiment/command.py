"""`kvwatt experiment PLAN.yaml`: run a paired ON/OFF experiment plan and write its report (docs/experiment.md).

Exit status: 0 every run finished (or --dry-run / --report-only succeeded); 1 a run failed (the server did
not start, died or stopped answering): the experiment stops, finished runs and their report are kept and
--resume continues; 2 bad input (the plan, the output directory); 130/143 interrupted by SIGINT/SIGTERM (the
run in progress is redone by --resume).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from exporter.config import ConfigError, check_writable
from exporter.runtime import atomic
from kvwatt_lab.experiment import plots, report
from kvwatt_lab.experiment.dryrun import dry_run
from kvwatt_lab.experiment.plan import Plan, load_plan, run_order
from kvwatt_lab.experiment.runner import run_experiment
from kvwatt_lab.experiment.state import DirectoryLock, ExperimentState, open_state


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="experiment plan (YAML), see docs/experiment.md")
    p.add_argument("--out", metavar="DIR", help="output directory (default: the plan's `out`)")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted experiment in DIR, skipping the runs it finished")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the plan; print the conditions (an expanded sweep), the runs with their commands "
                   "and the estimated wall time; run nothing")
    p.add_argument("--report-only", action="store_true", help="(re)write the report from DIR's finished runs")


def say(message: str) -> None:
    print(f"kvwatt experiment: {message}", file=sys.stderr, flush=True)


def report_only(out_dir: str) -> int:
    state = ExperimentState.load(out_dir)
    if state is None:
        raise ConfigError(f"--report-only: {out_dir} holds no experiment (no state.json)")
    for path in report.write_report(out_dir, state.data):
        print(path)
    return 0


def main(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    out_dir = os.path.abspath(args.out or plan.out_dir)
    check_writable(out_dir, "--out" if args.out else "out", directory=True)
    if args.dry_run:
        return dry_run(plan, out_dir)
    if args.report_only:
        return report_only(out_dir)
    plots.require()  # before hours of runs, not after the first one: exit 2 with the install command
    with DirectoryLock(out_dir):
        state = open_state(out_dir, plan, run_order(plan), args.resume)
        with open(plan.path, encoding="utf-8") as f:
            atomic.write_text(os.path.join(out_dir, "plan.yaml"), f.read())
        if state.finished:
            redo = f"; {state.in_progress} was interrupted and is redone" if state.in_progress else ""
            say(f"resuming: {len(state.finished)} of {len(state.order)} runs finished{redo}")
        code = _run(plan, state)
    if code == 0:
        say(f"done: report in {os.path.join(out_dir, 'report.md')}")
    elif code == 1:
        say(f"stopped; finished runs are kept, the report of what completed is in {out_dir}; "
            f"fix the cause and rerun with --resume")
    return code


def _run(plan: Plan, state: ExperimentState) -> int:
    """The experiment under asyncio; SIGTERM cancels it like SIGINT (servers are stopped on the way out)."""

    async def guarded() -> int:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
        try:
            return await run_experiment(plan, state, say)
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    try:
        return asyncio.run(guarded())
    except asyncio.CancelledError:
        say("terminated; the run in progress is redone by --resume")
        return 143
    except KeyboardInterrupt:
        say("interrupted; the run in progress is redone by --resume")
        return 130
