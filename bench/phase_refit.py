"""The per-phase refit at a full history: what a daemon past its PHASE_HISTORY (6 h by default) pays each time its
repeat windows complete, which bench/soak.py and bench/tick_phases.py do not reach (they fill the longest
window, 1 h: 120 of the 720 rows a scope keeps at the defaults).

    .venv/bin/python bench/phase_refit.py [--servers 64] [--hours 6] [--width 30] [--rounds 20]

Each server's learner (exporter/model/energy.py PhaseLearner, GPU and host scopes) is filled to its history
with synthetic windows (a random prompt/generated/reloaded mix, costs 0.03/0.4/0.004 J per token, 5 % noise),
then ``--rounds`` times every server completes one window together, as the grid makes them (the once-per-width
spike of the tick). Prints the spike's CPU time (median, max over rounds) and per refit, for the learner as it
runs (running sums, PhaseSums) and for the same refits over the rows (estimate() without the sums).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exporter import rules  # noqa: E402
from exporter.derive import phase_energy  # noqa: E402
from exporter.model.energy import SCOPES, PhaseLearner  # noqa: E402


def window(rng: random.Random) -> phase_energy.PhaseWindow:
    computed, generated = rng.uniform(0, 20000), rng.uniform(100, 3000)
    reloaded = rng.uniform(0, 10000) if rng.random() < 0.6 else 0.0
    joules = (0.03 * computed + 0.4 * generated + 0.004 * reloaded) * rng.gauss(1.0, 0.05)
    return phase_energy.PhaseWindow(joules, computed, generated, reloaded)


def learners(args, rng: random.Random) -> list[PhaseLearner]:
    out = []
    for s in range(args.servers):
        learner = PhaseLearner(name=f"s{s}", width=args.width, history_seconds=args.hours * 3600.0,
                               min_windows=rules.PHASE_MIN_WINDOWS.default,
                               max_condition=rules.PHASE_MAX_CONDITION.default,
                               load_to_compute_cost_ratio=rules.LOAD_TO_COMPUTE_COST_RATIO.default)
        for scope in SCOPES:
            for _ in range(learner.keep):
                learner._keep(scope, window(rng))  # the bench fills the history directly: no buckets to build
        out.append(learner)
    return out


def spike(group: list[PhaseLearner], rng: random.Random, over_rows: bool) -> float:
    """One round: every server's scopes take a window and refit; ms of this thread's CPU time."""
    t = time.thread_time()
    for learner in group:
        for scope in SCOPES:
            learner._keep(scope, window(rng))
            if over_rows:
                learner.costs[scope] = phase_energy.estimate(list(learner.windows[scope]), scope, learner.min_windows,
                                                             learner.max_condition, learner.ratio)
            else:
                learner._refit(scope)
    return (time.thread_time() - t) * 1000.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", type=int, default=64)
    ap.add_argument("--hours", type=float, default=rules.PHASE_HISTORY.default / 3600.0)
    ap.add_argument("--width", type=float, default=rules.MIN_LOAD_DURATION.default)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    rng = random.Random(1)
    group = learners(args, rng)
    rows = group[0].keep
    print(f"{args.servers} servers x {len(SCOPES)} scopes, {rows} windows kept each ({args.hours:g} h of "
          f"{args.width:g} s windows)")
    for name, over_rows in (("running sums (the learner)", False), ("over the rows", True)):
        ms = [spike(group, rng, over_rows) for _ in range(args.rounds)]
        refits = args.servers * len(SCOPES)
        print(f"{name:>28}: spike median {statistics.median(ms):7.1f} ms, max {max(ms):7.1f} ms; "
              f"{statistics.median(ms) / refits:.3f} ms per refit")
    states = {c.state for learner in group for c in learner.costs.values()}
    print(f"states after the rounds: {sorted(states)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
