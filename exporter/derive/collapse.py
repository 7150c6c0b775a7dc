"""Throughput-collapse signature (methods.md s5).

With offloading on and a large buffer under extreme pressure, the study saw runs stall: GPU power fell to
near idle, output fell to a fraction, preemptions were exactly zero, requests stayed in flight. The signature
is the conjunction of five conditions, each also exported on its own:

  offload_enabled       the server offloads KV (from vllm:cache_config_info / offload series)
  zero_preemptions      no preemption over the recent window
  throughput_collapsed  generation tokens/s over the recent window < drop_ratio x the reference level
  power_near_idle       mean GPU power over the recent window <= near_idle_ratio x P_idle
  requests_pending      running + waiting > 0 at every sample of the recent window

Three-valued logic (unknown is never a fake zero): each condition is True, False or None (cannot tell: no
samples, no GPU energy or idle baseline, no history to compare with). The signature is True only when all
five are True, False as soon as one is False, else None (cannot be asserted or denied; ``reason`` says why).

Reference level (docs/offload.md "Collapse thresholds"): the 90th percentile of generation tokens/s over
non-overlapping recent-window-sized buckets in the ``reference_seconds`` before the recent window. A high
percentile, not the median, so idle stretches and light-traffic periods do not drag the working level down,
and not the maximum, so one burst does not set it. While the signature holds, the reference is latched
(``previous`` carries it), so a stall that outlasts the reference period stays flagged until throughput
recovers above drop_ratio x the latched level. Gaps in the samples are never counted as zero throughput.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from exporter.derive.pressure import quantile
from exporter.samples import Interval

CONDITIONS = ("offload_enabled", "zero_preemptions", "throughput_collapsed", "power_near_idle",
              "requests_pending")
MIN_COVERAGE_RATIO = 0.5  # a window (or reference bucket) needs samples over half its span to count
REFERENCE_QUANTILE = 0.9


@dataclass(frozen=True)
class CollapseThresholds:
    throughput_drop_ratio: float = 0.2      # Config.collapse_throughput_drop_ratio
    power_near_idle_ratio: float = 1.5     # Config.collapse_power_near_idle_ratio
    reference_seconds: float = 600.0        # Config.collapse_reference_seconds
    recent_seconds: float = 60.0            # the shortest configured window

    @classmethod
    def from_config(cls, cfg) -> "CollapseThresholds":
        return cls(cfg.collapse_throughput_drop_ratio, cfg.collapse_power_near_idle_ratio,
                   cfg.collapse_reference_seconds, min(cfg.windows_seconds))


@dataclass(frozen=True)
class CollapseResult:
    conditions: dict[str, bool | None]
    signature: bool | None
    reason: str
    recent_tokens_per_second: float | None = None
    reference_tokens_per_second: float | None = None
    gpu_power_watts: float | None = None
    gpu_idle_power_watts: float | None = None
    details: dict[str, str] = field(default_factory=dict)  # condition -> why it is None

    def as_status(self) -> dict:
        """JSON-ready summary for /api/status."""
        return {"signature": self.signature, "reason": self.reason, "conditions": dict(self.conditions),
                "recent_tokens_per_second": self.recent_tokens_per_second,
                "reference_tokens_per_second": self.reference_tokens_per_second,
                "gpu_power_watts": self.gpu_power_watts, "gpu_idle_power_watts": self.gpu_idle_power_watts}


def kleene_and(values: Sequence[bool | None]) -> bool | None:
    if any(v is False for v in values):
        return False
    if all(v is True for v in values):
        return True
    return None


def _in_span(intervals: Sequence[Interval], start: float, end: float) -> list[Interval]:
    """Intervals whose end falls in (start, end]: each interval belongs to exactly one span."""
    return [iv for iv in intervals if start < iv.t1 <= end]


def _covered(intervals: Sequence[Interval], key: str | None = None) -> float:
    return sum(iv.seconds for iv in intervals if key is None or key in iv.deltas)


def generation_rate(intervals: Sequence[Interval], span_seconds: float) -> float | None:
    """Generated tokens/s over the covered part of a span; None below MIN_COVERAGE_RATIO coverage."""
    covered = _covered(intervals, "generation_tokens")
    if covered < MIN_COVERAGE_RATIO * span_seconds or covered <= 0:
        return None
    return sum(iv.deltas["generation_tokens"] for iv in intervals if "generation_tokens" in iv.deltas) / covered


def reference_rate(intervals: Sequence[Interval], now: float, th: CollapseThresholds) -> float | None:
    """REFERENCE_QUANTILE of bucket rates over the reference period before the recent window."""
    end = now - th.recent_seconds
    rates = []
    k = 0
    while (k + 1) * th.recent_seconds <= th.reference_seconds + 1e-9:
        hi = end - k * th.recent_seconds
        r = generation_rate(_in_span(intervals, hi - th.recent_seconds, hi), th.recent_seconds)
        if r is not None:
            rates.append(r)
        k += 1
    return quantile(rates, REFERENCE_QUANTILE)


def mean_power(intervals: Sequence[Interval], scope: str = "gpu") -> tuple[float | None, float | None]:
    """(mean power, mean idle power) in W over the intervals carrying both energy and idle energy."""
    both = [iv for iv in intervals if scope in iv.energy_joules and scope in iv.idle_joules]
    secs = sum(iv.seconds for iv in both)
    if secs <= 0:
        return None, None
    return (sum(iv.energy_joules[scope] for iv in both) / secs, sum(iv.idle_joules[scope] for iv in both) / secs)


def evaluate(intervals: Sequence[Interval], now: float, offload_enabled: bool | None,
             th: CollapseThresholds = CollapseThresholds(), previous: CollapseResult | None = None) -> CollapseResult:
    """Evaluate the signature at time ``now`` from one server's intervals (oldest first, any length).

    ``previous`` is this function's last result for the same server (latches the reference level while
    the signature holds). Pure: no state outside the arguments.
    """
    recent = _in_span(intervals, now - th.recent_seconds, now)
    details: dict[str, str] = {}
    cond: dict[str, bool | None] = dict.fromkeys(CONDITIONS)
    cond["offload_enabled"] = offload_enabled
    if offload_enabled is None:
        details["offload_enabled"] = "cannot tell whether the server offloads (no cache_config_info)"

    enough = _covered(recent) >= MIN_COVERAGE_RATIO * th.recent_seconds
    # zero preemptions over the window
    if not enough or _covered(recent, "preemptions") < MIN_COVERAGE_RATIO * th.recent_seconds:
        details["zero_preemptions"] = "not enough samples in the recent window"
    else:
        cond["zero_preemptions"] = sum(iv.deltas.get("preemptions", 0.0) for iv in recent) == 0

    # throughput against its own reference (latched while the signature holds)
    rate = generation_rate(recent, th.recent_seconds)
    ref = reference_rate(intervals, now, th)
    if previous is not None and previous.signature and previous.reference_tokens_per_second is not None:
        ref = max(ref or 0.0, previous.reference_tokens_per_second)
    if rate is None:
        details["throughput_collapsed"] = "not enough samples in the recent window"
    elif ref is None:
        details["throughput_collapsed"] = "no reference level yet (needs history before the recent window)"
    else:
        cond["throughput_collapsed"] = ref > 0 and rate < th.throughput_drop_ratio * ref

    # GPU power near its idle baseline
    power, idle = mean_power(recent)
    if power is None or idle is None or idle <= 0:
        details["power_near_idle"] = "no GPU energy or no idle baseline for this server's GPUs"
        power = idle = None
    elif _covered([iv for iv in recent if "gpu" in iv.energy_joules]) < MIN_COVERAGE_RATIO * th.recent_seconds:
        details["power_near_idle"] = "GPU energy covers less than half of the recent window"
    else:
        cond["power_near_idle"] = power <= th.power_near_idle_ratio * idle

    # requests still in flight at every sample
    pending = [iv.gauges["running"] + iv.gauges["waiting"] for iv in recent
               if "running" in iv.gauges and "waiting" in iv.gauges]
    if not enough or not pending:
        details["requests_pending"] = "not enough samples in the recent window"
    else:
        cond["requests_pending"] = min(pending) > 0

    sig = kleene_and(list(cond.values()))
    if sig is None:
        unknown = [c for c in CONDITIONS if cond[c] is None]
        reason = "unknown: " + "; ".join(f"{c} ({details.get(c, 'unknown')})" for c in unknown)
    elif sig:
        reason = "all five conditions hold"
    else:
        reason = "not holding: " + ", ".join(c for c in CONDITIONS if cond[c] is False)
    return CollapseResult(cond, sig, reason, rate, ref, power, idle, details)
