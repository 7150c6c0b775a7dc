"""The threshold learner (methods.md s10): one PressurePoint (the window's evidence, weighted and timed) per completed
evidence window, the threshold located from them, its state and the epoch the evidence belongs to."""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Iterable

from exporter import rules
from exporter.derive import residency
from exporter.derive.pressure import plausible_preemptions
from exporter.derive.pressure_evidence import WindowEvidence, window_evidence
from exporter.derive.threshold import (
    LOW_PRESSURE_MAX,
    LocatedThreshold,
    PressurePoint,
    classify,
    locate_why,
    taxed,
)
from exporter.model import epoch as epochs
from exporter.model.pressure.reference import LowPressureReference
from exporter.model.pressure.regime_signs import (
    MAX_EVIDENCE_WEIGHT,
    MAX_EVIDENCE_WINDOWS,
    SUSTAINED_PREEMPTIONS,
    ResidencySign,
    disagreement,
    quiet,
    residency_sign,
)
from exporter.results import Evidence
from exporter.store import WindowAggregate

log = logging.getLogger("kvwatt.pressure")


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

    @classmethod
    def for_server(cls, cfg, server, reference: LowPressureReference) -> "ThresholdLearner":
        """One server's learner as the configuration sets it (``cfg``: a Config, ``server``: its ServerConfig)."""
        return cls(width_seconds=cfg.threshold_window_seconds,
                   keep_windows=max(int(cfg.threshold_history_seconds // cfg.threshold_window_seconds), 1),
                   min_windows=cfg.threshold_min_windows, onset_per_minute=cfg.preemption_onset_per_minute,
                   configured_threshold=cfg.kv_pressure_threshold_ratio,
                   use_located=cfg.kv_pressure_threshold_source == "located", reference=reference,
                   name=server.name, sample_share=server.kv_cache_metrics_sample,
                   p99_tool_latency_seconds=cfg.p99_tool_latency_seconds)

    def __init__(self, *, width_seconds: float, keep_windows: int, min_windows: int, onset_per_minute: float,
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
        # the catalog's `computes` of the located families: the threshold, or None and why
        self.located, why = locate_why(self.points, self.min_windows, 2.0, self.onset)
        self.quiet_streak = self._count_quiet_streak()
        self.why_not = "" if self.located is not None else why
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
        if agg.covered_seconds < rules.SUSTAINED_MIN_COVERED.default * self.width:  # not evidence
            return False
        sign = self.residency = self.residency_of(agg)
        ev = window_evidence(agg, window_seconds=self.width, reference_share=self.reference.value,
                             reference_spread=self.reference.spread, residency=sign)
        if not ev.preemptions_plausible:
            self.rejected += 1
            log.warning("%s: %g preemptions in one %gs window is implausible (at most %g); not evidence",
                        self.name, ev.preemptions, self.width, plausible_preemptions(agg))
            return False
        if ev.p95.value is None or (ev.local_compute_share is None and not ev.preemptions_per_minute):
            return False  # a window that served (almost) nothing shows no pressure either way
        point = PressurePoint(evidence=ev, weight=_weight(ev), t=t1, wall=wall)
        self.disagreement = disagreement(sign, ev.preemptions_per_minute, taxed(ev), ev.tax is not None)
        self.points.append(point)
        self.reference.offer(point, ev.local_compute_share, quiet(agg, ev.p95, sign.kind), t1, wall)
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
        return Evidence(windows=len(self.points), clean=kinds.count(False), pressured=kinds.count(True),
                        unknown=kinds.count(None), rejected=self.rejected,
                        span_seconds=(max(walls) - min(walls)) if walls else 0.0, oldest_wall=min(walls, default=None),
                        newest_wall=max(walls, default=None),
                        low_pressure=sum(1 for p in self.points if self._low_pressure(p)),
                        quiet_streak=self.quiet_streak)

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
        ev = p.evidence
        low = ev.residency_kind == "low_pressure"
        return (p.kv_p95 <= self.reference.limit(low) and not ev.preemptions_per_minute
                and ev.residency_kind != "pressure" and (low or ev.kv_max is None or ev.kv_max < LOW_PRESSURE_MAX))

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


def _weight(ev: WindowEvidence) -> float:
    """The evidence behind a window (``evidence_weight``): its preemptions as counted, its tax or residency
    evidence of pressure, its share of samples with a request waiting for KV capacity."""
    return evidence_weight(ev.preemptions, taxed(ev) or ev.residency_kind == "pressure", ev.capacity_share)
