"""Per-server KV-pressure learners (methods.md s10): the threshold located from the server's own history, the
low-pressure reference share, and the regime flag with hysteresis on the p95's interval.

Every completed bucket of a fixed grid (``threshold_window``, 1 minute by default: the shared monotonic clock's
``k * W``, as the repeat windows), at least 80 % covered and serving >= 100 prompt tokens (or preempting),
becomes one ``PressurePoint`` (its KV p95 with the order-statistic interval,
preemptions per minute, the tax against the reference in force and the reference's spread as its noise). The
last ``threshold_history`` of them are kept; ``derive.threshold.locate`` runs when a point is added (not every
tick: the points only change then).

The same bucket then teaches the reference share (``LowPressureReference``) when it is truly low pressure: no
preemption at all, no tax evidence against the current reference, and its p95 at least
``REFERENCE_MARGIN`` below the threshold in force. So the reference is there a minute after the first quiet
minute, and windows of preemption onset (on a real engine: share 0.751 against 0.724, p95 under a 0.90
threshold) never enter it.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Iterable

from exporter.derive import pressure, recompute
from exporter.derive.threshold import LocatedThreshold, PressurePoint, locate, quantile_bounds, taxed
from exporter.store import WindowAggregate

log = logging.getLogger("kvwatt.pressure")

REFERENCE_MARGIN = 0.05     # a learning window's p95 stays this far under the threshold in force
MIN_PROMPT_TOKENS = 100.0   # fewer prompt tokens in a window: its share is not worth a point or a sample
MIN_COVERED = 0.8           # a bucket less covered than this is not a window of evidence
MAX_EVIDENCE_WINDOWS = 10_000  # bounds memory and the sort in locate whatever history / window asks


@dataclass(frozen=True)
class ReferenceSample:
    share: float          # local_compute share of the window
    p95: float            # its KV p95 (the point estimate: at low load the upper bound is near the max)
    t: float              # monotonic end of the window (this run); persisted ones carry the wall clock instead
    wall: float | None = None


class LowPressureReference:
    """The local_compute share of the same server under true low pressure: the median of the last ``keep``
    clean windows still well under the threshold in force (a threshold located later re-filters them), unless
    configured. ``spread`` (their standard deviation) is the noise of one window's tax."""

    def __init__(self, configured: float | None = None, keep: int = 20) -> None:
        self.configured = configured
        self.samples: deque[ReferenceSample] = deque(maxlen=keep)
        self.threshold = math.inf  # the threshold in force, set by the learner before each use
        self.changed = False       # a sample was added since the owner last persisted

    def eligible(self) -> list[ReferenceSample]:
        return [s for s in self.samples if s.p95 <= self.threshold - REFERENCE_MARGIN]

    @property
    def value(self) -> float | None:
        if self.configured is not None:
            return self.configured
        good = self.eligible()
        return statistics.median(s.share for s in good) if good else None

    @property
    def windows(self) -> int:
        return 0 if self.configured is not None else len(self.eligible())

    @property
    def spread(self) -> float | None:
        """Standard deviation of the learned windows' shares (>= 3 of them), else None (unknown noise)."""
        good = self.eligible()
        return statistics.stdev(s.share for s in good) if len(good) >= 3 else None

    @property
    def kind(self) -> str:
        return "configured" if self.configured is not None else ("learned" if self.eligible() else "none")

    def offer(self, point: PressurePoint, preemptions: float | None, share: float | None, p95: float,
              t: float, wall: float | None = None) -> bool:
        """Learn the window when it is truly low pressure (module docstring); True when learned."""
        if share is None or (preemptions or 0.0) > 0 or taxed(point):
            return False
        if p95 > self.threshold - REFERENCE_MARGIN:
            return False
        self.samples.append(ReferenceSample(share, p95, t, wall))
        self.changed = True
        return True

    def restore(self, samples: Iterable[ReferenceSample]) -> None:
        for s in samples:
            self.samples.append(s)


@dataclass(frozen=True)
class P95:
    """A window's KV p95 with its order-statistic interval (derive.threshold.quantile_bounds)."""

    value: float | None
    low: float | None
    high: float | None


