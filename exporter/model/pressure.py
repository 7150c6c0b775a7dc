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
from exporter.derive.threshold import (Evidence, LocatedThreshold, PressurePoint, classify, locate, locate_why,
                                       quantile_bounds, taxed)
from exporter.store import WindowAggregate
from exporter.model import epoch as epochs

log = logging.getLogger("kvwatt.pressure")

REFERENCE_MARGIN = 0.05     # a learning window's p95 stays this far under the threshold in force
LOW_PRESSURE_P95 = 0.50     # ... and under this absolute KV p95 (methods.md s10: below every onset seen)
LOW_PRESSURE_MAX = 0.80     # ... and its KV max under this (a window that touched 80 % came near preempting)
REFERENCE_KNOWN_WINDOWS = 3  # low-pressure windows before the reference is known (fewer: provisional)
SUSTAINED_PREEMPTIONS = 3.0  # preemptions in a window that make it a full window of pressure evidence
MAX_EVIDENCE_WEIGHT = 1.0   # a full window's weight: no window, live or stored, weighs more
MAX_STEPS_PER_SECOND = 1000.0  # engine steps per second when the engine does not count them (1 ms a step)
MIN_PROMPT_TOKENS = 100.0   # fewer prompt tokens in a window: its share is not worth a point or a sample
MIN_COVERED = 0.8           # a bucket less covered than this is not a window of evidence
MIN_BELOW_COVERAGE = 0.5    # a regime window less covered than this cannot say "below" (start, restart)
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
            return "known", f"configured reference_local_compute_share {self.configured:g}"
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
        return f"no low-pressure window seen yet: {len(points)} windows, all with p95 >= {floor:.2f}"
    return (f"no low-pressure window seen yet: {len(points)} windows; those with p95 <= {limit:.2f} preempted, "
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


def evidence_weight(preemptions: float | None, taxed_: bool) -> float:
    """A window pressured only by preemptions weighs count / SUSTAINED_PREEMPTIONS (at most 1); one with a tax
    or the engine's residency evidence of pressure (``taxed_`` true for either) is a full window."""
    if taxed_ or not preemptions:
        return MAX_EVIDENCE_WEIGHT
    return min(MAX_EVIDENCE_WEIGHT, preemptions / SUSTAINED_PREEMPTIONS)


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
        point = PressurePoint(p.value, None if per_second is None else per_second * 60.0,
                              recompute.recompute_tax(share, self.reference.value), self.reference.spread,
                              1.0, p.low, p.high, t1, wall, agg.gauge_max("kv_usage"), sign.kind)
        point = _weighted(point, preemptions)
        self.disagreement = disagreement(sign, point.preemptions_per_minute, taxed(point), point.tax is not None)
        self.points.append(point)
        self.reference.offer(point, share, quiet(agg, p, sign.kind), t1, wall)
        return True

    def residency_of(self, agg: WindowAggregate) -> ResidencySign:
        return residency_sign(agg, self.block_size, self.sample_share, self.p99_tool_latency_seconds)

    # --- judgement -------------------------------------------------------------------------------------
    def evidence(self) -> Evidence:
        kinds = [classify(p, self.onset) for p in self.points]
        walls = [p.wall for p in self.points if p.wall is not None]
        return Evidence(len(self.points), kinds.count(False), kinds.count(True), kinds.count(None), self.rejected,
                        (max(walls) - min(walls)) if walls else 0.0, min(walls, default=None),
                        max(walls, default=None), sum(1 for p in self.points if self._low_pressure(p)))

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
    return replace(point, weight=evidence_weight(preemptions, taxed(point) or point.residency == "pressure"))


def contradicted(flag: bool | None, per_minute: float | None, onset: bool | None, follow_evidence: bool,
                 residency_kind: str | None = None) -> bool | None:
    """Preemptions, or the engine's residency evidence of pressure (methods.md s11), under the threshold in force
    contradict a *below*. When the regime follows the evidence (source located), residency pressure and
    sustained preemptions (onset, methods.md s3) turn the flag *above*, fewer preemptions (or over a window not
    yet covered enough to call them sustained) make it unknown (None). With source configured the flag stays on
    the configured threshold as asked, and ``regime_judgement`` says the regime is unknown."""
    if flag is False and follow_evidence:
        if residency_kind == "pressure":
            return True  # history-free and volume-gated (>= MIN_EXPECTED_SAMPLES): sustained by construction
        if per_minute:
            return True if onset else None
    return flag


def regime_judgement(flag: bool | None, p: P95, threshold: float, per_minute: float | None, onset: bool | None,
                     learner: ThresholdLearner, sign: ResidencySign | None = None) -> tuple[str, str]:
    """(state, reason) of one window's regime (methods.md s10, s11 for the residency evidence)."""
    state, reason = _regime_judgement(flag, p, threshold, per_minute, onset, learner, sign)
    if flag and sign is not None and sign.kind == "low_pressure":
        # above on the KV level while the engine evicted (almost) nothing: said, and no more than provisional
        state = "provisional" if state == "known" else state
        reason += f"; contradicted by the engine's KV-block residency: low pressure ({sign.reason})"
    return state, reason


def _regime_judgement(flag: bool | None, p: P95, threshold: float, per_minute: float | None, onset: bool | None,
                      learner: ThresholdLearner, sign: ResidencySign | None) -> tuple[str, str]:
    under = p.value is not None and p.value <= threshold
    if per_minute and under:
        seen = f"{per_minute:.1f} preemptions/min at p95 {p.value:.3f}, under the threshold in use {threshold:.3f}"
        if flag and onset:
            return "known", f"above (onset): {seen}"
        if not flag:  # False (source configured) or None (too few preemptions to call it onset)
            return "unknown", f"contradicted: {seen}"
    if sign is not None and sign.kind == "pressure" and under:
        seen = (f"the engine's KV-block residency shows pressure ({sign.reason}) at p95 {p.value:.3f}, under the "
                f"threshold in use {threshold:.3f}")
        return ("known", f"above (KV-block residency): {seen}") if flag else ("unknown", f"contradicted: {seen}")
    if flag is None:
        if p.value is None:
            return "unknown", "no KV usage sampled in the window"
        return "unknown", "the window is not yet half covered: too few KV samples to call it below"
    if learner.source == "configured":
        if learner.use_located:
            return "provisional", f"on the configured threshold {threshold:.2f}: none located yet ({learner.why_not})"
        return "known", f"on the configured threshold {threshold:.2f} (kv_pressure_threshold_source: configured)"
    state, reason = learner.judgement()
    loc = learner.located
    return state, f"on the located threshold {loc.ratio:.3f} [{loc.low:.3f}, {loc.high:.3f}]: {reason}"
