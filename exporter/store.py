"""Bounded per-server history of Intervals, built from successive readings.

Counter increases are taken per data-parallel engine and summed (``engine_deltas``): one engine vanishing or
restarting is not a server restart. A counter that goes down means that engine restarted, or a part of its
sum vanished; it re-bases: no delta for that step (unknown, never negative, never the catch-up of everything
it ever served). An engine that vanishes contributes nothing; one that (re)appears re-bases the same way.
A changed process_start_time_seconds is a whole-server restart: every counter counts from zero again, so
its value is the step's increase, even when it already climbed past its old value.

Energy from the devices attributed to a server is accumulated tick by tick until the server's next
successful read, so an interval that spans a missed vLLM read still carries the energy of its whole span
(gap-free, energy-measurement.md rule 10).

Windows are incremental (docs/architecture.md "Windows"): each registered window length keeps a
WindowAggregate that intervals enter as they are appended and leave when ``advance(now)`` slides it, and each
registered grid width keeps fixed buckets [k*W, (k+1)*W) of the shared monotonic clock, closed once ``now``
reaches their end. ``window(now, seconds)`` still returns the plain list (O(history)).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from exporter.derive.window import WindowAggregate, aggregate_of
from exporter.samples import DeviceReading, Interval, EngineReading

log = logging.getLogger("kvwatt.store")


def counter_deltas(prev: dict[str, float], cur: dict[str, float], restarted: bool) -> dict[str, float]:
    """One engine's counter increases since its previous reading. A counter seen for the first time, or one
    that went down, re-bases: no delta (a decrease is a reset or a partial sum, and its value is not an
    increase we can trust). After a whole-server restart (``restarted``) every value is its increase."""
    out = {}
    for key, value in cur.items():
        before = prev.get(key)
        if before is None:
            continue  # first sight of this counter: no interval yet
        if restarted:
            out[key] = value
        elif value >= before:
            out[key] = value - before
    return out


def engine_deltas(prev: dict[str, dict[str, float]], cur: dict[str, dict[str, float]],
                  restarted: bool) -> dict[str, float]:
    """The server's counter increases: per key, the sum of each engine's own increase (``counter_deltas``).
    Engines missing from ``cur`` contribute nothing; a key no engine gives an increase for is absent."""
    total: dict[str, float] = {}
    for engine, counters in cur.items():
        for key, d in counter_deltas(prev.get(engine, {}), counters, restarted).items():
            total[key] = total[key] + d if key in total else d
    return total


def reset_engines(prev: dict[str, dict[str, float]], cur: dict[str, dict[str, float]]) -> list[str]:
    """Engines with a counter that went down since the previous reading."""
    return [e for e, counters in cur.items()
            if any(v < prev[e][k] for k, v in counters.items() if k in prev.get(e, {}))]


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


@dataclass(frozen=True)
class Bucket:
    """One fixed-grid repeat window [t0, t1) of the shared monotonic clock (t0 = k * width) and the aggregate
    of the intervals that ended in it (bucket k = floor((t1 - 1e-9) / width))."""

    t0: float
    t1: float
    agg: WindowAggregate


def bucket_index(t1: float, width: float) -> int:
    return math.floor((t1 - 1e-9) / width)


class _Grid:
    """Buckets of one width: the ones still open (intervals may still arrive) and the completed ones."""

    def __init__(self, width: float) -> None:
        self.width = width
        self.open: dict[int, WindowAggregate] = {}
        self.done: deque[Bucket] = deque()

    def add(self, iv: Interval) -> None:
        k = bucket_index(iv.t1, self.width)
        agg = self.open.get(k)
        if agg is None:
            for b in reversed(self.done):  # a late interval for a bucket already closed (rare): join it
                if abs(b.t0 - k * self.width) < 1e-9:
                    b.agg.add(iv)
                    return
                if b.t0 < k * self.width:
                    break
            agg = self.open[k] = WindowAggregate()
        agg.add(iv)

    def close(self, now: float) -> None:
        if not self.open:
            return
        for k in sorted(self.open):
            t0, t1 = k * self.width, (k + 1) * self.width
            if t1 > now + 1e-9:
                break
            b = Bucket(t0, t1, self.open.pop(k))
            if self.done and self.done[-1].t0 > t0:  # out of order (late interval): keep time order
                items = sorted([*self.done, b], key=lambda x: x.t0)
                self.done = deque(items)
            else:
                self.done.append(b)

    def trim(self, oldest_t1: float) -> None:
        while self.done and self.done[0].t1 < oldest_t1:
            self.done.popleft()

    def completed(self, start: float, end: float) -> list[Bucket]:
        out = []
        for b in reversed(self.done):
            if b.t1 < start:
                break
            if b.t0 >= start - 1e-9 and b.t1 <= end + 1e-9:
                out.append(b)
        out.reverse()
        return out


class ServerHistory:
    """Intervals of one server, oldest first, bounded by age (longest window + margin) and count, plus the
    incremental aggregates of the registered sliding ``windows`` (seconds) and fixed ``grids`` (bucket widths,
    seconds). ``max_age_seconds`` may be math.inf (keep everything, up to ``max_intervals``)."""

    def __init__(self, max_age_seconds: float, max_intervals: int = 100_000, windows: Iterable[float] = (),
                 grids: Iterable[float] = (), name: str = ""):
        self.name = name  # the server's, for the log
        self.max_age_seconds = max_age_seconds
        self.intervals: deque[Interval] = deque(maxlen=max_intervals)
        self.last_t: float | None = None
        self.last_counters: dict[str, dict[str, float]] = {}  # engine -> its counters at the last reading
        self.last_process_start: float | None = None
        self.energy = EnergyAccumulator()
        self.restarts = 0
        self.now: float | None = None  # time of the last advance()
        self._windows: dict[float, WindowAggregate] = {float(w): WindowAggregate() for w in windows}
        self._grids: dict[float, _Grid] = {float(w): _Grid(float(w)) for w in grids}

    @property
    def windows(self) -> tuple[float, ...]:
        return tuple(self._windows)

    @property
    def grids(self) -> tuple[float, ...]:
        return tuple(self._grids)

    def add_energy(self, scope: str, joules: float | None, idle_joules: float | None) -> None:
        if self.last_t is not None:
            self.energy.add(scope, joules, idle_joules)

    def add_reading(self, t: float, reading: EngineReading) -> Interval | None:
        start = reading.info.process_start_time_seconds
        restarted = (start is not None and self.last_process_start is not None
                     and abs(start - self.last_process_start) > 1e-3)
        counters = reading.engine_counters  # engine -> its counters
        if not counters and reading.counters:
            counters = {"": reading.counters}  # an adapter without a per-engine split: one engine
        interval = None
        if self.last_t is not None and t > self.last_t:
            deltas = engine_deltas(self.last_counters, counters, restarted)
            reset = [] if restarted else reset_engines(self.last_counters, counters)
            if restarted or reset:
                self.restarts += 1
            self._log_engine_changes(counters, restarted, reset)
            energy, idle = self.energy.take()
            interval = Interval(self.last_t, t, deltas, dict(reading.gauges), energy, idle)
            self._append(interval)
        else:
            self.energy.take()
        self.last_t, self.last_process_start = t, start
        self.last_counters = {e: dict(c) for e, c in counters.items()}
        self.advance(t)
        return interval

    def _log_engine_changes(self, counters: dict[str, dict[str, float]], restarted: bool, reset: list[str]) -> None:
        """One line when the engine set changes or an engine's counters go down (not at every reading)."""
        prev = self.last_counters
        gone, new = sorted(set(prev) - set(counters)), sorted(set(counters) - set(prev))
        if restarted:
            log.info("%s: server restarted (new process_start_time_seconds)", self.name)
        if gone:
            log.info("%s: engine(s) %s vanished: they count for nothing until they are back", self.name, gone)
        if new:
            log.info("%s: engine(s) %s appeared: their counters start from this reading", self.name, new)
        if reset:
            log.info("%s: engine(s) %s counters went down: re-based, no delta for this step", self.name, reset)

    def _append(self, iv: Interval) -> None:
        if self.intervals.maxlen is not None and len(self.intervals) >= self.intervals.maxlen:
            self._drop(self.intervals.popleft())
        self.intervals.append(iv)
        for agg in self._windows.values():
            agg.add(iv)
        for grid in self._grids.values():
            grid.add(iv)

    def _drop(self, iv: Interval) -> None:
        """``iv`` left the history (age or count bound): it leaves any window still holding it."""
        for agg in self._windows.values():
            if agg.intervals and agg.intervals[0] is iv:
                agg.remove(iv)

    def advance(self, now: float) -> None:
        """Slide every registered window to ``now``, close the grid buckets ending by ``now``, trim by age.
        Cost: O(intervals leaving + buckets closing), independent of the windows' lengths."""
        if self.now is not None and now < self.now:
            return  # one monotonic clock: never slide back
        self.now = now
        for seconds, agg in self._windows.items():
            lo = now - seconds - 1e-6
            q = agg.intervals
            while q and q[0].t0 < lo:
                agg.remove(q[0])
        for grid in self._grids.values():
            grid.close(now)
            grid.trim(now - self.max_age_seconds)
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self.intervals and self.intervals[0].t1 < now - self.max_age_seconds:
            self._drop(self.intervals.popleft())

    def window(self, now: float, seconds: float) -> list[Interval]:
        """Intervals that ended within the last ``seconds`` and started inside it too (so that an interval
        spanning a long outage does not stretch the window)."""
        lo = now - seconds - 1e-6
        return [iv for iv in self.intervals if iv.t0 >= lo]

    def _registered(self, table: dict, seconds: float):
        found = table.get(float(seconds))
        if found is None:
            for w, v in table.items():
                if abs(w - seconds) <= 1e-9 * max(1.0, abs(w)):
                    return v
        return found

    def aggregate(self, seconds: float) -> WindowAggregate:
        """The aggregate of window(now, seconds) as of the last advance(now). A registered window is the live,
        incrementally kept aggregate (read it now: the next advance changes it); any other length is built
        on the spot from the intervals (O(window length))."""
        agg = self._registered(self._windows, seconds)
        if agg is not None:
            return agg
        if self.now is None:
            return WindowAggregate()
        return aggregate_of(self.window(self.now, seconds))

    def buckets(self, width: float, start: float, end: float) -> list[Bucket]:
        """Completed buckets of the grid of ``width`` with t0 >= start and t1 <= end, in time order; a bucket
        no interval ended in is missing, not empty. An unregistered width is built from the intervals held."""
        grid = self._registered(self._grids, width)
        if grid is not None:
            return grid.completed(start, end)
        if self.now is None:
            return []
        tmp = _Grid(float(width))
        for iv in self.intervals:
            tmp.add(iv)
        tmp.close(self.now)
        return tmp.completed(start, end)


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
