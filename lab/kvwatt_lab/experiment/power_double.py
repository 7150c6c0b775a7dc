"""A power double for engines whose energy cannot be read here (a CPU test engine in a container: no RAPL, no
GPU), declared in a plan as ``energy.power_double`` and said so in every report that uses it.

It plays one RAPL package zone (the kernel's powercap layout, read by kvwatt's real RaplSource) whose counter
follows a stated cost model driven by the engine's own /metrics counters:

    energy = idle_watts * elapsed
           + joules_per_generated_token * vllm:generation_tokens_total
           + joules_per_gflop * vllm:estimated_flops_per_gpu_total / 1e9
           + joules_per_gib_transferred * (vllm:kv_offload_store_bytes + vllm:kv_offload_load_bytes) / 2^30
           + joules_per_gib_disk * (vllm:kv_offload_tiering_write_bytes + vllm:kv_offload_tiering_read_bytes) / 2^30

The last term prices a tiered engine's secondary tiers (the lab's disk tier: cascades CPU -> disk and promotions
disk -> CPU, every tier label summed); a block served from disk also pays the transfer term for its CPU -> GPU
load, as on a real node.

The FLOPs term is vLLM's own estimate (--enable-mfu-metrics), which counts every prefill the engine runs,
including the re-prefill of a preempted request that vllm:prompt_tokens_by_source does not count (vLLM 0.32
counts a request's first prefill only): recomputation costs energy here as on a GPU. The transfer term prices
the offload tier's copies. The costs are illustrative (docs/experiment.md "Power double"); what the double
guarantees is that dE follows the engine's work, not that it is any machine's.

A child process (spawned, so the experiment's threads and event loop are not forked) runs two threads: a
writer puts the cumulative energy into ``energy_uj`` every 20 ms (idle energy accrues with the clock), and a
poller reads /metrics every 0.2 s and charges the work done since its last answer, spread over as long as that
answer took to come (``Spread``); a counter that went down is a new engine process, re-based and never charged
negatively.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

WRITE_SECONDS = 0.02
POLL_SECONDS = 0.2           # each /metrics costs the API server tens of KB of rendering: do not starve it
MAX_ENERGY_RANGE_UJ = 262_143_328_850   # an Intel package zone's range
ZONE = "intel-rapl:0"
ZONE_NAME = "package-0"
GIB = 2 ** 30
# kvwatt's RAPL source drops a step above 1 kW as implausible (exporter/sources/rapl.py MAX_PLAUSIBLE_WATTS),
# losing its energy: the double never draws more than this, carrying a burst's excess forward instead
MAX_WATTS = 900.0
READY_TIMEOUT_SECONDS = 30.0
NICE = -10  # a spawned child imports kvwatt's parser: seconds on a loaded machine


@dataclass(frozen=True)
class PowerModel:
    """The double's costs (plan keys ``energy.power_double.*``)."""

    idle_watts: float
    joules_per_generated_token: float = 0.0
    joules_per_gflop: float = 0.0
    joules_per_gib_transferred: float = 0.0
    joules_per_gib_disk: float = 0.0

    def work_joules(self, generated: float, flops: float, transferred_bytes: float, disk_bytes: float = 0.0) -> float:
        return (self.joules_per_generated_token * generated + self.joules_per_gflop * flops / 1e9
                + self.joules_per_gib_transferred * transferred_bytes / GIB
                + self.joules_per_gib_disk * disk_bytes / GIB)

    def costs(self) -> str:
        disk = (f" + {self.joules_per_gib_disk:g} J per GiB written to or read from a secondary (disk) tier"
                if self.joules_per_gib_disk else "")
        return (f"{self.idle_watts:g} W idle + {self.joules_per_generated_token:g} J "
                f"per generated token + {self.joules_per_gflop:g} J per GFLOP of vLLM's FLOPs estimate (re-prefill "
                f"after preemption included) + {self.joules_per_gib_transferred:g} J per GiB stored to or loaded "
                "from the offload tier" + disk)


def write_zone(base: str) -> tuple[str, Path]:
    """The powercap tree of one package zone under ``base``: (the root to give kvwatt, the energy_uj file)."""
    devices = Path(base) / "sys/devices/virtual/powercap/intel-rapl"
    zone = devices / ZONE
    zone.mkdir(parents=True, exist_ok=True)
    (devices / "enabled").write_text("1\n")
    for name, value in (("name", ZONE_NAME), ("max_energy_range_uj", MAX_ENERGY_RANGE_UJ), ("enabled", 1),
                        ("energy_uj", 0)):
        (zone / name).write_text(f"{value}\n")
    root = Path(base) / "sys/class/powercap"
    root.mkdir(parents=True, exist_ok=True)
    link = root / ZONE
    if not link.is_symlink():
        link.symlink_to(os.path.relpath(zone, root))
    return str(root), zone / "energy_uj"


