"""Measurement of one run with the daemon's own machinery and arithmetic.

``RunSampler`` runs the daemon's Sampler and Model (exporter.runtime.sampler, exporter.model) over one server, in its
own thread and event loop: every tick reads NVML, RAPL and the server's /metrics on one monotonic clock, each
with its own deadline, and the Model attributes the devices' energy to the server and appends an Interval to
its ServerHistory, which keeps the whole run. Over the idle phase it measures P_idle per device with
IdleAccumulator (the arithmetic of `kvwatt baseline idle`: each device's joules over the seconds between its
own readings) and records it in the model's BaselineBook (method "measured"), so every later Interval carries
P_idle * dt exactly as in the daemon. The Model's idle learner is off: a baseline learned in a lull of the
measurement would change P_idle halfway through the window.

``window_figures`` derives the run's figures from the measurement window's Intervals with exporter.derive
(the functions behind the daemon's gauges).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from exporter.config import Config, ServerConfig
from exporter.derive import energy as derive_energy
from exporter.derive.offload import store_failures, transfer_rates
from exporter.derive.pressure import rate_per_second
from exporter.derive.pressure_evidence import window_evidence
from exporter.derive.recompute import mfu_view, token_counts, token_shares
from exporter.idle.baseline import IdleAccumulator
from exporter.model import Model
from exporter.model.energy import SCOPES, is_idle
from exporter.runtime.sampler import MIN_DEADLINE_SECONDS, Sampler
from exporter.samples import Interval, Tick
from exporter.store import WindowAggregate, aggregate_of, gauge_values
from kvwatt_lab.experiment import tiers
from kvwatt_lab.experiment.plan import Plan

SERVER_NAME = "server"
READ_DEADLINE_FRACTION = 0.9  # of the sampling interval (RunSampler: one server, nothing to serve)


@dataclass
class IdleMeter:
    """The idle phase: IdleAccumulator over the devices, plus how much of the phase was not idle. A tick at which
    the server did not answer is neither (model/energy.py is_idle: None): its energy waits for the server's next
    answer, whose interval spans the gap and so says whether work was done in it (the daemon's idle learner holds
    such ticks the same way, energy/baseline.py)."""

    accum: IdleAccumulator = field(default_factory=IdleAccumulator)
    busy_seconds: float = 0.0
    total_seconds: float = 0.0
    pending: list = field(default_factory=list)  # (seconds, spans, temps) of the unanswered ticks since an answer

    def add(self, seconds: float, idle: bool | None, spans: dict[str, tuple[float, float] | None],
            temps: dict) -> None:
        self.total_seconds += seconds
        if idle is None:
            self.pending.append((seconds, spans, temps))
            return
        held, self.pending = [*self.pending, (seconds, spans, temps)], []
        if not idle:
            self.busy_seconds += sum(s for s, _, _ in held)  # requests or tokens in the idle phase: not measured
            return
        for _, tick_spans, tick_temps in held:
            for device, span in tick_spans.items():
                self.accum.add(device, span, tick_temps.get(device))


class RunSampler:
    """The daemon's Sampler and Model over one server, ticking in their own thread and event loop
    (``start``/``close``), so the replay's work in the main loop (thousands of streamed events per second)
    never delays a sample. The main thread only calls the methods below; the lock guards the model."""

    def __init__(self, plan: Plan, url: str, state_dir: str, powercap_root: str | None = None):
        """``powercap_root``: where RAPL is read, when not the plan's (a power double's tree)."""
        self.cfg = Config(servers=(ServerConfig(SERVER_NAME, url, gpus=plan.energy.gpus),),
                          interval_seconds=plan.sample_interval_seconds,
                          windows_seconds=(plan.phases.measure_seconds,),
                          kv_pressure_threshold_ratio=plan.kv_pressure_threshold, state_dir=state_dir,
                          powercap_root=powercap_root or plan.energy.powercap_root, nvml_enabled=plan.energy.nvml,
                          min_load_seconds=plan.energy.min_load_seconds)
        self.model = Model(self.cfg, keep_seconds=math.inf, learn_idle=False)  # keep the whole run
        # One server and no scrapes to answer: a tick may wait for the engine's /metrics up to 90 % of the
        # interval (the daemon keeps half for serving). A saturated CPU engine answers /metrics in > 0.5 s at
        # times; each read that misses the deadline lands in the next tick and lengthens the intervals at the
        # measurement window's edges, which the window then leaves out.
        self.read_deadline_seconds = max(min(READ_DEADLINE_FRACTION * self.cfg.interval_seconds,
                                             self.cfg.http_timeout_seconds), MIN_DEADLINE_SECONDS)
        self.server = self.model.servers[SERVER_NAME]
        self.lock = threading.Lock()
        self.idle_meter: IdleMeter | None = None
        self.idle_started_t = 0.0
        self.last_ok_t: float | None = None
        self.last_tick_t: float | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._running = threading.Event()
        self.error: BaseException | None = None

    # --- the sampling thread ----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._thread_main, name="kvwatt-sampler", daemon=True)
        self._thread.start()
        self._running.wait(10)

    def _thread_main(self) -> None:
        async def main() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            self._running.set()
            async with Sampler(self.cfg, deadline_seconds=self.read_deadline_seconds) as sampler:
                async for tick in sampler.ticks(self.cfg.interval_seconds, self._stop):
                    self._ingest(tick)
        try:
            asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - surfaced by close()
            self.error = e
        finally:
            self._running.set()

    def close(self) -> None:
        """Stop ticking and wait for the thread (the sampler releases the energy sources)."""
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(30)

    def _ingest(self, tick: Tick) -> None:
        with self.lock:
            self.model.ingest(tick)
            t = tick.t
            if self.server.status.up and SERVER_NAME in tick.servers:
                self.last_ok_t = t
            if self.idle_meter is not None:
                self._meter_idle(t)
            self.last_tick_t = t

    def _meter_idle(self, t: float) -> None:
        energy = self.model.energy.last
        if energy is None or energy.t != t or not energy.seconds or t - energy.seconds < self.idle_started_t:
            return  # only intervals wholly inside the idle phase
        ledger = self.model.energy
        history = self.server.history
        interval = history.intervals[-1] if history.intervals else None
        devices = [d for d, r in ledger.readings.items() if r.kind == "host"]
        devices += list(ledger.assignment.by_server.get(SERVER_NAME, ()))
        temps = {d: r.temperature_celsius for d, r in ledger.readings.items()}
        self.idle_meter.add(energy.seconds, is_idle(self.server.status, interval, t),
                            {d: energy.spans.get(d) for d in devices}, temps)

    # --- called from the main thread --------------------------------------------------------------------
    def begin_idle(self) -> None:
        with self.lock:
            self.idle_meter, self.idle_started_t = IdleMeter(), time.monotonic()

    def end_idle(self) -> dict:
        """Commit the idle baseline; what was measured, for the run's record."""
        with self.lock:
            meter, self.idle_meter = self.idle_meter or IdleMeter(), None
            estimates = meter.accum.estimates()
            self.model.energy.book.record(estimates, "measured")
            statuses = list(self.model.energy.statuses)
        return {"seconds": round(meter.total_seconds, 3), "busy_seconds": round(meter.busy_seconds, 3),
                "watts": {e.device: e.watts for e in estimates},
                "unmeasured": sorted((set(meter.accum.acc) | meter.accum.missing) - {e.device for e in estimates}),
                "sources": {s.source: (s.reason or "ok") for s in statuses}}

    async def wait_tick_after(self, t: float, timeout_seconds: float) -> None:
        """Return once a tick at or after monotonic time ``t`` has been recorded (or the timeout passed)."""
        deadline = time.monotonic() + timeout_seconds
        while (self.last_tick_t is None or self.last_tick_t < t) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def seconds_without_reading(self, now: float) -> float:
        since = self.last_ok_t
        return 0.0 if since is None else now - since

    def intervals(self) -> list[Interval]:
        with self.lock:
            return list(self.server.history.intervals)

    def intervals_between(self, t0: float, t1: float) -> list[Interval]:
        return [iv for iv in self.intervals() if iv.t0 >= t0 and iv.t1 <= t1]

    def server_facts(self) -> dict:
        info = self.server.info
        if info is None:
            return {}
        return {"model_name": info.model_name, "num_gpu_blocks": info.num_gpu_blocks, "block_size": info.block_size,
                "offload_enabled": info.offload_enabled, "offload_buffer_bytes": info.offload_buffer_bytes,
                "offload_backend": info.offload_backend, "restarts": self.server.history.restarts}


