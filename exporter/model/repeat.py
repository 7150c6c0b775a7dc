"""The repeat windows of one server, kept as they complete (methods.md s2; docs/architecture.md "Garbage
collection"): each completed bucket of the repeat grid becomes one ``economics.WindowStat`` once, appended here in
time order; a window's repeat windows are then a slice found by bisection, so a tick's cost does not grow with the
hour of history (reading every completed bucket of the window each tick did: ~120 a server-hour).

The same windows as ``ServerHistory.buckets(width, now - seconds, now)``: a stat leaves when its bucket leaves the
grid (older than the history's span), and a bucket completed out of time order (a late interval opened it after
a newer one closed: rare) makes the list be rebuilt from the grid, reusing every stat already computed."""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right

from exporter.derive import economics
from exporter.store import ServerHistory
from exporter.store.buckets import EPS


class RepeatWindows:
    """WindowStats of the repeat grid of ``width`` seconds, in time order (marginal or total J/token)."""

    def __init__(self, width: float, marginal: bool, scope: str = "gpu") -> None:
        self.width, self.marginal, self.scope = width, marginal, scope
        self._t0: list[float] = []
        self._t1: list[float] = []
        self._stats: list[economics.WindowStat] = []
        self._head = 0  # the first live entry (dropped ones are cut off in batches)
        self._last_t1 = -math.inf
        self._reorders = 0

    def within(self, history: ServerHistory, now: float, seconds: float) -> list[economics.WindowStat]:
        """The completed repeat windows lying wholly inside [now - seconds, now]."""
        self._update(history)
        lo = bisect_left(self._t0, now - seconds - EPS, self._head)
        hi = bisect_right(self._t1, now + EPS, lo)
        return self._stats[lo:hi]

    def _update(self, history: ServerHistory) -> None:
        grid = history.grid(self.width)
        if grid.reorders != self._reorders:
            self._rebuild(history, grid.reorders)
        elif history.now is not None:
            for b in history.buckets(self.width, self._last_t1, history.now):
                if b.t1 > self._last_t1:
                    self._append(b)
        self._trim(history)

    def _append(self, b) -> None:
        self._t0.append(b.t0)
        self._t1.append(b.t1)
        self._stats.append(economics.window_stat(b.agg, b.t0, b.t1, self.width, self.scope, self.marginal))
        self._last_t1 = b.t1

    def _rebuild(self, history: ServerHistory, reorders: int) -> None:
        known = {t0: s for t0, s in zip(self._t0[self._head:], self._stats[self._head:])}
        self._t0, self._t1, self._stats, self._head = [], [], [], 0
        self._reorders = reorders
        for b in history.buckets(self.width, -math.inf, history.now if history.now is not None else -math.inf):
            stat = known.get(b.t0)
            if stat is None:
                self._append(b)
            else:
                self._t0.append(b.t0)
                self._t1.append(b.t1)
                self._stats.append(stat)
                self._last_t1 = max(self._last_t1, b.t1)

    def _trim(self, history: ServerHistory) -> None:
        """Drop what the grid dropped (store/buckets.py Grid.trim: t1 older than the history's span)."""
        if history.now is None:
            return
        oldest = history.now - history.max_age_seconds
        t1, head = self._t1, self._head
        while head < len(t1) and t1[head] < oldest:
            head += 1
        if head > 64 and head * 2 > len(t1):
            del self._t0[:head], self._t1[:head], self._stats[:head]
            head = 0
        self._head = head
