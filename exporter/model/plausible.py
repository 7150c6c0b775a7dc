"""Counts no server can produce: the intervals whose counter deltas imply more than the server can be
(exporter/catalog/bounds.py ``implausible_counts``: generated tokens/s above ``token_rate_ceiling``), kept while a
window or
a learner's bucket can still hold them (docs/methods.md s13 "Rejected counts take their dependents with them").

A window that holds one serves every figure computed from those counts as unknown (``WindowFigures.implausible_counts``,
which the one check reads with ``catalog.bounds.DEPENDENCIES``), however long the window (a one-off jump averaged over
an hour
may look plausible; it is not); a learner's bucket that holds one is not learned from: the per-phase costs, the
evidence windows (and with them the located threshold and the reference share) and the write model's check."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable, Mapping

from exporter.catalog import bounds


@dataclass(frozen=True, kw_only=True)
class Jump:
    """One interval's implausible counts: its end ``t1`` (a window, or a grid bucket (t0, t1], holds the interval
    when it holds t1), and which counts (bounds.DEPENDENCIES' names) with why."""

    t1: float
    counts: Mapping[str, str]


class ImplausibleCounts:
    """The implausible intervals of one server within ``keep_seconds`` of the newest read."""

    def __init__(self, keep_seconds: float) -> None:
        self.keep_seconds = keep_seconds
        self.jumps: deque[Jump] = deque()

    def observe(self, interval, engines: int, gpus: int) -> None:
        """An interval just added to the history (None: none was)."""
        if interval is None:
            return
        counts = bounds.implausible_counts(interval.deltas, interval.t1 - interval.t0, engines, gpus)
        if counts:
            self.jumps.append(Jump(t1=interval.t1, counts=counts))
        while self.jumps and self.jumps[0].t1 < interval.t1 - self.keep_seconds:
            self.jumps.popleft()

    def within(self, now: float, seconds: float) -> dict[str, str] | None:
        """Counts name -> why, for the window of ``seconds`` ending at ``now`` (None: none implausible)."""
        out: dict[str, str] = {}
        for j in self.jumps:
            if now - seconds < j.t1 <= now:
                out.update(j.counts)
        return out or None

    def clean(self, buckets: Iterable) -> list:
        """The completed buckets that hold no implausible interval (a learner learns from those only)."""
        if not self.jumps:
            return list(buckets)
        return [b for b in buckets if not any(b.t0 < j.t1 <= b.t1 for j in self.jumps)]  # t1 in (t0, t1]