# ------------------------------------------------------------------------------------------------------
# figures of a window
# ------------------------------------------------------------------------------------------------------
def energy_figures(agg: WindowAggregate, scope: str, min_load_seconds: float) -> dict | None:
    w = derive_energy.window_energy(agg, scope)
    if w is None:
        return None
    figure = derive_energy.per_token(agg, scope, min_load_seconds)
    note = "" if figure is not None else (
        "no generated tokens" if w.tokens <= 0 else f"only {w.loaded_seconds:.1f} s of load (< min_load)")
    return {"energy_joules": w.energy_joules, "idle_joules": w.idle_joules, "tokens": w.tokens,
            "seconds": w.seconds, "loaded_seconds": w.loaded_seconds,
            "joules_per_token": figure.joules_per_token if figure else None,
            "marginal_joules_per_token": figure.marginal_joules_per_token if figure else None,
            "note": note}


def window_figures(intervals: Sequence[Interval], min_load_seconds: float) -> dict:
    agg = aggregate_of(intervals)
    covered = agg.covered_seconds
    # the daemon's window evidence: p95, KV max, preemptions/min (None on a glitched counter, as the daemon's)
    ev = window_evidence(agg, window_seconds=covered)
    generated = agg.delta("generation_tokens")
    preemptions = agg.delta("preemptions")
    counts = token_counts(agg)
    kv = gauge_values(intervals, "kv_usage")
    flops_per_second, flops_per_token = mfu_view(agg, generated)
    rates = transfer_rates(agg)
    return {
        "covered_seconds": covered, "intervals": len(intervals),
        "kv_usage_p95_ratio": ev.p95.value, "kv_usage_max_ratio": ev.kv_max, "kv_samples": len(kv),
        "preemptions": preemptions, "preemptions_per_minute": ev.preemptions_per_minute,
        "generation_tokens": generated, "prompt_tokens": agg.delta("prompt_tokens"),
        "tokens_per_second": rate_per_second(agg, "generation_tokens"),
        "prompt_tokens_by_source": counts, "prompt_token_shares": token_shares(counts),
        "flops_per_generated_token": flops_per_token,
        # offload tier traffic (methods.md s6): the report checks residency = buffer / write rate
        "offload_write_bytes_per_second": rates.write_bytes_per_second,
        "offload_read_bytes_per_second": rates.read_bytes_per_second,
        "offload_store_failures": store_failures(agg),
        "energy": {s: f for s in SCOPES if (f := energy_figures(agg, s, min_load_seconds)) is not None},
        # per tier (the link, the CPU tier, a disk tier): None without offloading (kvwatt_lab/experiment/tiers.py)
        "tiers": tiers.run_tiers(intervals),
        # the per-phase fit's observations (the report's J per computed prompt token, tiers.fitted_costs)
        "phase_windows": {s: tiers.phase_windows(intervals, s) for s in SCOPES},
    }


def interval_rows(intervals: Sequence[Interval]) -> list[dict]:
    """The run's Intervals as plain rows (intervals.jsonl), for auditing or re-deriving the figures."""
    return [{"t0": iv.t0, "t1": iv.t1, "deltas": iv.deltas, "gauges": iv.gauges,
             "energy_joules": iv.energy_joules, "idle_joules": iv.idle_joules} for iv in intervals]
