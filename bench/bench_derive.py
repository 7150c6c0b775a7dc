"""Cost of one tick's derivation (Model.ingest + Model.snapshot) and of one /metrics render,
windows [1m,5m] vs [1m,5m,15m,1h] (and [15m,1h]), 8 and 32 servers, after an hour of 1 s ticks
(target: independent of window length).

    .venv/bin/python bench/bench_derive.py [--seconds 3600] [--measure 60] [--servers 8,32]

In-process, no I/O: each configuration's exporter.model.Model is fed --seconds of synthetic 1 s ticks
(exporter.samples.Tick: every server read OK with counters and gauges built from the vLLM 0.32 fixture and
moved by a load pattern with busy and idle phases, one counter GPU per server with its energy), then
--measure more ticks are timed: ingest, snapshot, and the render of the snapshot's exposition
(exporter.serve.collector.render: the families + prometheus_client generate_latest, done once per tick by the
daemon; a scrape itself only copies those bytes). Also printed: the time of one full garbage collection with
that history in memory (a pause of every thread, the event loop's included, whenever CPython runs one). The fill ingests
without deriving (Model.snapshot is pure, the history does not depend on it), so the hour takes seconds, not minutes.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _support import FIXTURE, percentile, table  # noqa: E402

from exporter.config import Config, ServerConfig  # noqa: E402
from exporter.model import Model  # noqa: E402
from exporter.samples import DeviceReading, EngineReading, ServerRead, SourceStatus, Tick  # noqa: E402
from exporter.serve.collector import render  # noqa: E402
from exporter.sources.endpoint import EngineSource  # noqa: E402

T0 = 10_000.0  # monotonic start of the synthetic run
WALL0 = 1.75e9

# CPU time of this thread, not wall time: the machine may be shared, and a preempted tick is not a costly one
CLOCK = time.thread_time

SHORT = (60.0, 300.0)
LONG = (60.0, 300.0, 900.0, 3600.0)
LONG_ONLY = (900.0, 3600.0)  # as many windows as SHORT, 12x longer: the direct test of length independence
LABEL = {SHORT: "1m,5m", LONG: "1m,5m,15m,1h", LONG_ONLY: "15m,1h"}


class Workload:
    """Deterministic synthetic load: per server, busy phases of 7 min and idle phases of 3 min (so idle
    baselines get learned), KV usage and throughput following the load, a preemption now and then."""

    def __init__(self, servers: int) -> None:
        base = EngineSource("fixture", "http://fixture", 2.0, 1 << 23).decode(FIXTURE.read_text())
        self.base = base
        self.names = [f"s{i}" for i in range(servers)]
        self.counters = [dict(base.counters) for _ in range(servers)]
        self.joules = [1000.0 * (i + 1) for i in range(servers)]

    def load(self, i: int, t: float) -> float:
        phase = (t - T0 + 37 * i) % 600
        if phase >= 420:
            return 0.0
        return 0.5 + 0.45 * math.sin(2 * math.pi * (t + 13 * i) / 97.0)

    def server_read(self, i: int, t: float, dt: float = 1.0) -> tuple[ServerRead, float]:
        """Server ``i``'s reading at ``t`` after ``dt`` seconds of its load, and that load (0..1)."""
        name, x, c = self.names[i], self.load(i, t), self.counters[i]
        gen, prompt = 800 * x * dt, 2500 * x * dt
        c["generation_tokens"] += gen
        c["prompt_tokens"] += prompt
        c["prompt_local_compute"] += 0.25 * prompt
        c["prompt_local_cache_hit"] += 0.75 * prompt
        c["prefix_queries"] += prompt
        c["prefix_hits"] += 0.75 * prompt
        c["flops"] += 3e9 * gen
        if x > 0.9 and t == int(t) and int(t) % 7 == 0:
            c["preemptions"] += 1
        gauges = dict(self.base.gauges, running=round(40 * x), waiting=round(10 * max(x - 0.7, 0)),
                      kv_usage=min(0.99, 0.05 + 0.95 * x))
        return ServerRead(name, SourceStatus(source="vllm", server=name, up=True, reason="", duration_seconds=0.004,
                                             state="ok"),
                          EngineReading(counters=dict(c), gauges=gauges, info=self.base.info,
                                        capabilities=self.base.capabilities, engine=self.base.engine)), x

    def tick(self, t: float) -> Tick:
        servers, devices = {}, []
        for i, name in enumerate(self.names):
            servers[name], x = self.server_read(i, t)
            watts = 80.0 + 500.0 * x
            self.joules[i] += watts
            uuid = f"GPU-{i:08d}-bench"
            devices.append(DeviceReading(device=f"gpu:{uuid}", kind="gpu", labels={"gpu": str(i), "uuid": uuid},
                                         joules_total=self.joules[i], continuous=True, power_watts=watts,
                                         method="counter", temperature_celsius=45.0, read_at=t))
        statuses = (SourceStatus(source="nvml", server="", up=True, reason="", duration_seconds=0.005, state="ok"),
                    SourceStatus(source="rapl", server="", up=False, reason="unsupported: no powercap",
                                 duration_seconds=0.0, state="down"))
        return Tick(t, servers, statuses, tuple(devices))


