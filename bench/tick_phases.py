"""Where one tick's time goes, with the history full and nothing else in the process: Daemon.step's stages timed
apart, in the CPU time of the thread running them (a busy machine shows in the wall clock, not here).

    .venv/bin/python bench/tick_phases.py [--servers 64] [--gpus 1] [--interval 1] [--ticks 60] [--fill-seconds S]

bench/soak.py's workload and daemon (exporter.runtime.daemon.Daemon, tuned as `kvwatt run` tunes it), the history filled
time-compressed to the plateau (the longest kept span + 300 s), then ``--ticks`` ticks, each split into the
stages Daemon.step runs: ingest (store, buckets, learners), snapshot (the figures), the bounds check, the samples
(collector.collect) and the text exposition (written from them), plus the GC policy. Prints the median and the maximum
of each stage and of
the whole, the whole's p99, kvwatt's CPU cost per watched server (the median tick over the servers: docs/fleet.md
"One kvwatt per node: what it costs the node"), and the slowest ticks with the collections inside them. No /metrics
scraper runs (bench/soak.py measures
the tick beside one): the difference between the two is what serving costs the tick.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_derive import T0  # noqa: E402
from soak import SoakWorkload, build  # noqa: E402

from exporter.runtime.service import tune_runtime  # noqa: E402
from exporter.serve.collector import collect, exposition_of  # noqa: E402

STAGES = ("ingest", "snapshot", "bounds", "samples", "text", "gc_policy")


def timed_tick(daemon, tick) -> list[float]:
    """Daemon.step's stages, one after the other, each in ms of this thread's CPU time."""
    c = time.thread_time
    marks = [c()]
    daemon.model.ingest(tick)
    marks.append(c())
    snap = daemon.model.snapshot()
    marks.append(c())
    snap = daemon.bounds.apply(snap)
    marks.append(c())
    collected = collect(snap, daemon.cfg.metrics_opt_in)
    marks.append(c())
    exposition_of(collected)
    marks.append(c())
    if daemon.gc_policy is not None:
        daemon.gc_policy.after_tick(tick.t)
    marks.append(c())
    return [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]


def _p99(xs: list[float]) -> float:
    """The 99th percentile, nearest rank (of 60 ticks: the slowest)."""
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", type=int, default=64)
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--windows", default="60,3600")
    ap.add_argument("--ticks", type=int, default=60)
    ap.add_argument("--fill-seconds", type=float, default=None,
                    help="simulated seconds of history before the timed ticks (default: the longest kept span + "
                         "300 s, the plateau); shorter runs faster, with fewer repeat windows in the long window")
    args = ap.parse_args(argv)
    if args.servers <= 0 or args.gpus <= 0 or args.interval <= 0 or args.ticks <= 0 \
            or (args.fill_seconds is not None and not args.fill_seconds >= 0):
        print("tick_phases: --servers, --gpus, --interval and --ticks must be positive, --fill-seconds not negative",
              file=sys.stderr)
        return 2
    args.windows = tuple(float(w) for w in args.windows.split(","))
    args.derive_every = 16
    with tempfile.TemporaryDirectory(prefix="kvwatt-phases-") as tmp:
        daemon, clock = build(args, tmp)
        tune_runtime(daemon)
        work = SoakWorkload(args.servers, args.gpus, args.interval)
        keep = daemon.model.servers["s0"].history.max_age_seconds
        fill = int(math.ceil((keep + 300 if args.fill_seconds is None else args.fill_seconds) / args.interval))
        for k in range(fill):
            clock[0] = T0 + k * args.interval
            tick = work.tick(clock[0])
            daemon.step(tick) if k % args.derive_every == 0 else daemon.model.ingest(tick)
        collections: list[tuple[int, float]] = []

        def on_gc(phase: str, info: dict) -> None:
            if phase == "start":
                on_gc.started = time.thread_time()
            else:
                collections.append((info["generation"], (time.thread_time() - on_gc.started) * 1e3))
        gc.callbacks.append(on_gc)
        rows = []
        for k in range(fill, fill + args.ticks):
            clock[0] = T0 + k * args.interval
            tick = work.tick(clock[0])
            collections.clear()
            rows.append((timed_tick(daemon, tick), list(collections)))
        gc.callbacks.remove(on_gc)
    print(f"{args.servers} servers x {args.gpus} GPUs, interval {args.interval:g} s, windows {args.windows}, "
          f"history {fill * args.interval:.0f} s filled (kept: {keep:.0f} s); {args.ticks} ticks, ms of the tick "
          f"thread's CPU:")
    for i, name in enumerate(STAGES):
        xs = [r[0][i] for r in rows]
        print(f"  {name:<10} median {statistics.median(xs):6.1f}  max {max(xs):6.1f}")
    totals = [sum(r[0]) for r in rows]
    print(f"  {'all':<10} median {statistics.median(totals):6.1f}  max {max(totals):6.1f}  "
          f"p99 {_p99(totals):6.1f}")
    per_server = statistics.median(totals) / args.servers
    print(f"per watched server: {per_server:.2f} ms of CPU a tick (median), i.e. {per_server / args.interval / 10:.3f} "
          f"% of one core at a {args.interval:g} s interval; load {'%.2f %.2f %.2f' % os.getloadavg()}")
    print("slowest ticks (stages; collections as (generation, ms)):")
    for stages, gcs in sorted(rows, key=lambda r: -sum(r[0]))[:5]:
        print(f"  {sum(stages):6.1f}: " + ", ".join(f"{n} {x:.1f}" for n, x in zip(STAGES, stages))
              + f"; {[(g, round(ms, 1)) for g, ms in gcs if ms >= 1.0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
