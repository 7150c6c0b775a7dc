"""The tick's energy: per-device joules from the sampled counters, attributed to servers, idle baselines learned.

Per tick (exporter.model.Model.ingest), on the sampler's one monotonic clock:
    ledger.ingest(tick)                     # device deltas and spans; per server and scope (joules, idle joules)
    ledger.attribute(name, history)         # -> history.add_energy(scope, joules, idle_joules)
    ledger.learn(t, idle_by_server)         # idle learners (docs/energy.md), baseline persistence
``devices(now_wall)`` gives the typed device figures of the snapshot. Nothing here reads a source.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from exporter.config import Config
from exporter.derive import phase_energy
from exporter.figures import DeviceFigures
from exporter.idle.baseline import BaselineBook, IdleLearner
from exporter.model.attribution import GpuAssignment, assign_gpus, host_shares
from exporter.samples import DeviceReading, Interval, SourceStatus, Tick
from exporter.store import DeviceTracker

SCOPES = ("gpu", "host")
log = logging.getLogger("kvwatt.energy")


@dataclass
class TickEnergy:
    """One tick's energy: per-device joules since the previous tick (None = no sample), per-device spans
    (joules, seconds between the device's own reads) and, per server and scope, (joules, idle joules) for
    that step, or None where some member device had no sample."""

    t: float
    seconds: float | None
    deltas: dict[str, float | None]
    spans: dict[str, tuple[float, float] | None] = field(default_factory=dict)
    by_server: dict[str, dict[str, tuple[float | None, float | None]]] = field(default_factory=dict)


def is_idle(status: SourceStatus, interval: Interval | None, t: float) -> bool | None:
    """Idle for the baseline: the server answered at t, and its interval ending at t shows no running or
    waiting requests and no prompt or generated tokens. None when the server did not answer at t (the idle
    learner holds its stretch over a short gap: the next interval spans it, so work in the gap still shows)."""
    if not status.up or interval is None or interval.t1 != t:
        return None
    g, d = interval.gauges, interval.deltas
    return (g.get("running") == 0 and g.get("waiting") == 0
            and (d.get("generation_tokens") or 0) == 0 and (d.get("prompt_tokens") or 0) == 0)


def everyone_idle(idle_by_server: Mapping[str, bool | None]) -> bool | None:
    """The shared devices' idleness (host zones, unassigned GPUs): busy when any server is busy, unknown when
    none is busy but one did not answer, idle when every server is."""
    values = list(idle_by_server.values())
    if not values or False in values:
        return False
    return None if None in values else True


class EnergyLedger:
    def __init__(self, cfg: Config, book: BaselineBook | None = None,
                 wall_clock: Callable[[], float] = time.time, learn_idle: bool = True) -> None:
        self.cfg = cfg
        self.book = book if book is not None else BaselineBook(cfg.state_dir, cfg.idle_power_watts, wall_clock)
        self.book.load()
        self.wall_clock = wall_clock
        self.learn_idle = learn_idle
        self.tracker = DeviceTracker()
        self.statuses: tuple[SourceStatus, ...] = ()
        self.readings: dict[str, DeviceReading] = {}
        self.members: set[str] = set()  # devices that produced a sample at least once
        self.assignment = GpuAssignment({s.name: () for s in cfg.servers}, (), {})
        self.learners = {s.name: self._learner() for s in cfg.servers}
        self.shared_learner = self._learner()  # host zones and unassigned GPUs: idle when every server is
        self.last: TickEnergy | None = None
        self._prev_t: float | None = None
        # False in a worker of several (exporter/runtime/workers.py): the host's energy is split by every server's
        # GPU energy, which one worker does not know; its servers then have no host scope
        self.split_host = True
        # whose lists assign the GPUs: every configured server's in a worker of several, so that a group of one
        # server without a list is not given the GPUs no server lists (exporter/model/attribution.py)
        self.assign_servers = cfg.servers

    def _learner(self) -> IdleLearner:
        return IdleLearner(self.cfg.idle_settle_seconds, self.cfg.idle_min_seconds)

    # --- per tick ---------------------------------------------------------------------------------------
    def ingest(self, tick: Tick) -> TickEnergy:
        t, readings = tick.t, list(tick.energy)
        self.statuses = tick.energy_statuses
        self.readings = {r.device: r for r in readings}
        self.members |= {r.device for r in readings if r.joules_total is not None}
        gpus = [r for r in readings if r.kind == "gpu"]
        if {r.device for r in gpus} != set(self._assigned_gpus()):
            self.assignment = assign_gpus(self.assign_servers, gpus)
        seconds = None if self._prev_t is None else t - self._prev_t
        self._prev_t = t
        before = dict(self.tracker.last_read_at)
        deltas = self.tracker.deltas(readings)
        energy = TickEnergy(t, seconds, deltas, _spans(readings, deltas, before))
        if seconds is not None and seconds > 0:
            energy.by_server = self._split(energy, [r.device for r in readings if r.kind == "host"])
        self.last = energy
        return energy

    def _assigned_gpus(self) -> list[str]:
        return [d for devs in self.assignment.by_server.values() for d in devs] + list(self.assignment.unassigned)

    def _sum(self, devices: Sequence[str], energy: TickEnergy) -> tuple[float | None, float | None] | None:
        """(joules, idle joules) over member devices; None when there is no member (scope absent)."""
        devices = [d for d in devices if d in self.members]
        if not devices:
            return None
        values = [energy.deltas.get(d) for d in devices]
        joules = None if any(v is None for v in values) else sum(values)
        watts = [self.book.watts(d, self.readings[d].labels if d in self.readings else None) for d in devices]
        idle = None if any(w is None for w in watts) else sum(watts) * energy.seconds
        return joules, idle

    def _split(self, energy: TickEnergy, host_devices: list[str]) -> dict:
        names = [s.name for s in self.cfg.servers]
        out: dict[str, dict] = {n: {} for n in names}
        for n in names:
            gpu = self._sum(self.assignment.by_server.get(n, ()), energy)
            if gpu is not None:
                out[n]["gpu"] = gpu
        host = self._sum(host_devices, energy) if self.split_host else None
        if host is not None:
            shares = host_shares(names, {n: out[n]["gpu"][0] if "gpu" in out[n] else None for n in names})
            j, i = host
            for n in names:
                out[n]["host"] = (None if j is None else j * shares[n], None if i is None else i * shares[n])
        return out

    def attribute(self, server: str, history: Any) -> None:
        if self.last is None:
            return
        for scope, (joules, idle) in self.last.by_server.get(server, {}).items():
            history.add_energy(scope, joules, idle)

    def learn(self, t: float, idle_by_server: Mapping[str, bool | None]) -> None:
        """Feed the idle learners with each device's own span (IdleAccumulator's arithmetic)."""
        energy = self.last
        if energy is None or energy.t != t:
            return
        self.book.refresh_if_changed()
        if not self.learn_idle:
            return
        temps = {d: r.temperature_celsius for d, r in self.readings.items()}
        for name, idle in idle_by_server.items():
            self._learn(self.learners[name], t, idle, self.assignment.by_server.get(name, ()), energy, temps)
        shared = [d for d, r in self.readings.items() if r.kind == "host"] + list(self.assignment.unassigned)
        self._learn(self.shared_learner, t, everyone_idle(idle_by_server), shared, energy, temps)

    def _learn(self, learner: IdleLearner, t: float, idle: bool | None, devices: Sequence[str], energy: TickEnergy,
               temps: dict) -> None:
        estimates = learner.feed(t, idle, {d: energy.spans.get(d) for d in devices}, temps)
        if estimates:
            self.book.record(estimates, "learned")

    # --- figures ----------------------------------------------------------------------------------------
    def devices(self, now_wall: float) -> tuple[DeviceFigures, ...]:
        out = []
        for r in self.readings.values():
            b = self.book.get(r.device, r.labels)
            out.append(DeviceFigures(r, b, None if b is None else b.age_seconds(now_wall)))
        return tuple(out)


def _spans(readings: Sequence[DeviceReading], deltas: Mapping[str, float | None],
           read_at_before: Mapping[str, float | None]) -> dict[str, tuple[float, float] | None]:
    """device -> (joules, seconds between this and the previous reading's read_at), None without a sample."""
    out: dict[str, tuple[float, float] | None] = {}
    for r in readings:
        d, prev = deltas.get(r.device), read_at_before.get(r.device)
        ok = d is not None and r.read_at is not None and prev is not None and r.read_at > prev
        out[r.device] = (d, r.read_at - prev) if ok else None
    return out


class PhaseLearner:
    """Measured per-phase energy costs of one server (methods.md s12): each completed repeat window becomes one
    observation per scope, kept for ``history_seconds``; the regression is refitted when a window arrives (at
    most once per tick, a few hundred 3-column rows). Logs when a scope's cost source changes, not per tick."""

    @classmethod
    def for_server(cls, cfg, name: str, width: float) -> "PhaseLearner":
        """One server's learner as the configuration sets it (``cfg``: a Config), over repeat windows of ``width``."""
        return cls(name=name, width=width, history_seconds=cfg.phase_history_seconds,
                   min_windows=cfg.phase_min_windows, max_condition=cfg.phase_max_condition,
                   load_to_compute_cost_ratio=cfg.load_to_compute_cost_ratio)

    def __init__(self, *, name: str, width: float, history_seconds: float, min_windows: int, max_condition: float,
                 load_to_compute_cost_ratio: float) -> None:
        self.name, self.width = name, width
        self.keep = max(int(history_seconds // width), 1)
        self.windows: dict[str, deque[phase_energy.PhaseWindow]] = {s: deque() for s in SCOPES}
        self.sums = {s: phase_energy.PhaseSums() for s in SCOPES}  # the regression's, kept with the windows
        self.min_windows, self.max_condition = min_windows, max_condition
        self.ratio = load_to_compute_cost_ratio
        self.last_t1 = -math.inf
        self.costs: dict[str, phase_energy.PhaseCosts] = {s: phase_energy.PhaseCosts(scope=s) for s in SCOPES}

    def observe(self, buckets: Iterable) -> bool:
        """Feed the completed buckets not seen yet; refit when one was added. True when refitted."""
        added = False
        for b in buckets:
            if b.t1 <= self.last_t1:
                continue
            self.last_t1 = b.t1
            for scope in SCOPES:
                o = phase_energy.observation(b, self.width, scope)
                if o is not None:
                    self._keep(scope, o)
                    added = True
        if added:
            for scope in SCOPES:
                self._refit(scope)
        return added

    def _keep(self, scope: str, o: phase_energy.PhaseWindow) -> None:
        """The window and its sums in; the oldest out past the history."""
        kept, sums = self.windows[scope], self.sums[scope]
        kept.append(o)
        sums.add(o)
        if len(kept) > self.keep:
            sums.remove(kept.popleft())
            self.sums[scope] = sums.recount(kept)

    def _refit(self, scope: str) -> None:
        before = self.costs[scope]
        now = self.costs[scope] = phase_energy.estimate(list(self.windows[scope]), scope, self.min_windows,
                                                         self.max_condition, self.ratio, self.sums[scope])
        if (before.state, before.source) != (now.state, now.source):
            log.info("%s: %s per-phase energy costs %s (%s, %d windows)%s", self.name, scope, now.state, now.source,
                     now.windows, f": {now.reason}" if now.reason else "")

    def set_aside(self) -> None:
        """Another engine behind the server (a new evidence epoch, model/epoch.py): its windows priced the old one's
        phases; the costs start again from the prior."""
        for scope in SCOPES:
            self.windows[scope].clear()
            self.sums[scope] = phase_energy.PhaseSums()
            self._refit(scope)

    def figures(self) -> tuple[phase_energy.PhaseCosts, ...]:
        """The scopes with at least one observation (a server without a host or GPU energy source has none)."""
        return tuple(c for s, c in self.costs.items() if self.windows[s])