class Case:
    """One configuration: its model, fed the same synthetic workload as the others."""

    def __init__(self, servers: int, windows: tuple[float, ...], tmp: str) -> None:
        self.servers, self.windows = servers, windows
        cfg = Config(servers=tuple(ServerConfig(f"s{i}", f"http://127.0.0.1:{9000 + i}", gpus=(str(i),))
                                   for i in range(servers)),
                     windows_seconds=windows, state_dir=str(Path(tmp) / f"state-{servers}-{LABEL[windows]}"),
                     powercap_root=str(Path(tmp) / "no-powercap"))
        self.clock = T0
        self.model = Model(cfg, wall_clock=lambda: WALL0 + self.clock - T0)
        self.work = Workload(servers)
        self.ingest, self.snapshot, self.render = [], [], []
        self.size, self.snap = 0, None

    def fill(self, seconds: int) -> None:
        start = time.perf_counter()
        for k in range(seconds):
            self.clock = T0 + k
            self.model.ingest(self.work.tick(self.clock))
        self.fill_s = time.perf_counter() - start
        self.next_k = seconds
        # one full (generation 2) collection with this history in memory: a pause of every thread, the event
        # loop's included, whenever CPython runs one. Then freeze what exists so the next case's collection
        # counts only its own objects.
        gc.collect()
        frozen = gc.get_freeze_count()
        a = time.perf_counter()
        gc.collect()
        self.full_gc_ms = (time.perf_counter() - a) * 1e3
        gc.freeze()
        self.gc_objects = gc.get_freeze_count() - frozen

    def step(self) -> None:
        self.clock = T0 + self.next_k
        self.next_k += 1
        tick = self.work.tick(self.clock)
        a = CLOCK()
        self.model.ingest(tick)
        b = CLOCK()
        snap = self.model.snapshot()
        c = CLOCK()
        body = render(snap)
        d = CLOCK()
        self.ingest.append((b - a) * 1e3)
        self.snapshot.append((c - b) * 1e3)
        self.render.append((d - c) * 1e3)
        self.size, self.snap = len(body), snap

    def result(self) -> dict:
        def med(xs):
            return round(percentile(xs, 50), 3)

        tick = [i + s for i, s in zip(self.ingest, self.snapshot)]
        return {"servers": self.servers, "windows": LABEL[self.windows], "fill_s": round(self.fill_s, 2),
                "covered_s": {w.window: round(w.covered_seconds) for w in self.snap.servers[0].windows},
                "ingest_ms": med(self.ingest), "snapshot_ms": med(self.snapshot), "tick_ms": med(tick),
                "tick_p99_ms": round(percentile(tick, 99), 3), "render_ms": med(self.render),
                "render_p99_ms": round(percentile(self.render, 99), 3), "exposition_bytes": self.size,
                "full_gc_ms": round(self.full_gc_ms, 1), "gc_objects": self.gc_objects,
                "intervals_kept": len(self.model.servers["s0"].history.intervals)}


def run(servers: int, fill_seconds: int, measure: int, tmp: str) -> list[dict]:
    """Fill each configuration, then time them tick by tick in turn, so load from elsewhere on the machine
    falls on all of them alike."""
    cases = [Case(servers, windows, tmp) for windows in (SHORT, LONG, LONG_ONLY)]
    for case in cases:
        case.fill(fill_seconds)
    cases[0].model.snapshot(), cases[1].model.snapshot(), cases[2].model.snapshot()  # first-call caches
    for _ in range(measure):
        for case in cases:
            case.step()
    results = [c.result() for c in cases]
    del cases
    gc.unfreeze()
    gc.collect()
    return results


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=3600, help="history to fill before measuring (1 s ticks)")
    ap.add_argument("--measure", type=int, default=60, help="ticks timed after the fill")
    ap.add_argument("--servers", default="8,32")
    args = ap.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="kvwatt-bench-") as tmp:
        for n in (int(x) for x in args.servers.split(",")):
            results += run(n, args.seconds, args.measure, tmp)
    rows, ratios = [], {}
    for r in results:
        rows.append([r["servers"], r["windows"], r["ingest_ms"], r["snapshot_ms"],
                     r["tick_ms"], r["tick_p99_ms"], r["render_ms"], r["render_p99_ms"], r["exposition_bytes"],
                     r["full_gc_ms"], r["gc_objects"], r["fill_s"]])
    for n in sorted({r["servers"] for r in results}):
        by = {r["windows"]: r for r in results if r["servers"] == n}
        short, long, long_only = by[LABEL[SHORT]], by[LABEL[LONG]], by[LABEL[LONG_ONLY]]
        ratios[n] = {"tick": round(long["tick_ms"] / short["tick_ms"], 2),
                     "render": round(long["render_ms"] / short["render_ms"], 2),
                     "same_count_tick": round(long_only["tick_ms"] / short["tick_ms"], 2),
                     "same_count_render": round(long_only["render_ms"] / short["render_ms"], 2)}
    print(f"after {args.seconds} s of 1 s ticks; thread CPU ms, medians (and p99) over {args.measure} ticks")
    print(table(rows, ["servers", "windows", "ingest ms", "snapshot ms", "tick ms", "tick p99", "render ms",
                       "render p99", "bytes", "full GC ms", "GC objects", "fill s"]))
    for n, r in ratios.items():
        print(f"{n} servers: [1m,5m,15m,1h] / [1m,5m]: tick {r['tick']}x, render {r['render']}x (4 windows vs 2: "
              f"twice the per-window figures, so ~2x is what length independence predicts); "
              f"[15m,1h] / [1m,5m] (same count, 12x longer): tick {r['same_count_tick']}x, "
              f"render {r['same_count_render']}x (target ~1x)")
    print("covered seconds per window after the fill:", {r["servers"]: r["covered_s"] for r in results
                                                         if r["windows"] == LABEL[LONG]})
    print("target: cost independent of window length")
    return {"configs": results, "ratio_long_over_short": ratios}


if __name__ == "__main__":
    main()