def p95_of(agg: WindowAggregate) -> P95:
    s = agg.sorted_gauge("kv_usage")
    bounds = quantile_bounds(s, 0.95)
    if bounds is None:
        return P95(None, None, None)
    return P95(pressure.kv_usage_quantile(agg, 0.95), bounds[0], bounds[1])


def regime(p: P95, threshold: float, previous: bool | None) -> bool | None:
    """Above (True) only when the p95's lower bound clears the threshold, below (False) only when its upper
    bound is under it; in between the previous regime holds (hysteresis: no flip on sampling noise). With no
    previous regime the point estimate decides (pressure.above_threshold)."""
    if p.value is None:
        return None
    if p.low > threshold:
        return True
    if p.high <= threshold:
        return False
    return previous if previous is not None else pressure.above_threshold(p.value, threshold)


class ThresholdLearner:
    """The points of one server, its located threshold, and the reference share learned alongside."""

    def __init__(self, width_seconds: float, keep_windows: int, min_windows: int, onset_per_minute: float,
                 configured_threshold: float, use_located: bool, reference: LowPressureReference,
                 name: str = "") -> None:
        self.name = name  # the server's, for the log
        self.width = width_seconds
        self.points: deque[PressurePoint] = deque(maxlen=min(keep_windows, MAX_EVIDENCE_WINDOWS))
        self.min_windows = min_windows
        self.onset = onset_per_minute
        self.configured = configured_threshold
        self.use_located = use_located
        self.reference = reference
        self.located: LocatedThreshold | None = None
        self.last_t1: float = -math.inf
        reference.threshold = configured_threshold

    @property
    def threshold(self) -> float:
        """The threshold in force: the located one when asked for and found, else the configured one."""
        return self.located.ratio if self.use_located and self.located is not None else self.configured

    @property
    def source(self) -> str:
        return "located" if self.use_located and self.located is not None else "configured"

    def observe(self, buckets: Iterable, wall: float | None = None) -> bool:
        """Feed the completed buckets not seen yet (store.Bucket: t0, t1, agg). True when a point was added."""
        added = False
        for b in buckets:
            if b.t1 <= self.last_t1:
                continue
            self.last_t1 = b.t1
            added |= self._bucket(b.agg, b.t1, wall)
        if added:
            before = self.located
            self.located = locate(self.points, self.min_windows, min_side=2.0, onset_per_minute=self.onset)
            self.reference.threshold = self.threshold
            self._log_change(before)
        return added

    def _log_change(self, before: LocatedThreshold | None) -> None:
        """One line when a threshold is first located, lost, or its method changes (not as it moves)."""
        now = self.located
        if (before is None) == (now is None) and (now is None or now.method == before.method):
            return
        if now is None:
            log.info("%s: located KV-pressure threshold lost (evidence aged out); regime on %.3f (%s)", self.name,
                     self.threshold, self.source)
        else:
            log.info("%s: KV-pressure threshold located at p95 %.3f [%.3f, %.3f] (%s, %d windows); regime on "
                     "%.3f (%s)", self.name, now.ratio, now.low, now.high, now.method, now.points, self.threshold,
                     self.source)

    def _bucket(self, agg: WindowAggregate, t1: float, wall: float | None) -> bool:
        if agg.covered_seconds < MIN_COVERED * self.width:
            return False
        p = p95_of(agg)
        per_second = pressure.rate_per_second(agg, "preemptions")
        counts = recompute.token_counts(agg)
        shares = recompute.token_shares(counts) if counts and sum(counts.values()) >= MIN_PROMPT_TOKENS else None
        share = shares["local_compute"] if shares else None
        if p.value is None or (share is None and not per_second):
            return False  # a window that served (almost) nothing shows no pressure either way
        point = PressurePoint(p.value, None if per_second is None else per_second * 60.0,
                              recompute.recompute_tax(share, self.reference.value), self.reference.spread,
                              1.0, p.low, p.high, t1)
        self.points.append(point)
        self.reference.offer(point, agg.delta("preemptions"), share, p.value, t1, wall)
        return True