def set_energy(path: Path, energy_uj: int) -> None:
    """Atomically, as sysfs shows it: a reader never sees a half-written counter."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(f"{int(energy_uj)}\n")
    os.replace(tmp, path)


class PowerDouble:
    """``with PowerDouble(model, url, base) as root:`` a powercap root whose package zone follows the model."""

    def __init__(self, model: PowerModel, url: str, base: str):
        self.model, self.url, self.base = model, url.rstrip("/"), base
        ctx = multiprocessing.get_context("spawn")
        self.halt, self.ready = ctx.Event(), ctx.Event()
        self.root, self.energy_path = write_zone(base)
        self.process = ctx.Process(target=_drive, args=(model, self.url, str(self.energy_path), self.halt,
                                                        self.ready),
                                   name="kvwatt-power-double", daemon=True)

    def __enter__(self) -> str:
        """Start the double and return its powercap root once it has read the engine's counters (work before
        that first reading is not charged), or after READY_TIMEOUT_SECONDS when the engine does not answer."""
        self.process.start()
        self.ready.wait(READY_TIMEOUT_SECONDS)
        return self.root

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self.halt.set()
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


def _drive(model: PowerModel, url: str, energy_path: str, halt, ready=None) -> None:
    try:
        os.nice(NICE)   # a writer starved for half a second on a busy machine skews a 5 s idle baseline by 10 %
    except OSError:
        pass            # not allowed (not root): normal priority
    lock = threading.Lock()
    spread = Spread(max(0.0, MAX_WATTS - model.idle_watts))
    started = time.monotonic()
    path = Path(energy_path)

    def write() -> None:
        while not halt.wait(WRITE_SECONDS):
            now = time.monotonic()
            with lock:
                joules = model.idle_watts * (now - started) + spread.released(now)
            set_energy(path, int(round(joules * 1e6)) % MAX_ENERGY_RANGE_UJ)

    def poll() -> None:
        last, last_t = None, 0.0
        while True:
            now = counters(url)
            t = time.monotonic()
            if now is not None:
                if last is not None and all(a >= b for a, b in zip(now, last)):
                    with lock:
                        spread.add(t, t - last_t, model.work_joules(*(a - b for a, b in zip(now, last))))
                last, last_t = now, t
                if ready is not None:   # the first reading is the base: work from here on is charged
                    ready.set()
            if halt.wait(POLL_SECONDS):
                return

    threads = [threading.Thread(target=write, daemon=True), threading.Thread(target=poll, daemon=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if spread.capped_seconds >= 1.0:  # the work drew more than the cap: its energy came late, some after the run
        print(f"power double: the work's power exceeded {MAX_WATTS:g} W for {spread.capped_seconds:.0f} s of "
              f"this run, whose energy was held back (J/token low): lower the plan's energy.power_double costs",
              file=sys.stderr, flush=True)


class Spread:
    """Work energy released evenly over as long as it took to do, and never faster than ``max_watts``: the work a
    poll finds after a gap of g seconds (an engine that answered /metrics late) is charged over the next g
    seconds, not in one step, and a burst above ``max_watts`` is carried forward. A real counter has no such
    step, and kvwatt rightly drops a step above its plausible power (exporter/sources/rapl.py), which would lose
    that work's energy; the price is a lag of one poll gap (longer only while the work's power exceeds the cap)."""

    def __init__(self, max_watts: float = float("inf")) -> None:
        self.max_watts = max_watts
        self.done = 0.0                       # joules released up to ``self.t``
        self.t: float | None = None
        self.pending: list[list[float]] = []  # [start, seconds, joules, released], oldest first
        self.capped_seconds = 0.0             # time in which the cap held due work back (its energy came late)

    def add(self, t: float, seconds: float, joules: float) -> None:
        if joules > 0:
            self.pending.append([t, max(seconds, POLL_SECONDS), joules, 0.0])

    def released(self, t: float) -> float:
        """Joules released by time ``t`` (called with non-decreasing ``t``)."""
        dt = 0.0 if self.t is None else max(0.0, t - self.t)
        self.t = t if self.t is None else max(self.t, t)
        budget = self.max_watts * dt if self.max_watts != float("inf") else float("inf")
        held = False
        for entry in self.pending:            # oldest first: what the even spread has made due, within the cap
            start, seconds, joules, released = entry
            due = joules * min(1.0, max(0.0, t - start) / seconds) - released
            take = min(due, budget)
            if take > 0:
                entry[3] += take
                budget -= take
                self.done += take
            held = held or due - max(take, 0.0) > 1e-9
        self.capped_seconds += dt if held else 0.0
        self.pending = [e for e in self.pending if e[2] - e[3] > 1e-9]
        return self.done


def counters(url: str) -> tuple[float, float, float, float] | None:
    """(generated tokens, FLOPs, offload bytes stored + loaded, secondary-tier bytes written + read) from the
    engine's /metrics, None while it does not answer. The offload and tiering series appear only after their first
    transfer (0 until then)."""
    import urllib.error
    import urllib.request

    from exporter.sources.expfmt import parse
    from exporter.sources.vllm import extract

    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            text = r.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError):
        return None
    c = extract(parse(text)).counters
    if "generation_tokens" not in c:
        return None
    disk = sum(v for k, v in c.items() if k.startswith(("tier_write_bytes@", "tier_read_bytes@")))
    return (c["generation_tokens"], c.get("flops", 0.0),
            c.get("offload_store_bytes", 0.0) + c.get("offload_load_bytes", 0.0), disk)
