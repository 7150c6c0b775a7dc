"""Bounded per-server history of Intervals, built from successive readings.

Counter increases are taken per data-parallel engine and summed (``engine_deltas``): one engine vanishing or
restarting is not a server restart. A counter that goes down means that engine restarted, or a part of its
sum vanished; it re-bases: no delta for that step (unknown, never negative, never the catch-up of everything
it ever served). An engine that vanishes contributes nothing; one that (re)appears re-bases the same way.
A changed process_start_time_seconds is a whole-server restart: every counter counts from zero again, so
its value is the step's increase, even when it already climbed past its old value; unless it is another
process behind the same URL (store/identity.py decides: then no delta for that step).

Energy from the devices attributed to a server is accumulated tick by tick until the server's next
successful read, so an interval that spans a missed vLLM read still carries the energy of its whole span
(gap-free, energy-measurement.md rule 10).

Windows are incremental (docs/architecture.md "Windows"): each registered window length keeps a
WindowAggregate that intervals enter as they are appended and leave when ``advance(now)`` slides it, and each
registered grid width keeps the fixed buckets of store/buckets.py (the one grid rule), closed once ``now``
reaches their end. ``window(now, seconds)`` still returns the plain list (O(its length)).

The intervals themselves are rows of columns (store/columns.py): ``intervals``, the windows and the buckets name
rows and rebuild an Interval when one is read, so an hour of history is ~8 bytes a value and no object per
interval for the garbage collector to walk.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Iterable

from exporter.samples import EngineReading, Interval
from exporter.store.aggregate import WindowAggregate, aggregate_of
from exporter.store.buckets import Bucket, Grid, buckets_of
from exporter.store.columns import IntervalColumns, Rows
from exporter.store.deltas import EnergyAccumulator, engine_deltas, reset_engines
from exporter.store.identity import (
    RECENT_READINGS,
    EngineSetWatch,
    IdentityWatch,
    RegressionWatch,
    SpellingWatch,
    identity_of,
)

log = logging.getLogger("kvwatt.store")


class ServerHistory:
    """Intervals of one server, oldest first, bounded by age (longest window + margin) and count, plus the
    incremental aggregates of the registered sliding ``windows`` (seconds) and fixed ``grids`` (bucket widths,
    seconds). ``max_age_seconds`` may be math.inf (keep everything, up to ``max_intervals``)."""

    def __init__(self, max_age_seconds: float, max_intervals: int = 100_000, windows: Iterable[float] = (),
                 grids: Iterable[float] = (), name: str = ""):
        self.name = name  # the server's, for the log
        self.max_age_seconds = max_age_seconds
        self._rows = IntervalColumns()
        self.intervals = Rows(self._rows, max_intervals)  # read-only view, oldest first
        self.last_t: float | None = None
        self.last_counters: dict[str, dict[str, float]] = {}  # engine -> its counters at the last reading
        self.last_process_start: float | None = None
        self.energy = EnergyAccumulator()
        self.restarts = 0
        self.identity = IdentityWatch(name)  # two processes behind one URL: no delta across (store/identity.py)
        self.engine_set = EngineSetWatch(name)  # an engine label changing every read: logged once, not per tick
        self._seen: dict[str, set[str]] = {}  # engine -> every counter key read from it in this process
        self.spelling = SpellingWatch(name)  # a counter read from its other spelling: no delta across the switch
        self.regression = RegressionWatch(name)  # one counter going backwards alone: that counter's, not a process
        self.now: float | None = None  # time of the last advance()
        self._row_of_reading: deque = deque(maxlen=RECENT_READINGS)  # per reading: the row it appended, or None
        self._windows: dict[float, WindowAggregate] = {float(w): WindowAggregate(store=self._rows) for w in windows}
        self._grids: dict[float, Grid] = {float(w): Grid(float(w), self._rows) for w in grids}

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
        counters = reading.engine_counters  # engine -> its counters
        if not counters and reading.counters:
            counters = {"": reading.counters}  # an adapter without a per-engine split: one engine
        switched = self.spelling.observe(reading.spellings)
        # no delta across a switch of spelling, except from a series that never counted: vLLM 0.32 exports the
        # deprecated kv_offload_total_bytes at 0 from start-up and each flat series from its first transfer, so
        # the flat one's first value is all its traffic (a real ON engine's store bytes read 15 % low without it)
        prev = {e: {k: v for k, v in c.items() if k not in switched or v == 0.0}
                for e, c in self.last_counters.items()}
        if self.identity.last is not None and not identity_of(reading).same_process(self.identity.last):
            self.regression.clear()  # a new process identity: the identity watch decides (restart or switch)
            self.regression.recurring.note([])
            held = counters
        else:
            held, prev = self.regression.observe(prev, counters)
        # the identity's levels leave out the counters read from either of two spellings (their level moves
        # with the spelling) and see a counter that went backwards alone at its level before the drop
        step = self.identity.observe(reading, {e: {k: v for k, v in c.items() if k not in reading.spellings}
                                               for e, c in held.items()}, prev)
        restarted = step.restarted
        if restarted or step.events:
            self.regression.clear()  # another process: no counter's level before carries over
        if 0 < step.void_back <= len(self._row_of_reading):
            self._void(self._row_of_reading[-step.void_back])
        interval = None
        if self.last_t is not None and t > self.last_t:
            base = step.prev if restarted or step.events else self._born_at_zero(step.prev, counters)
            deltas = engine_deltas(base, counters, restarted)
            reset = [] if restarted else reset_engines(step.prev, held)
            if restarted or reset:
                self.restarts += 1
            churning = self.engine_set.observe(counters)
            if not (self.identity.problem or churning):  # flapping, churning: their one line says it all
                self._log_engine_changes(counters, restarted, reset)
            energy, idle = self.energy.take()
            interval = Interval(t0=self.last_t, t1=t, deltas=deltas, gauges=dict(reading.gauges), energy_joules=energy,
                                idle_joules=idle)
            self._append(interval)
        else:
            self.energy.take()
        self._row_of_reading.append(self._rows.end - 1 if interval is not None else None)
        if restarted or step.events:
            self._seen = {}  # another process: its labelled series are born again
        for e, c in counters.items():
            self._seen.setdefault(e, set()).update(c)
        self.last_t, self.last_process_start = t, start
        self.last_counters = {e: dict(c) for e, c in counters.items()}
        self.advance(t)
        return interval

    def _born_at_zero(self, prev: dict[str, dict[str, float]], counters: dict[str, dict[str, float]]
                      ) -> dict[str, dict[str, float]]:
        """``prev`` with 0 for each labelled counter ("<prefix>@<value>") that an engine read before shows for
        the first time in this process: a Prometheus labelled child is created at its first increment, so its
        first value is its increase (vLLM's kv_offload_tiering_*{tier} series appear at their first observation:
        a disk tier's one promotion would otherwise never count). A key seen before (a family that was refused
        for a read, or vanished) re-bases as any counter does."""
        out = prev
        for e, c in counters.items():
            before, seen = prev.get(e), self._seen.get(e, set())
            if not before:
                continue  # an engine seen for the first time: its counters start from this reading
            born = [k for k in c if "@" in k and k not in before and k not in seen]
            if born:
                out = dict(out) if out is prev else out
                out[e] = {**before, **dict.fromkeys(born, 0.0)}
        return out

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
        if self.intervals.maxlen is not None and len(self._rows) >= self.intervals.maxlen:
            self._drop_oldest()
        self._rows.append(iv)  # first: the windows and buckets name the row
        for agg in self._windows.values():
            agg.add(iv)
        for grid in self._grids.values():
            grid.add(iv)

    def _void(self, row: int | None) -> None:
        """The step at ``row`` counted another process's counters (store/identity.py): its counter deltas
        leave the row, the windows and the grid bucket still holding it (its energy and gauges stay)."""
        rows = self._rows
        if row is None or not rows.first <= row < rows.end:
            return
        old = rows.interval(row)
        if not old.deltas:
            return
        new = rows.void_deltas(row)
        for agg in self._windows.values():
            q = agg.intervals
            if q.lo <= row < q.hi:
                agg.amend(old, new)
        for grid in self._grids.values():
            agg = grid.holding(old)
            if agg is not None and agg.intervals.lo <= row < agg.intervals.hi:
                agg.amend(old, new)

    def _drop_oldest(self) -> None:
        """The oldest interval leaves the history (age or count bound): it leaves any window still holding it
        first (their sums read it)."""
        first = self._rows.first
        for agg in self._windows.values():
            q = agg.intervals
            if q and q.lo == first:
                agg.remove()
        self._rows.popleft()

    def advance(self, now: float) -> None:
        """Slide every registered window to ``now``, close the grid buckets ending by ``now``, trim by age.
        Cost: O(intervals leaving + buckets closing), independent of the windows' lengths."""
        if self.now is not None and now < self.now:
            return  # one monotonic clock: never slide back
        self.now = now
        rows = self._rows
        for seconds, agg in self._windows.items():
            lo = now - seconds - 1e-6
            q = agg.intervals
            while q and rows.t0(q.lo) < lo:
                agg.remove()
        for grid in self._grids.values():
            grid.close(now)
            grid.trim(now - self.max_age_seconds)
        self._trim(now)

    def restart_windows(self, break_run: bool = False) -> None:
        """Start the sliding windows afresh (a new evidence epoch, the server back from an outage): every held
        interval leaves them, so no window mixes two engines or spans an outage, and their coverage counts only
        what came after. ``break_run``: the next reading only sets the counters' base (no interval spans the
        gap, and the energy accumulated over it is dropped with it). Grid buckets keep theirs: one cut by the break
        is less covered, and a consumer that needs coverage (evidence windows, repeat windows) drops it."""
        for agg in self._windows.values():
            while agg.intervals:
                agg.remove()
        if break_run:
            self.last_t = None
            self.last_counters = {}
            self.energy.take()

    def _trim(self, now: float) -> None:
        rows = self._rows
        while rows and rows.t1(rows.first) < now - self.max_age_seconds:
            self._drop_oldest()

    def window(self, now: float, seconds: float) -> list[Interval]:
        """Intervals that ended within the last ``seconds`` and started inside it too (so that an interval
        spanning a long outage does not stretch the window)."""
        lo = now - seconds - 1e-6
        rows = self._rows
        return list(rows.rows(rows.first_index_from(lo), rows.end))  # rows are in time order

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

    def grid(self, width: float) -> Grid | None:
        """The registered grid of ``width`` (None: not registered)."""
        return self._registered(self._grids, width)

    def buckets(self, width: float, start: float, end: float) -> list[Bucket]:
        """Completed buckets of the grid of ``width`` with t0 >= start and t1 <= end, in time order; a bucket
        no interval ended in is missing, not empty. An unregistered width is built from the intervals held."""
        grid = self._registered(self._grids, width)
        if grid is not None:
            return grid.completed(start, end)
        if self.now is None:
            return []
        return buckets_of(self.intervals, width, start, min(end, self.now))
