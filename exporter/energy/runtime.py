"""The daemon's energy side: reads NVML and RAPL each tick, attributes device energy to servers, learns idle
baselines, and adds the energy series to the views and the scrape.

Per tick (exporter.daemon.Daemon.tick), on one monotonic clock and back to back with the vLLM reads:
    tick = runtime.read(t)                 # sources read; per-device deltas; per-server scope energy
    runtime.attribute(server_state, tick)  # -> server_state.history.add_energy(scope, joules, idle_joules)
    runtime.after_tick(t, server_states)   # idle learners, baseline persistence
At scrape: ``extend_view`` adds the per-window J/token figures, ``renderers`` the host-wide series.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from exporter.config import Config
from exporter.derive import energy as derive_energy
from exporter.energy.attribution import GpuAssignment, assign_gpus, host_shares
from exporter.energy.baseline import BaselineBook, IdleLearner
from exporter.samples import DeviceReading, SourceStatus
from exporter.store import DeviceTracker

SCOPES = ("gpu", "host")


@dataclass
class TickEnergy:
    """One tick's energy: per-device joules since the previous tick (None = no sample) and, per server and
    scope, (joules, idle joules) for that step, or None where some member device had no sample."""

    t: float
    seconds: float | None
    deltas: dict[str, float | None]
    by_server: dict[str, dict[str, tuple[float | None, float | None]]] = field(default_factory=dict)


def is_idle(status: SourceStatus, interval: Any, t: float) -> bool:
    """Idle for the baseline: the server answered at t, and its interval ending at t shows no running or
    waiting requests and no prompt or generated tokens (unknown counts as not idle)."""
    if not status.up or interval is None or interval.t1 != t:
        return False
    g, d = interval.gauges, interval.deltas
    return (g.get("running") == 0 and g.get("waiting") == 0
            and (d.get("generation_tokens") or 0) == 0 and (d.get("prompt_tokens") or 0) == 0)


class EnergyRuntime:
    def __init__(self, cfg: Config, nvml: Any = None, rapl: Any = None, book: BaselineBook | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        from exporter.sources.nvml import NvmlSource
        from exporter.sources.rapl import RaplSource

        self.cfg = cfg
        self.nvml = nvml if nvml is not None else NvmlSource(cfg.nvml_enabled)
        self.rapl = rapl if rapl is not None else RaplSource(cfg.powercap_root)
        self.book = book if book is not None else BaselineBook(cfg.state_dir, cfg.idle_power_watts, wall_clock)
        self.book.load()
        self.wall_clock = wall_clock
        self.tracker = DeviceTracker()
        self.statuses: list[SourceStatus] = []
        self.readings: dict[str, DeviceReading] = {}
        self.members: set[str] = set()  # devices that produced a sample at least once
        self.assignment = GpuAssignment({s.name: () for s in cfg.servers}, (), {})
        self.learners = {s.name: self._learner() for s in cfg.servers}
        self.shared_learner = self._learner()  # host zones and unassigned GPUs: idle when every server is
        self.last_tick: TickEnergy | None = None
        self._prev_t: float | None = None

    def _learner(self) -> IdleLearner:
        return IdleLearner(self.cfg.idle_settle_seconds, self.cfg.idle_min_seconds)

    # --- per tick ---------------------------------------------------------------------------------------
    def read(self, t: float) -> TickEnergy:
        nv_status, gpus = self.nvml.read(t)
        host_status, zones = self.rapl.read(t)
        self.statuses = [nv_status, host_status]
        readings = gpus + zones
        self.readings = {r.device: r for r in readings}
        self.members |= {r.device for r in readings if r.joules_total is not None}
        if {r.device for r in gpus} != set(self._assigned_gpus()):
            self.assignment = assign_gpus(self.cfg.servers, gpus)
        seconds = None if self._prev_t is None else t - self._prev_t
        self._prev_t = t
        tick = TickEnergy(t, seconds, self.tracker.deltas(readings))
        if seconds is not None and seconds > 0:
            tick.by_server = self._split(tick, [r.device for r in zones])
        self.last_tick = tick
        return tick

    def _assigned_gpus(self) -> list[str]:
        return [d for devs in self.assignment.by_server.values() for d in devs] + list(self.assignment.unassigned)

    def _sum(self, devices: Sequence[str], tick: TickEnergy) -> tuple[float | None, float | None] | None:
        """(joules, idle joules) over member devices; None when there is no member (scope absent)."""
        devices = [d for d in devices if d in self.members]
        if not devices:
            return None
        values = [tick.deltas.get(d) for d in devices]
        joules = None if any(v is None for v in values) else sum(values)
        watts = [self.book.watts(d, self.readings[d].labels if d in self.readings else None) for d in devices]
        idle = None if any(w is None for w in watts) else sum(watts) * tick.seconds
        return joules, idle

    def _split(self, tick: TickEnergy, host_devices: list[str]) -> dict:
        names = [s.name for s in self.cfg.servers]
        out: dict[str, dict] = {n: {} for n in names}
        for n in names:
            gpu = self._sum(self.assignment.by_server.get(n, ()), tick)
            if gpu is not None:
                out[n]["gpu"] = gpu
        host = self._sum(host_devices, tick)
        if host is not None:
            shares = host_shares(names, {n: out[n]["gpu"][0] if "gpu" in out[n] else None for n in names})
            for n in names:
                j, i = host
                out[n]["host"] = (None if j is None else j * shares[n], None if i is None else i * shares[n])
        return out

    def attribute(self, state: Any, tick: TickEnergy) -> None:
        for scope, (joules, idle) in tick.by_server.get(state.cfg.name, {}).items():
            state.history.add_energy(scope, joules, idle)

    def after_tick(self, t: float, servers: Sequence[Any]) -> None:
        tick = self.last_tick
        if tick is None or tick.t != t:
            return
        self.book.refresh_if_changed()
        temps = {d: r.temperature_celsius for d, r in self.readings.items()}
        idle = {}
        for s in servers:
            last = s.history.intervals[-1] if s.history.intervals else None
            idle[s.cfg.name] = is_idle(s.status, last, t)
            devices = self.assignment.by_server.get(s.cfg.name, ())
            self._learn(self.learners[s.cfg.name], t, idle[s.cfg.name], devices, tick, temps)
        shared = [d for d, r in self.readings.items() if r.kind == "host"] + list(self.assignment.unassigned)
        self._learn(self.shared_learner, t, bool(idle) and all(idle.values()), shared, tick, temps)

    def _learn(self, learner: IdleLearner, t: float, idle: bool, devices: Sequence[str], tick: TickEnergy,
               temps: dict) -> None:
        estimates = learner.feed(t, idle, {d: tick.deltas.get(d) for d in devices}, temps)
        if estimates:
            self.book.record(estimates, "learned")

    # --- scrape -----------------------------------------------------------------------------------------
    def extend_view(self, view: Any, state: Any, now: float, cfg: Config) -> None:
        for w in view.windows:
            ivs = state.history.window(now, w.seconds)
            series = w.extra.setdefault("series", [])
            status = w.extra.setdefault("status", {}).setdefault("energy", {})
            for scope in SCOPES:
                basis = derive_energy.window_energy(ivs, scope)
                if basis is not None:  # what the figure rests on, for /api/status
                    status[scope] = {"joules": basis.energy_joules, "idle_joules": basis.idle_joules,
                                     "generated_tokens": basis.tokens, "seconds": basis.seconds,
                                     "loaded_seconds": basis.loaded_seconds}
                fig = derive_energy.qualified(basis, cfg.min_load_seconds)
                if fig is None:
                    continue
                series.append(("kvwatt_energy_per_token_joules", {"scope": scope}, fig.joules_per_token))
                series.append(("kvwatt_marginal_energy_per_token_joules", {"scope": scope},
                               fig.marginal_joules_per_token))
            attribution = derive_energy.prompt_attribution(ivs, cfg.min_load_seconds, cfg.load_to_compute_cost_ratio)
            for source, value in (attribution or {}).items():
                series.append(("kvwatt_prompt_energy_per_token_joules", {"source": source}, value))

    def renderers(self) -> list[Callable[[Any], None]]:
        return [self.render]

    def render(self, f: Any) -> None:
        """Host-wide series: source health, device counters, methods, power, idle baselines and ages."""
        from exporter.collector import render_status

        for status in self.statuses:
            render_status(f, status)
        now_wall = self.wall_clock()
        for r in self.readings.values():
            for name, labels, value in device_series(r, self.book.get(r.device, r.labels), now_wall):
                f.add(name, labels, value)

    def close(self) -> None:
        self.nvml.close()


def device_series(r: DeviceReading, baseline: Any, now_wall: float) -> list[tuple[str, dict, float | None]]:
    """The series one device contributes (values None are left out by the collector)."""
    out: list[tuple[str, dict, float | None]] = []
    if r.kind == "gpu":
        out += [("kvwatt_gpu_energy_joules_total", r.labels, r.joules_total),
                ("kvwatt_gpu_power_watts", r.labels, r.power_watts),
                ("kvwatt_gpu_energy_method_info", {**r.labels, "method": r.method}, 1.0)]
        idle_name = "kvwatt_gpu_idle_power_watts"
    else:
        out.append(("kvwatt_host_energy_joules_total", r.labels, r.joules_total))
        idle_name = "kvwatt_host_idle_power_watts"
    if baseline is not None:
        out.append((idle_name, r.labels, baseline.watts))
        out.append(("kvwatt_idle_baseline_age_seconds", {"device": r.device}, baseline.age_seconds(now_wall)))
    return out
