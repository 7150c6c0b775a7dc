"""Bounded per-server history of Intervals, built from successive readings.

A counter that goes down means the server restarted (or an engine vanished): the delta for that step is
the new value, as Prometheus' rate() assumes, never negative. A changed process_start_time_seconds is a
restart even when the counter already climbed past its old value. Energy from the devices attributed to a
server is accumulated tick by tick until the server's next successful read, so an interval that spans a
missed vLLM read still carries the energy of its whole span (gap-free, energy-measurement.md rule 10).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from exporter.samples import DeviceReading, Interval, VllmReading


def counter_deltas(prev: dict[str, float], cur: dict[str, float], restarted: bool) -> dict[str, float]:
    out = {}
    for key, value in cur.items():
        before = prev.get(key)
        if before is None:
            continue  # first sight of this counter: no interval yet
        out[key] = value if (restarted or value < before) else value - before
    return out


@dataclass
class EnergyAccumulator:
    """Energy (and idle energy) per scope since the server's last successful read; None once a gap hit."""

    joules: dict[str, float | None] = field(default_factory=dict)
    idle_joules: dict[str, float | None] = field(default_factory=dict)

    def add(self, scope: str, joules: float | None, idle: float | None) -> None:
        for target, value in ((self.joules, joules), (self.idle_joules, idle)):
            if scope in target and target[scope] is None:
                continue
            target[scope] = None if value is None else target.get(scope, 0.0) + value

    def take(self) -> tuple[dict[str, float], dict[str, float]]:
        e = {k: v for k, v in self.joules.items() if v is not None}
        i = {k: v for k, v in self.idle_joules.items() if v is not None and k in e}
        self.joules, self.idle_joules = {}, {}
        return e, i


class ServerHistory:
    """Intervals of one server, oldest first, bounded by age (longest window + margin) and count."""

    def __init__(self, max_age_seconds: float, max_intervals: int = 100_000):
        self.max_age_seconds = max_age_seconds
        self.intervals: deque[Interval] = deque(maxlen=max_intervals)
        self.last_t: float | None = None
        self.last_counters: dict[str, float] = {}
        self.last_process_start: float | None = None
        self.energy = EnergyAccumulator()
        self.restarts = 0

    def add_energy(self, scope: str, joules: float | None, idle_joules: float | None) -> None:
        if self.last_t is not None:
            self.energy.add(scope, joules, idle_joules)

    def add_reading(self, t: float, reading: VllmReading) -> Interval | None:
        start = reading.info.process_start_time_seconds
        restarted = (start is not None and self.last_process_start is not None
                     and abs(start - self.last_process_start) > 1e-3)
        interval = None
        if self.last_t is not None and t > self.last_t:
            deltas = counter_deltas(self.last_counters, reading.counters, restarted)
            if restarted or any(reading.counters.get(k, 0) < v for k, v in self.last_counters.items()
                                if k in reading.counters):
                self.restarts += 1
            energy, idle = self.energy.take()
            interval = Interval(self.last_t, t, deltas, dict(reading.gauges), energy, idle)
            self.intervals.append(interval)
        else:
            self.energy.take()
        self.last_t, self.last_counters, self.last_process_start = t, dict(reading.counters), start
        self._trim(t)
        return interval

    def _trim(self, now: float) -> None:
        while self.intervals and self.intervals[0].t1 < now - self.max_age_seconds:
            self.intervals.popleft()

    def window(self, now: float, seconds: float) -> list[Interval]:
        """Intervals that ended within the last ``seconds`` and started inside it too (so that an interval
        spanning a long outage does not stretch the window)."""
        lo = now - seconds - 1e-6
        return [iv for iv in self.intervals if iv.t0 >= lo]


class DeviceTracker:
    """Per-device joules between ticks from the sources' corrected cumulative counters."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}
        self.last_read_at: dict[str, float | None] = {}

    def deltas(self, readings: list[DeviceReading]) -> dict[str, float | None]:
        """device -> joules since the previous tick, or None when that device has no sample for the step."""
        out: dict[str, float | None] = {}
        for r in readings:
            prev = self.last.get(r.device)
            if r.joules_total is None:
                out[r.device] = None
                self.last.pop(r.device, None)  # re-base on the next good read: no catch-up delta
                self.last_read_at.pop(r.device, None)
                continue
            if prev is None or not r.continuous or r.joules_total < prev:
                out[r.device] = None
            else:
                out[r.device] = r.joules_total - prev
            self.last[r.device], self.last_read_at[r.device] = r.joules_total, r.read_at
        return out

    def spans(self, readings: list[DeviceReading]) -> dict[str, tuple[float, float] | None]:
        """device -> (joules, seconds) since its previous reading, the seconds taken between the two readings'
        own read_at (energy and time over the same interval), or None when the step has no sample."""
        before = dict(self.last_read_at)
        deltas = self.deltas(readings)
        out: dict[str, tuple[float, float] | None] = {}
        for r in readings:
            d, prev_at = deltas[r.device], before.get(r.device)
            ok = d is not None and r.read_at is not None and prev_at is not None
            out[r.device] = (d, r.read_at - prev_at) if ok else None
        return out
