"""The low-pressure reference share (methods.md s10): learned from windows with positive signs of no pressure,
known from REFERENCE_KNOWN_WINDOWS of them; the recompute tax rests on it."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Iterable

from exporter.derive.threshold import LOW_PRESSURE_MAX, PressurePoint, plural, taxed
from exporter.model.pressure.regime_signs import LOW_PRESSURE_P95, REFERENCE_KNOWN_WINDOWS, REFERENCE_MARGIN


@dataclass(frozen=True)
class ReferenceSample:
    share: float          # local_compute share of the window
    p95: float            # its KV p95 (the point estimate: at low load the upper bound is near the max)
    t: float              # monotonic end of the window (this run); persisted ones carry the wall clock instead
    wall: float | None = None
    residency_low: bool = False  # the engine's residency evidence said low pressure: no absolute p95 cap


class LowPressureReference:
    """The local_compute share of the same server under true low pressure: the median of the last ``keep``
    quiet windows still well under the threshold in force (a threshold located later re-filters them), unless
    configured. ``spread`` (their standard deviation) is the noise of one window's tax."""

    def __init__(self, configured: float | None = None, keep: int = 20) -> None:
        self.configured = configured
        self.samples: deque[ReferenceSample] = deque(maxlen=keep)
        self.threshold = math.inf  # the threshold in force, set by the learner before each use
        self.changed = False       # a sample was added (or the samples set aside) since the owner persisted
        # the eligible samples and their median and spread, read several times a tick per server (the spread's
        # statistics.stdev is exact, in fractions): kept until a sample or the threshold in force changes
        self._version = 0
        self._cached: tuple | None = None

    def limit(self, residency_low: bool = False) -> float:
        """The highest p95 a reference window may have under the threshold in force; a window the engine's
        residency record shows low-pressure is held to the threshold-relative margin only (module docstring)."""
        relative = self.threshold - REFERENCE_MARGIN
        return relative if residency_low else min(relative, LOW_PRESSURE_P95)

    def _learned(self) -> tuple:
        """(eligible samples, their median share, their spread), recomputed only when a sample or the
        threshold in force changed since the last read."""
        key = (self._version, self.threshold)
        if self._cached is None or self._cached[0] != key:
            good = tuple(s for s in self.samples if s.p95 <= self.limit(s.residency_low))
            median = statistics.median(s.share for s in good) if good else None
            spread = statistics.stdev(s.share for s in good) if len(good) >= 3 else None
            self._cached = (key, good, median, spread)
        return self._cached[1:]

    @property
    def value(self) -> float | None:
        if self.configured is not None:
            return self.configured
        return self._learned()[1]

    @property
    def windows(self) -> int:
        return 0 if self.configured is not None else len(self._learned()[0])

    @property
    def spread(self) -> float | None:
        """Standard deviation of the learned windows' shares (>= 3 of them), else None (unknown noise)."""
        return self._learned()[2]

    @property
    def kind(self) -> str:
        return "configured" if self.configured is not None else ("learned" if self._learned()[0] else "none")

    def offer(self, point: PressurePoint, share: float | None, quiet: bool, t: float,
              wall: float | None = None) -> bool:
        """Learn the window when it is truly low pressure (module docstring); True when learned."""
        low = point.evidence.residency_kind == "low_pressure"
        if share is None or not quiet or taxed(point.evidence) or point.kv_p95 > self.limit(low):
            return False
        self.samples.append(ReferenceSample(share, point.kv_p95, t, wall, low))
        self.changed = True
        self._version += 1
        return True

    def restore(self, samples: Iterable[ReferenceSample]) -> None:
        for s in samples:
            self.samples.append(s)
        self._version += 1

    def set_aside(self) -> None:
        if self.samples:
            self.samples.clear()
            self.changed = True
            self._version += 1

    def judgement(self, points: Iterable[PressurePoint]) -> tuple[str, str]:
        """(state, reason) of the reference share, and so of the tax resting on it (methods.md s10)."""
        if self.configured is not None:
            return "known", f"configured for this server: {self.configured:g}"
        good = self._learned()[0]
        if len(good) >= REFERENCE_KNOWN_WINDOWS:
            return "known", (f"median of {len(good)} low-pressure windows{_span(good)} (p95 <= {self.limit():.2f}, "
                             "no preemption)")
        if good:
            return "provisional", (f"{len(good)} low-pressure window{'s' if len(good) > 1 else ''}{_span(good)} "
                                   f"({REFERENCE_KNOWN_WINDOWS} needed before it is known)")
        return "unknown", no_reference_reason(list(points), self.limit())


def _span(samples: list[ReferenceSample]) -> str:
    walls = [s.wall for s in samples if s.wall is not None]
    if len(walls) < 2:
        return ""
    span = max(walls) - min(walls)  # seconds under two minutes said in seconds: "over 0 min" said nothing
    return f" over {span:.0f} s" if span < 120 else f" over {span / 60.0:.0f} min"


def no_reference_reason(points: list[PressurePoint], limit: float) -> str:
    if not points:
        return "no low-pressure window seen yet: no evidence window completed"
    lowest = min(p.kv_p95 for p in points)
    if lowest > limit:
        floor = math.floor(lowest * 100) / 100  # ">= 0.87" for 0.876: never rounded above what was seen
        return f"no low-pressure window seen yet: {plural(len(points), 'window')}, all with p95 >= {floor:.2f}"
    return (f"no low-pressure window seen yet: {plural(len(points), 'window')}; those with p95 <= {limit:.2f} "
            "preempted, "
            f"had requests waiting for KV, touched KV usage >= {LOW_PRESSURE_MAX:.2f} or paid a tax")
