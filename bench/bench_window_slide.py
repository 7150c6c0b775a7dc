"""The worst single slide of a sliding window (one interval in, the oldest out) over two of its re-sum
periods, against one ``resum()`` of the same window: what a window cost in one tick when it re-summed all it
held at once (the code before issue 39's shadow sums; store/aggregate.py).

    .venv/bin/python bench/bench_window_slide.py [--seconds 3600] [--servers 32]

A ServerHistory-like store of 1 s intervals (the counters, gauges and GPU energy of a vLLM server: ~30 counter
keys) with one registered window of --seconds; it slides 2 x max(n, RESUM_MIN_REMOVALS) + n times, each slide
timed in CPU. Printed: the slides' p50 / p99 / max, one resum() of the full window, and both times --servers
(the servers of one group slide their windows in the same tick: the old one-shot re-sum landed on all of them
in that tick).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _support import summary  # noqa: E402

from exporter.samples import Interval  # noqa: E402
from exporter.store.aggregate import RESUM_MIN_REMOVALS, WindowAggregate  # noqa: E402
from exporter.store.columns import IntervalColumns  # noqa: E402

COUNTERS = [f"counter_{i}" for i in range(24)] + ["generation_tokens", "prompt_local_compute",
                                                   "prompt_local_cache_hit", "prompt_external_kv_transfer",
                                                   "prefix_queries", "prefix_hits"]


def interval(k: int) -> Interval:
    """The k-th 1 s interval: most counters move, some stay at zero (a quiet counter), busy and idle phases."""
    busy = (k // 60) % 3 != 0
    deltas = {c: (float((k * 7 + i) % 13) if busy and i % 4 else 0.0) for i, c in enumerate(COUNTERS)}
    gauges = {"kv_usage": (k % 97) / 100.0, "running": float(busy * (k % 9)), "waiting": float(k % 3),
              "waiting_capacity": 0.0}
    return Interval(t0=float(k), t1=float(k + 1), deltas=deltas, gauges=gauges,
                    energy_joules={"gpu": 300.0 + k % 50}, idle_joules={"gpu": 70.0})


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=int, default=3600, help="the window's length (1 s intervals)")
    ap.add_argument("--servers", type=int, default=32, help="servers of one group sliding in the same tick")
    args = ap.parse_args(argv)
    store = IntervalColumns()
    agg = WindowAggregate(store=store)
    for k in range(args.seconds):
        iv = interval(k)
        store.append(iv)
        agg.add(iv)
    slides = []
    for k in range(args.seconds, args.seconds + 2 * max(args.seconds, RESUM_MIN_REMOVALS) + args.seconds):
        iv = interval(k)
        a = time.thread_time()
        store.append(iv)
        agg.add(iv)
        agg.remove()
        store.popleft()
        slides.append((time.thread_time() - a) * 1e3)
    a = time.thread_time()
    agg.resum()
    resum_ms = (time.thread_time() - a) * 1e3
    s = summary(slides)
    print(f"window {args.seconds} s ({len(agg)} intervals held), {len(slides)} slides, CPU ms: {s}")
    print(f"one resum() of the full window: {resum_ms:.2f} ms of CPU")
    print(f"x {args.servers} servers in one tick: worst slide {s['max_ms'] * args.servers:.1f} ms, "
          f"one-shot re-sum {resum_ms * args.servers:.1f} ms")
    return {"slides": s, "resum_ms": resum_ms}


if __name__ == "__main__":
    main()
