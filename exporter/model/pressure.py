"""Per-server KV-pressure learners (methods.md s10): the threshold located from the server's own history, the
low-pressure reference share, and the regime flag with hysteresis on the p95's interval, each with the evidence
it rests on and a state ``known`` / ``provisional`` / ``unknown`` with a reason.

Every completed bucket of a fixed grid (``threshold_window``, 1 minute by default: the shared monotonic clock's
``k * W``, as the repeat windows), at least 80 % covered and serving >= 100 prompt tokens (or preempting),
becomes one ``PressurePoint`` (its KV p95 with the order-statistic interval, its KV max, preemptions per minute,
the tax against the reference in force and the reference's spread as its noise), unless its preemption count
is implausible for the window (``plausible_preemptions``: a counter glitch is no evidence). A window pressured
by preemptions alone weighs ``preemptions / SUSTAINED_PREEMPTIONS`` (at most 1): one preemption is a third of
a window of evidence. The last ``threshold_history`` of points are kept; ``derive.threshold.locate_why`` runs
when a point is added (the points only change then).

The same bucket then teaches the reference share (``LowPressureReference``) only on positive signs of no
pressure (``quiet``): no preemption, nobody waiting for KV, KV max under ``LOW_PRESSURE_MAX``, p95 under both
``LOW_PRESSURE_P95`` and the threshold in force less ``REFERENCE_MARGIN``, no tax against the reference so far.
The reference is ``known`` from ``REFERENCE_KNOWN_WINDOWS`` such windows; a server first seen under load has
none, and its tax is unknown with the reason.

Where vLLM exports its KV-block residency histograms (``--kv-cache-metrics``), each window also carries the
engine's own, history-free evidence (derive/residency.py, methods.md s11): ``pressure`` makes the window
pressured even with no preemption and no reference, and keeps it from teaching the reference; ``low_pressure``
is a positive sign of no pressure that stands in for the absolute KV-usage levels (LOW_PRESSURE_P95 and
LOW_PRESSURE_MAX are proxies for "nothing the workload reuses was evicted", which the histograms measure).
Signals that disagree are stated in the reasons (the tax's, the regime's).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass, replace
from typing import Iterable

from exporter import rules
from exporter.derive import pressure, recompute, residency
from exporter.derive.threshold import (LOW_PRESSURE_MAX, Evidence, LocatedThreshold, PressurePoint, classify,
                                       locate, locate_why, plural, quantile_bounds, taxed)
from exporter.store import WindowAggregate
from exporter.model import epoch as epochs

log = logging.getLogger("kvwatt.pressure")

REFERENCE_MARGIN = 0.05     # a learning window's p95 stays this far under the threshold in force
LOW_PRESSURE_P95 = 0.50     # ... and under this absolute KV p95 (methods.md s10: below every onset seen)
# LOW_PRESSURE_MAX (derive/threshold.py): ... and its KV max under this (a window that touched 80 % came near
# preempting)
REFERENCE_KNOWN_WINDOWS = 3  # low-pressure windows before the reference is known (fewer: provisional)
SUSTAINED_PREEMPTIONS = 3.0  # preemptions in a window that make it a full window of pressure evidence
MAX_EVIDENCE_WEIGHT = 1.0   # a full window's weight: no window, live or stored, weighs more
MAX_STEPS_PER_SECOND = 1000.0  # engine steps per second when the engine does not count them (1 ms a step)
MIN_PROMPT_TOKENS = 100.0   # fewer prompt tokens in a window: its share is not worth a point or a sample
MIN_COVERED = 0.8           # a bucket less covered than this is not a window of evidence
MIN_BELOW_COVERAGE = 0.5    # a regime window less covered than this cannot say "below" (start, restart)
CAPACITY_SUSTAINED = 0.5    # requests waited for KV capacity in this share of a window's samples: known pressure
QUIET_KNOWN_WINDOWS = 3     # consecutive clean evidence windows before a "below" is known (methods.md s10)
MAX_EVIDENCE_WINDOWS = 10_000  # bounds memory and the sort in locate whatever history / window asks


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

    def limit(self, residency_low: bool = False) -> float:
        """The highest p95 a reference window may have under the threshold in force; a window the engine's
        residency record shows low-pressure is held to the threshold-relative margin only (module docstring)."""
        relative = self.threshold - REFERENCE_MARGIN
        return relative if residency_low else min(relative, LOW_PRESSURE_P95)

    def eligible(self) -> list[ReferenceSample]:
        return [s for s in self.samples if s.p95 <= self.limit(s.residency_low)]

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

    def offer(self, point: PressurePoint, share: float | None, quiet: bool, t: float,
              wall: float | None = None) -> bool:
        """Learn the window when it is truly low pressure (module docstring); True when learned."""
        low = point.residency == "low_pressure"
        if share is None or not quiet or taxed(point) or point.kv_p95 > self.limit(low):
            return False
        self.samples.append(ReferenceSample(share, point.kv_p95, t, wall, low))
        self.changed = True
        return True

    def restore(self, samples: Iterable[ReferenceSample]) -> None:
        for s in samples:
            self.samples.append(s)

    def set_aside(self) -> None:
        if self.samples:
            self.samples.clear()
            self.changed = True

    def judgement(self, points: Iterable[PressurePoint]) -> tuple[str, str]:
        """(state, reason) of the reference share, and so of the tax resting on it (methods.md s10)."""
        if self.configured is not None:
            return "known", f"configured for this server: {self.configured:g}"
        good = self.eligible()
        if len(good) >= REFERENCE_KNOWN_WINDOWS:
            return "known", (f"median of {len(good)} low-pressure windows{_span(good)} (p95 <= {self.limit():.2f}, "
                             "no preemption)")
        if good:
            return "provisional", (f"{len(good)} low-pressure window{'s' if len(good) > 1 else ''}{_span(good)} "
                                   f"({REFERENCE_KNOWN_WINDOWS} needed before it is known)")
        return "unknown", no_reference_reason(list(points), self.limit())


def _span(samples: list[ReferenceSample]) -> str:
    walls = [s.wall for s in samples if s.wall is not None]
    return f" over {(max(walls) - min(walls)) / 60.0:.0f} min" if len(walls) > 1 else ""


def no_reference_reason(points: list[PressurePoint], limit: float) -> str:
    if not points:
        return "no low-pressure window seen yet: no evidence window completed"
    lowest = min(p.kv_p95 for p in points)
    if lowest > limit:
        floor = math.floor(lowest * 100) / 100  # ">= 0.87" for 0.876: never rounded above what was seen
        return f"no low-pressure window seen yet: {plural(len(points), 'window')}, all with p95 >= {floor:.2f}"
    return (f"no low-pressure window seen yet: {plural(len(points), 'window')}; those with p95 <= {limit:.2f} preempted, "
            f"had requests waiting for KV, touched KV usage >= {LOW_PRESSURE_MAX:.2f} or paid a tax")


@dataclass(frozen=True)
class ResidencySign:
    """A window's KV-block residency evidence (derive/residency.py, methods.md s11) and whether the engine
    exports the histograms at all (without them the evidence is unknown for want of ``--kv-cache-metrics``)."""

    kind: str | None  # "pressure" | "low_pressure" | None
    reason: str
    histograms: bool


def residency_sign(agg: WindowAggregate, block_size: float | None, sample_share: float,
                   p99_tool_latency_seconds: float) -> ResidencySign:
    r = residency.window_residency(agg, block_size, sample_share, p99_tool_latency_seconds)
    ev = residency.residency_evidence(r)
    return ResidencySign(ev.kind, ev.reason, r.sampled_evictions is not None)


def disagreement(sign: ResidencySign | None, preemptions_per_minute: float | None, taxed_: bool,
                 tax_known: bool = True) -> str:
    """Words for a window whose residency evidence contradicts its other signals; "" when they agree (an unknown
    tax, with no reference yet, contradicts nothing)."""
    if sign is None or sign.kind is None:
        return ""
    if sign.kind == "pressure" and not preemptions_per_minute and tax_known and not taxed_:
        return (f"the engine's KV-block residency shows pressure ({sign.reason}) in a window with no preemption "
                "and no tax above noise: counted pressured")
    if sign.kind == "low_pressure" and (preemptions_per_minute or taxed_):
        seen = f"{preemptions_per_minute:.1f} preemptions/min" if preemptions_per_minute else "a tax above noise"
        return (f"the engine's KV-block residency shows low pressure ({sign.reason}) in a window with {seen}: "
                "counted pressured")
    return ""


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


def regime(p: P95, threshold: float, previous: bool | None, covered_ratio: float = 1.0) -> bool | None:
    """Above (True) only when the p95's lower bound clears the threshold, below (False) only when its upper
    bound is under it; in between the previous regime holds (hysteresis: no flip on sampling noise). With no
    previous regime the point estimate decides (pressure.above_threshold). "Below" also needs the window at
    least MIN_BELOW_COVERAGE covered: the few samples right after kvwatt starts (or restarts beside a busy
    engine) cannot rule pressure out, so the previous regime holds, or none (unknown) after a start."""
    if p.value is None:
        return None
    if p.low > threshold:
        return True
    if p.high <= threshold:
        return False if covered_ratio >= MIN_BELOW_COVERAGE or previous is False else previous
    if covered_ratio < MIN_BELOW_COVERAGE and previous is None and not pressure.above_threshold(p.value, threshold):
        return None
    return previous if previous is not None else pressure.above_threshold(p.value, threshold)


def plausible_preemptions(agg: WindowAggregate) -> float:
    """The most preemptions a window can hold: each engine step can preempt at most the requests there are
    (running + waiting, at least 1), and there are at most the steps the engine counted (else
    MAX_STEPS_PER_SECOND over the covered seconds). A counter that jumps past it is a glitch, not evidence."""
    requests = max((agg.gauge_max("running") or 0.0) + (agg.gauge_max("waiting") or 0.0), 1.0)
    steps = agg.delta("engine_steps")
    if not steps:
        steps = MAX_STEPS_PER_SECOND * agg.covered_seconds
    return requests * steps


def quiet(agg: WindowAggregate, p: P95, residency_kind: str | None = None) -> bool:
    """Positive signs of no pressure in a window (the threshold-relative test is the reference's): preemptions
    counted and zero, no residency evidence of pressure, KV max under LOW_PRESSURE_MAX (waived when the engine's
    residency record says low pressure: it measures what the level stands in for), nobody waiting for KV
    (waiting_capacity where the engine tells, else no request waiting for most of the window)."""
    if agg.delta("preemptions") != 0 or p.value is None or residency_kind == "pressure":
        return False
    kv_max = agg.gauge_max("kv_usage")
    if kv_max is None or (kv_max >= LOW_PRESSURE_MAX and residency_kind != "low_pressure"):
        return False
    if agg.gauge_count("waiting_capacity"):
        return not agg.gauge_max("waiting_capacity")
    return not agg.quantile("waiting", 0.5)


def evidence_weight(preemptions: float | None, taxed_: bool, capacity_share: float | None = None) -> float:
    """A window pressured only by preemptions weighs count / SUSTAINED_PREEMPTIONS (at most 1), one pressured
    only by requests waiting for KV capacity the share of its samples that had one (weighted by how much of it
    waited), the larger of the two when both; one with a tax or the engine's residency evidence of pressure
    (``taxed_`` true for either), or with neither, is a full window."""
    if taxed_ or not (preemptions or capacity_share):
        return MAX_EVIDENCE_WEIGHT
    by_preemptions = min(MAX_EVIDENCE_WEIGHT, preemptions / SUSTAINED_PREEMPTIONS) if preemptions else 0.0
    return max(by_preemptions, min(MAX_EVIDENCE_WEIGHT, capacity_share or 0.0))


class ThresholdLearner:
    """The evidence windows of one server in its current epoch, its located threshold (with why it is or is
    not located), and the reference share learned alongside."""

    def __init__(self, width_seconds: float, keep_windows: int, min_windows: int, onset_per_minute: float,
                 configured_threshold: float, use_located: bool, reference: LowPressureReference,
                 name: str = "", sample_share: float = residency.DEFAULT_SAMPLE_SHARE,
                 p99_tool_latency_seconds: float = rules.P99_TOOL_LATENCY.default) -> None:
        self.name = name  # the server's, for the log
        self.sample_share = sample_share  # vLLM's --kv-cache-metrics-sample (servers[].kv_cache_metrics_sample)
        self.p99_tool_latency_seconds = p99_tool_latency_seconds
        self.block_size: float | None = None  # from the engine's info (engine_facts)
        self.residency: ResidencySign | None = None  # the last covered window's residency evidence
        self.disagreement = ""  # its contradiction with the window's other signals, in words
        self.width = width_seconds
        self.points: deque[PressurePoint] = deque(maxlen=min(keep_windows, MAX_EVIDENCE_WINDOWS))
        self.min_windows = min_windows
        self.onset = onset_per_minute
        self.configured = configured_threshold
        self.use_located = use_located
        self.reference = reference
        self.located: LocatedThreshold | None = None
        self.why_not = "no evidence window completed yet"  # why there is no located threshold
        self.last_t1: float = -math.inf
        self.rejected = 0          # windows refused as evidence this run (implausible counters)
        self.epoch = epochs.Epoch()
        self.changed = False       # evidence added or set aside since the owner last persisted
        self.epochs_set_aside = 0  # new epochs this run: the owner sets its own learned figures aside with them
        self.quiet_streak = 0      # the newest evidence windows, all clean (_count_quiet_streak)
        self._evidence: tuple | None = None  # evidence() as of what it read (and the points it named by id)
        reference.threshold = configured_threshold

    @property
    def threshold(self) -> float:
        """The threshold in force: the located one when asked for and found, else the configured one."""
        return self.located.ratio if self.use_located and self.located is not None else self.configured

    @property
    def source(self) -> str:
        return "located" if self.use_located and self.located is not None else "configured"

    @property
    def history_seconds(self) -> float:
        return self.width * (self.points.maxlen or 0)

    # --- epochs and persistence ------------------------------------------------------------------------
    def engine_facts(self, info, wall: float | None) -> None:
        """Compare the reading's engine facts with the epoch's: a change sets the evidence aside (logged once)."""
        facts = epochs.facts_of(info)
        self.block_size = getattr(info, "block_size", None) or self.block_size
        if self.epoch.started_wall is None:  # first reading of this run, no stored epoch
            self.epoch = epochs.Epoch(wall, "first reading", facts)
            self.changed = True
            return
        changed = epochs.changes(self.epoch.facts, facts)
        if changed:
            self.new_epoch("engine changed: " + "; ".join(changed), facts, wall)
        elif any(k not in self.epoch.facts for k in facts):
            self.epoch = epochs.Epoch(self.epoch.started_wall, self.epoch.cause, {**self.epoch.facts, **facts})
            self.changed = True

    def new_epoch(self, cause: str, facts, wall: float | None) -> None:
        log.warning("%s: %s; %d evidence windows and %d reference windows set aside (a new evidence epoch)",
                    self.name, cause, len(self.points), len(self.reference.samples))
        self.points.clear()
        self.reference.set_aside()
        self.epoch = epochs.Epoch(wall, cause, dict(facts))
        self.epochs_set_aside += 1
        self.changed = True
        self._relocate()

    def restore(self, epoch: epochs.Epoch, points: Iterable[PressurePoint]) -> None:
        """The stored epoch and its windows (oldest first); located again at once."""
        self.epoch = epoch
        self.points.extend(points)
        self._relocate()

    # --- learning --------------------------------------------------------------------------------------
    def observe(self, buckets: Iterable, wall: float | None = None) -> bool:
        """Feed the completed buckets not seen yet (store.Bucket: t0, t1, agg). True when a point was added."""
        added = False
        for b in buckets:
            if b.t1 <= self.last_t1:
                continue
            self.last_t1 = b.t1
            added |= self._bucket(b.agg, b.t1, wall)
        if added:
            self.changed = True
            self._relocate()
        return added

    def _relocate(self) -> None:
        before = self.located
        args = (self.points, self.min_windows, 2.0, self.onset)
        self.located = locate(*args)  # catalog: the located families' where
        self.quiet_streak = self._count_quiet_streak()
        self.why_not = "" if self.located is not None else locate_why(*args)[1]
        self.reference.threshold = self.threshold
        self._log_change(before)

    def _log_change(self, before: LocatedThreshold | None) -> None:
        """One line when a threshold is first located, lost, or its method changes (not as it moves)."""
        now = self.located
        if (before is None) == (now is None) and (now is None or now.method == before.method):
            return
        if now is None:
            log.info("%s: located KV-pressure threshold lost (%s); regime on %.3f (%s)", self.name, self.why_not,
                     self.threshold, self.source)
        else:
            log.info("%s: KV-pressure threshold located at p95 %.3f [%.3f, %.3f] (%s, %d windows, %s); regime on "
                     "%.3f (%s)", self.name, now.ratio, now.low, now.high, now.method, now.points, now.state,
                     self.threshold, self.source)

    def _bucket(self, agg: WindowAggregate, t1: float, wall: float | None) -> bool:
        if agg.covered_seconds < MIN_COVERED * self.width:
            return False
        sign = self.residency = self.residency_of(agg)
        p = p95_of(agg)
        preemptions = agg.delta("preemptions")
        if preemptions and preemptions > plausible_preemptions(agg):
            self.rejected += 1
            log.warning("%s: %g preemptions in one %gs window is implausible (at most %g); not evidence",
                        self.name, preemptions, self.width, plausible_preemptions(agg))
            return False
        per_second = pressure.rate_per_second(agg, "preemptions")
        counts = recompute.token_counts(agg)
        shares = recompute.token_shares(counts) if counts and sum(counts.values()) >= MIN_PROMPT_TOKENS else None
        share = shares["local_compute"] if shares else None
        if p.value is None or (share is None and not per_second):
            return False  # a window that served (almost) nothing shows no pressure either way
        capacity = pressure.waiting_for_capacity(agg)
        point = PressurePoint(p.value, None if per_second is None else per_second * 60.0,
                              recompute.recompute_tax(share, self.reference.value), self.reference.spread,
                              1.0, p.low, p.high, t1, wall, agg.gauge_max("kv_usage"), sign.kind,
                              None if capacity is None else capacity.share)
        point = _weighted(point, preemptions)
        self.disagreement = disagreement(sign, point.preemptions_per_minute, taxed(point), point.tax is not None)
        self.points.append(point)
        self.reference.offer(point, share, quiet(agg, p, sign.kind), t1, wall)
        return True

    def residency_of(self, agg: WindowAggregate) -> ResidencySign:
        return residency_sign(agg, self.block_size, self.sample_share, self.p99_tool_latency_seconds)

    # --- judgement -------------------------------------------------------------------------------------
    def evidence(self) -> Evidence:
        """What the evidence windows show; read every tick, recounted only when what it reads changed (a window
        added or dropped, a rejection, the reference's limits): the points are up to threshold_history of them."""
        pts, ref = self.points, self.reference
        ends = (pts[0], pts[-1]) if pts else ()
        read = (len(pts), *map(id, ends), self.rejected, self.quiet_streak, self.onset, ref.limit(False),
                ref.limit(True))  # the points by identity: held below, so an id is not reused meanwhile
        if self._evidence is None or self._evidence[0] != read:
            self._evidence = (read, self._count_evidence(), ends)
        return self._evidence[1]

    def _count_evidence(self) -> Evidence:
        kinds = [classify(p, self.onset) for p in self.points]
        walls = [p.wall for p in self.points if p.wall is not None]
        return Evidence(len(self.points), kinds.count(False), kinds.count(True), kinds.count(None), self.rejected,
                        (max(walls) - min(walls)) if walls else 0.0, min(walls, default=None),
                        max(walls, default=None), sum(1 for p in self.points if self._low_pressure(p)),
                        self.quiet_streak)

    def _count_quiet_streak(self) -> int:
        """The newest evidence windows that were all clean (positive signs of low pressure), counted back from
        the last one: how long the server has shown low pressure (a "below" is known from QUIET_KNOWN_WINDOWS)."""
        n = 0
        for p in reversed(self.points):
            if classify(p, self.onset) is not False:
                break
            n += 1
        return n

    def _low_pressure(self, p: PressurePoint) -> bool:
        """A held window with positive signs of no pressure (the reference's candidates; ``quiet``)."""
        low = p.residency == "low_pressure"
        return (p.kv_p95 <= self.reference.limit(low) and not p.preemptions_per_minute and p.residency != "pressure"
                and (low or p.kv_max is None or p.kv_max < LOW_PRESSURE_MAX))

    def judgement(self) -> tuple[str, str]:
        """(state, reason) of the located threshold; unknown when none is located."""
        if self.located is None:
            return "unknown", f"not located: {self.why_not}"
        return self.located.state, self.located.reason


    def tax_judgement(self, reference_state: str, reference_reason: str) -> tuple[str, str]:
        """(state, reason) of the tax: the reference's (it rests on it), told what the engine's residency record
        says meanwhile (methods.md s11): with no reference, pressure it shows is known now, its size is not;
        without the histograms, how to know now; a contradiction in the last window is stated."""
        sign, state, reason = self.residency, reference_state, reference_reason
        if sign is not None and state == "unknown":
            if not sign.histograms:
                reason += "; start vLLM with --kv-cache-metrics to know now whether it is under pressure"
            elif sign.kind == "pressure":
                reason = (f"pressure known from the engine's KV-block residency ({sign.reason}); the tax's size "
                          f"needs a low-pressure reference: {reference_reason}")
            elif sign.kind == "low_pressure":
                reason += f"; the engine's KV-block residency shows low pressure ({sign.reason})"
        if self.disagreement:
            reason += f"; {self.disagreement}"
        return state, reason


def _weighted(point: PressurePoint, preemptions: float | None) -> PressurePoint:
    return replace(point, weight=evidence_weight(preemptions, taxed(point) or point.residency == "pressure",
                                                 point.capacity_share))


@dataclass(frozen=True)
class Signs:
    """What one window shows about KV pressure (methods.md s10, "The regime: evidence both ways")."""

    p: P95
    covered_ratio: float
    preemptions_per_minute: float | None  # None: not counted, or an implausible counter
    onset: bool | None                    # sustained preemptions over a window covered enough (methods.md s3)
    capacity: pressure.CapacityWait | None  # requests waiting for KV capacity; None: gauge not exported
    waiting_median: float | None          # requests waiting for any reason (without the capacity gauge)
    kv_max: float | None
    tax: float | None                     # against the reference in force (None: no reference)
    tax_spread: float | None              # the reference's spread: the tax's noise
    tax_state: str                        # the reference's state: the tax rests on it
    residency: ResidencySign | None


@dataclass(frozen=True)
class Verdict:
    above: bool | None  # True above, False below, None unknown
    state: str          # known | provisional | unknown
    reason: str


def _tax_point(g: Signs) -> PressurePoint:
    return PressurePoint(g.p.value or 0.0, None, g.tax, g.tax_spread)


def pressure_signs(g: Signs) -> list[tuple[str, bool]]:
    """(words, known) for every sign of pressure the window shows, whatever the threshold in use."""
    out = []
    if g.capacity is not None and g.capacity.share > 0:
        out.append((f"requests waiting for KV capacity in {g.capacity.share * 100:.0f} % of samples (mean "
                    f"{g.capacity.mean:.1f})", g.capacity.share >= CAPACITY_SUSTAINED))
    if g.preemptions_per_minute:
        out.append((f"{g.preemptions_per_minute:.1f} preemptions/min", bool(g.onset)))
    if taxed(_tax_point(g)):
        # known on a known reference over a window covered enough to call it sustained (as the onset, s3)
        out.append((f"a recompute tax of {g.tax * 100:+.1f} points",
                    g.tax_state == "known" and g.covered_ratio >= MIN_COVERED))
    if g.residency is not None and g.residency.kind == "pressure":
        out.append((f"the engine's KV-block residency shows pressure ({g.residency.reason})", True))
    return out


def low_pressure_signs(g: Signs, threshold: float) -> tuple[list[str], list[str], bool]:
    """(the positive signs of low pressure seen, what is missing for a "below", whether a sign rests on the
    engine's own record: a known tax, the residency evidence or the capacity gauge)."""
    seen, missing = [], []
    if g.preemptions_per_minute is None:
        missing.append("a preemption count")
    else:
        seen.append("no preemption")
    if g.capacity is not None:
        seen.append("no request waiting for KV capacity")
    elif g.waiting_median == 0:
        seen.append("no request waiting for most of the window")
    else:
        missing.append("requests waiting (the engine does not say for what)")
    levels = g.kv_max is not None and g.kv_max < min(LOW_PRESSURE_MAX, threshold - REFERENCE_MARGIN)
    if g.tax is not None:
        seen.append(f"a recompute tax of {g.tax * 100:+.1f} points, within noise")
    if g.residency is not None and g.residency.kind == "low_pressure":
        seen.append(f"the engine's KV-block residency shows low pressure ({g.residency.reason})")
    if levels:
        seen.append(f"KV max {g.kv_max * 100:.0f} %")
    if g.tax is None and not levels and not (g.residency and g.residency.kind == "low_pressure"):
        top = "unknown" if g.kv_max is None else f"{g.kv_max * 100:.0f} %"
        missing.append(f"a known recompute tax, the engine's KV-block residency, or a KV max under "
                       f"{min(LOW_PRESSURE_MAX, threshold - REFERENCE_MARGIN) * 100:.0f} % (it reached {top})")
    if g.covered_ratio < MIN_BELOW_COVERAGE:
        missing.append("a window at least half covered")
    engine_said = (g.capacity is not None or (g.tax is not None and g.tax_state == "known")
                   or bool(g.residency and g.residency.kind == "low_pressure"))
    return seen, missing, engine_said


def verdict(g: Signs, threshold: float, over: bool, quiet_streak: int) -> Verdict:
    """One window's regime on positive evidence both ways (methods.md s10): *above* on any sign of pressure
    (known when sustained: requests waiting for KV capacity in most samples, preemption onset, a tax above noise
    on a known reference, residency pressure), whatever the threshold in use; *below* only on positive signs of
    low pressure (known once the server showed them for QUIET_KNOWN_WINDOWS evidence windows and the KV p95 is
    not above the threshold in use); otherwise the threshold predicts (*above*, provisional, when the p95's lower
    bound clears it) or the regime is unknown, with what is missing. ``over``: the threshold's prediction (``regime``,
    with hysteresis on the p95's interval)."""
    if g.p.value is None:
        return Verdict(None, "unknown", "no KV usage sampled in the window")
    p95 = f"p95 {g.p.value:.3f}"
    seen = pressure_signs(g)
    if seen:
        known = any(k for _, k in seen)
        where = "" if over else f" at {p95}, under the threshold in use {threshold:.3f}"
        v = Verdict(True, "known" if known else "provisional", "above: " + "; ".join(w for w, _ in seen) + where)
        if g.residency is not None and g.residency.kind == "low_pressure":
            v = Verdict(True, "provisional" if v.state == "known" else v.state, v.reason +
                        f"; contradicted by the engine's KV-block residency: low pressure ({g.residency.reason})")
        return v
    low, missing, engine_said = low_pressure_signs(g, threshold)
    if not missing:
        why = "below: " + ", ".join(low)
        if over:
            return Verdict(False, "provisional", f"{why}; although {p95} is above the threshold in use "
                           f"{threshold:.3f}: the threshold predicts pressure the engine does not show")
        if quiet_streak >= QUIET_KNOWN_WINDOWS and engine_said:
            return Verdict(False, "known", f"{why}; low pressure for the last {plural(quiet_streak, 'evidence window')}")
        need = [] if engine_said else ["a known recompute tax, the engine's KV-block residency or its count of "
                                       "requests waiting for KV capacity"]
        if quiet_streak < QUIET_KNOWN_WINDOWS:
            need.append(f"{QUIET_KNOWN_WINDOWS} evidence windows of low pressure in a row "
                        f"({quiet_streak} so far)")
        return Verdict(False, "provisional", f"{why}; known with {' and '.join(need)}")
    if over:
        return Verdict(True, "provisional", f"above (predicted): {p95} is above the threshold in use "
                       f"{threshold:.3f}, the engine shows no sign of pressure yet; missing for a below: "
                       + "; ".join(missing))
    return Verdict(None, "unknown", "neither pressure nor low pressure shown: missing " + "; ".join(missing))
