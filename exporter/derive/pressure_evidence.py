"""One window's KV-pressure evidence (methods.md s10, "The regime: evidence both ways"): the one type every reader
of a window's pressure takes it from (the regime, the threshold learner and its points, the lab's run figures and
sweep conditions), and the one pure function that builds it from a window's aggregate, so every reader applies the
same rules (the preemption counter's glitch guard, derive/pressure.py ``plausible_preemptions``; the prompt-token
guard MIN_PROMPT_TOKENS). ``recorded_evidence`` is the only other way to one: a window's evidence read back from
the figures it was recorded as (a window in evidence-windows.json, a sweep condition's means over its runs), with
what the record does not hold unknown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from exporter import rules
from exporter.derive import pressure, recompute, residency
from exporter.store import WindowAggregate

MIN_PROMPT_TOKENS = 100.0   # fewer prompt tokens in a window: its share is not worth a point or a sample


@dataclass(frozen=True, slots=True)  # slots: one per evidence window held (up to 10,000 a server)
class P95:
    """A window's KV p95 with its order-statistic interval (``quantile_bounds``)."""

    value: float | None
    low: float | None
    high: float | None


def quantile_bounds(sorted_values: Sequence[float], q: float = 0.95,
                    z: float = 1.96) -> tuple[float, float] | None:
    """Distribution-free interval for the q-quantile of the population the sorted samples come from: the
    order statistics X_(l), X_(u) with ranks nq -/+ z*sqrt(nq(1-q)) (normal approximation to the binomial
    count of samples below the quantile; ~95 % for z = 1.96), clamped to the sample range. It assumes
    independent samples; 1 s samples of a slowly moving gauge are correlated, so it is a lower bound on the
    real uncertainty (methods.md s10)."""
    n = len(sorted_values)
    if n == 0:
        return None
    half = z * math.sqrt(n * q * (1 - q))
    lo = max(math.floor(n * q - half), 1)       # 1-based ranks
    hi = min(math.ceil(n * q + half) + 1, n)
    return sorted_values[lo - 1], sorted_values[hi - 1]


def p95_of(agg: WindowAggregate) -> P95:
    s = agg.sorted_gauge("kv_usage")
    bounds = quantile_bounds(s, 0.95)
    if bounds is None:
        return P95(None, None, None)
    return P95(pressure.kv_usage_quantile(agg, 0.95), bounds[0], bounds[1])


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


@dataclass(frozen=True, kw_only=True, slots=True)  # slots: one per evidence window held
class WindowEvidence:
    """What one window shows about KV pressure (methods.md s10): built only by ``window_evidence`` (from the
    window's aggregate) and ``recorded_evidence`` (from the figures it was recorded as)."""

    p95: P95
    covered_ratio: float | None             # covered seconds / the window's length (None: not recorded)
    preemptions: float | None               # the counter's increase as read (None: not counted, or not recorded)
    preemptions_plausible: bool             # False: the increase is a counter glitch (plausible_preemptions)
    preemptions_per_minute: float | None    # None: not counted, or an implausible counter
    onset: bool | None                      # sustained preemptions over a window covered enough (methods.md s3)
    capacity: pressure.CapacityWait | None  # requests waiting for KV capacity; None: gauge not exported
    waiting_median: float | None            # requests waiting for any reason (without the capacity gauge)
    kv_max: float | None
    local_compute_share: float | None       # share of prompt tokens computed (None: < MIN_PROMPT_TOKENS served,
                                            # or not recorded)
    tax: float | None                       # against the reference in force (None: no reference)
    tax_se: float | None                    # the reference's spread: the tax's noise
    tax_state: str                          # the reference's state: the tax rests on it
    residency: ResidencySign | None         # the engine's own eviction record (None: not read)

    @property
    def residency_kind(self) -> str | None:
        """"pressure" | "low_pressure" | None (unknown, not read, or no histograms): the residency evidence's
        verdict, as a window's record keeps it."""
        return None if self.residency is None else self.residency.kind

    @property
    def capacity_share(self) -> float | None:
        """Share of the samples with a request waiting for KV capacity (None: the engine does not export the
        gauge), as a window's record keeps it."""
        return None if self.capacity is None else self.capacity.share


def window_evidence(agg: WindowAggregate, *, window_seconds: float, reference_share: float | None = None,
                    reference_spread: float | None = None, tax_state: str = "unknown",
                    residency: ResidencySign | None = None,
                    onset_per_minute: float = rules.PREEMPTION_ONSET_PER_MINUTE.default) -> WindowEvidence:
    """A window's pressure evidence over ``window_seconds``: its KV p95 with the interval, its preemptions per
    minute (None where the counter's increase is implausible), onset, requests waiting (for KV capacity where the
    engine tells), KV max, its computed prompt share and the tax against the reference in force (the reference's
    spread its noise, its state what the tax rests on), and the residency sign read by the caller."""
    preemptions = agg.delta("preemptions")
    per_minute = pressure.preemptions_per_minute(agg)
    shares = recompute.judged_shares(agg, MIN_PROMPT_TOKENS)
    covered = agg.covered_seconds
    return WindowEvidence(
        p95=p95_of(agg), covered_ratio=covered / window_seconds if window_seconds > 0 else 0.0,
        preemptions=preemptions,
        preemptions_plausible=not (preemptions and preemptions > pressure.plausible_preemptions(agg)),
        preemptions_per_minute=per_minute,
        onset=pressure.preemption_onset(per_minute, covered, window_seconds, onset_per_minute),
        capacity=pressure.waiting_for_capacity(agg), waiting_median=agg.quantile("waiting", 0.5),
        kv_max=agg.gauge_max("kv_usage"), local_compute_share=shares["local_compute"] if shares else None,
        tax=recompute.window_tax(shares, reference_share), tax_se=reference_spread, tax_state=tax_state,
        residency=residency)


_RECORDED_SIGNS = {kind: ResidencySign(kind=kind, reason="", histograms=True) for kind in ("pressure", "low_pressure")}


def recorded_evidence(*, p95: float, p95_low: float | None = None, p95_high: float | None = None,
                      preemptions_per_minute: float | None, tax: float | None, tax_se: float | None,
                      kv_max: float | None = None, residency: str | None = None,
                      capacity_share: float | None = None) -> WindowEvidence:
    """A window's evidence from the figures it was recorded as: a held evidence window read back from
    evidence-windows.json (model/evidence_book.py), or a sweep condition's means over its runs (the lab's
    analysis.off_points; each run's figures came from ``window_evidence``). What the record does not hold is
    unknown: the coverage, the preemption count and onset, the capacity waits' mean, the requests waiting, the
    computed share, the reference's state and the residency's reason. Only windows that passed the glitch guard
    are recorded, so the preemptions are plausible; a residency kind was only ever read from the histograms."""
    sign = None if residency is None else _RECORDED_SIGNS[residency]
    wait = None if capacity_share is None else pressure.CapacityWait(mean=None, share=capacity_share, samples=None)
    return WindowEvidence(
        p95=P95(value=p95, low=p95_low, high=p95_high), covered_ratio=None, preemptions=None,
        preemptions_plausible=True, preemptions_per_minute=preemptions_per_minute, onset=None, capacity=wait,
        waiting_median=None, kv_max=kv_max, local_compute_share=None, tax=tax, tax_se=tax_se, tax_state="unknown",
        residency=sign)
