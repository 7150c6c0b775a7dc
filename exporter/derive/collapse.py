"""Throughput-collapse signature (methods.md s5).

With offloading on and a large buffer under extreme pressure, the study saw runs stall: GPU power fell to
near idle, output fell to a fraction, preemptions were exactly zero, requests stayed in flight. The classic
condition set is the conjunction of five conditions, each also exported on its own:

  offload_enabled       the server offloads KV (from vllm:cache_config_info / offload series)
  zero_preemptions      no preemption over the recent window
  throughput_collapsed  generation tokens/s over the recent window < drop_ratio x the reference level
  power_near_idle       mean GPU power over the recent window <= near_idle_ratio x P_idle
  requests_pending      running + waiting > 0 at every sample of the recent window

Three-valued logic (unknown is never a fake zero): each condition is True, False or None (cannot tell: no
samples, no GPU energy or idle baseline, no history to compare with). The classic set is True only when all
five are True, False as soon as one is False, else None (cannot be asserted or denied; ``reason`` says why).

Reference level (docs/offload.md "Collapse signature"): the 90th percentile of generation tokens/s over
non-overlapping recent-window-sized buckets in the ``reference_seconds`` before the recent window. The buckets
are the completed ones of the fixed grid [k*W, (k+1)*W) of the monotonic clock (W = recent_seconds) lying
wholly inside that period, so ServerHistory keeps them incrementally (when ``now`` is not on the grid, the
period holds one bucket fewer than reference_seconds / W). A high
percentile, not the median, so idle stretches and light-traffic periods do not drag the working level down,
and not the maximum, so one burst does not set it. While the signature holds, the reference is latched
(``previous`` carries it), so a stall that outlasts the reference period stays flagged until throughput
recovers above drop_ratio x the latched level. Gaps in the samples are never counted as zero throughput.

A second condition set, ``stalled_engine``, keys on engine liveness instead (real stalls: vLLM #45387,
#45388, #42371, #45414; the terminal KV usage was nearly full in one and 0 % in another, so neither set reads
KV usage):

  engine_steps_stopped  the engine made no progress over the recent window: no progress witness rose
  requests_pending      running + waiting > 0 at every sample of the recent window (shared with the classic set)

"No progress" needs every witness flat (PROGRESS_WITNESSES: engine steps, generation tokens, prompt tokens),
not the step counter alone: tokens cannot be generated or prefilled without engine steps, so a step counter
that stays flat while tokens move is a stale witness (a detached stats logger, a data-parallel coordinator's
copy of the series), not a stalled engine. Then the condition is False (the tokens prove progress), and
``stale_witnesses`` says which counter is stale and what moved instead: a diagnosis, never a page. A witness
covering too little of the window leaves the condition unknown. An idle engine (no steps,
nothing pending) is not stalled. The set applies only to servers whose engine
exports a step counter (vLLM 0.23+: vllm:iteration_tokens_total_count); elsewhere it is left out, so an older
server's signature is decided by the classic set alone. The signature holds when either set holds (Kleene
OR over the applicable sets); ``condition_set`` says which one fired (stalled_engine first when both do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from exporter import rules
from exporter.results import CLASSIC, CONDITION_SETS, CollapseResult
from exporter.rules.quantile import quantile
from exporter.store import Bucket, WindowAggregate

CONDITIONS = CLASSIC + ("engine_steps_stopped",)  # every condition, each exported on its own
# the counters that rise only when the engine steps: any one rising is progress (the step counter first)
PROGRESS_WITNESSES = ("engine_steps", "generation_tokens", "prompt_tokens")
MIN_COVERAGE_RATIO = 0.5  # a window (or reference bucket) needs samples over half its span to count
REFERENCE_QUANTILE = 0.9


@dataclass(frozen=True)
class CollapseThresholds:
    throughput_drop_ratio: float = rules.COLLAPSE_THROUGHPUT_DROP_RATIO.default
    power_near_idle_ratio: float = rules.COLLAPSE_POWER_NEAR_IDLE_RATIO.default
    reference_seconds: float = rules.COLLAPSE_REFERENCE_WINDOW.default
    recent_seconds: float = 60.0            # the shortest configured window

    @classmethod
    def from_config(cls, cfg) -> "CollapseThresholds":
        return cls(cfg.collapse_throughput_drop_ratio, cfg.collapse_power_near_idle_ratio,
                   cfg.collapse_reference_seconds, min(cfg.windows_seconds))


def kleene_and(values: Sequence[bool | None]) -> bool | None:
    if any(v is False for v in values):
        return False
    if all(v is True for v in values):
        return True
    return None


def kleene_or(values: Sequence[bool | None]) -> bool | None:
    if any(v is True for v in values):
        return True
    if all(v is False for v in values):
        return False
    return None


def generation_rate(x: WindowAggregate, span_seconds: float) -> float | None:
    """Generated tokens/s over the covered part of a span; None below MIN_COVERAGE_RATIO coverage."""
    covered = x.seconds_with("generation_tokens")
    if covered < MIN_COVERAGE_RATIO * span_seconds or covered <= 0:
        return None
    return x.delta("generation_tokens") / covered


def bucket_rate(bucket_agg: WindowAggregate, width: float) -> float | None:
    """One reference bucket's generated tokens/s; None when samples cover less than MIN_COVERAGE_RATIO of it."""
    return generation_rate(bucket_agg, width)


def reference_rates_from_buckets(buckets: Iterable[Bucket], width: float) -> list[float]:
    """The rates of the grid buckets (ServerHistory.buckets: the store's one bucket rule) covered enough."""
    rates = (bucket_rate(b.agg, width) for b in buckets)
    return [r for r in rates if r is not None]


def reference_span(now: float, th: CollapseThresholds) -> tuple[float, float]:
    """(start, end) of the reference period: the ``reference_seconds`` before the recent window."""
    end = now - th.recent_seconds
    return end - th.reference_seconds, end


def mean_power(x: WindowAggregate, scope: str = "gpu") -> tuple[float | None, float | None]:
    """(mean power, mean idle power) in W over the intervals carrying both energy and idle energy."""
    sc = x.scope(scope)
    if sc is None:
        return None, None
    secs = sc.idle_subset_seconds
    if sc.idle_n == 0 or secs <= 0:
        return None, None
    return sc.idle_subset_energy_joules / secs, sc.idle_subset_idle_joules / secs


def evaluate_aggregates(recent: WindowAggregate, reference_rates: Sequence[float | None],
                        now: float, offload_enabled: bool | None, th: CollapseThresholds = CollapseThresholds(),
                        previous: CollapseResult | None = None) -> CollapseResult:
    """Evaluate the signature from the recent window's aggregate and the reference bucket rates.

    The daemon passes its shortest window's aggregate (history.aggregate(th.recent_seconds)) and
    ``reference_rates_from_buckets(history.buckets(th.recent_seconds, *reference_span(now, th)), ...)``;
    ``previous`` is this function's last result for the same server (latches the reference level while the
    signature holds). ``now`` is informational (the aggregates are already cut at it). Pure; cost: O(number
    of reference buckets), independent of the windows' lengths.
    """
    details: dict[str, str] = {}
    cond: dict[str, bool | None] = dict.fromkeys(CONDITIONS)
    cond["offload_enabled"] = offload_enabled
    if offload_enabled is None:
        details["offload_enabled"] = "cannot tell whether the server offloads (no cache_config_info)"

    enough = recent.covered_seconds >= MIN_COVERAGE_RATIO * th.recent_seconds
    # zero preemptions over the window
    if not enough or recent.seconds_with("preemptions") < MIN_COVERAGE_RATIO * th.recent_seconds:
        details["zero_preemptions"] = "not enough samples in the recent window"
    else:
        cond["zero_preemptions"] = (recent.delta("preemptions") or 0.0) == 0

    # throughput against its own reference (latched while the signature holds)
    rate = generation_rate(recent, th.recent_seconds)
    ref = quantile([r for r in reference_rates if r is not None], REFERENCE_QUANTILE)
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
    gpu = recent.scope("gpu")
    if power is None or idle is None or idle <= 0:
        details["power_near_idle"] = "no GPU energy or no idle baseline for this server's GPUs"
        power = idle = None
    elif gpu is None or gpu.covered_seconds < MIN_COVERAGE_RATIO * th.recent_seconds:
        details["power_near_idle"] = "GPU energy covers less than half of the recent window"
    else:
        cond["power_near_idle"] = power <= th.power_near_idle_ratio * idle

    # requests still in flight at every sample
    lowest = recent.gauge_min("pending")
    if not enough or lowest is None:
        details["requests_pending"] = "not enough samples in the recent window"
    else:
        cond["requests_pending"] = lowest > 0

    stale: dict[str, str] = {}
    cond["engine_steps_stopped"] = steps_stopped(recent, enough, th, details, stale)
    has_steps = recent.count_with("engine_steps") > 0  # else the stalled_engine set does not apply
    sets = {name: kleene_and([cond[c] for c in members]) for name, members in CONDITION_SETS.items()
            if name == "classic" or has_steps}
    sig = kleene_or(list(sets.values()))
    return CollapseResult(conditions=cond, signature=sig, reason=_reason(cond, sets, details, stale),
                          recent_tokens_per_second=rate, reference_tokens_per_second=ref, gpu_power_watts=power,
                          gpu_idle_power_watts=idle, details=details, condition_sets=sets, stale_witnesses=stale)


def steps_stopped(recent: WindowAggregate, enough: bool, th: CollapseThresholds, details: dict[str, str],
                  stale: dict[str, str] | None = None) -> bool | None:
    """No progress over the recent window: no PROGRESS_WITNESSES counter rose. With the step counter covering at
    least MIN_COVERAGE_RATIO of the window: False as soon as one witness rose (a flat step counter beside moving
    tokens is noted in ``stale``), True when every witness the engine exports is flat over such coverage; else
    None (the reason in ``details``). Applies only to engines with a step counter (the stalled_engine set's)."""
    if recent.count_with("engine_steps") == 0:
        details["engine_steps_stopped"] = "the engine exports no step counter (vLLM < 0.23 or another engine)"
        return None
    short = [k for k in PROGRESS_WITNESSES
             if recent.count_with(k) > 0 and recent.seconds_with(k) < MIN_COVERAGE_RATIO * th.recent_seconds]
    moved = [k for k in PROGRESS_WITNESSES if (recent.delta(k) or 0.0) > 0]
    if not enough or "engine_steps" in short or (short and not moved):
        details["engine_steps_stopped"] = "not enough samples in the recent window"
        return None
    if moved and "engine_steps" not in moved and stale is not None:
        stale["engine_steps"] = _stale_words(recent, moved)
    return not moved


def _stale_words(recent: WindowAggregate, moved: Sequence[str]) -> str:
    """Why a flat step counter beside moving token counters is a stale witness, with the rates that moved."""
    rates = ", ".join(f"{k.replace('_', ' ')} {recent.delta(k) / recent.seconds_with(k):.4g}/s" for k in moved
                      if recent.seconds_with(k) > 0)
    return ("the engine step counter did not rise over the recent window while the engine made progress "
            f"({rates}): tokens are not produced without engine steps, so the step counter is stale (a detached "
            "stats logger, a data-parallel coordinator's copy of the series, a counter of one kind of step only), "
            "not the engine stalled")


def _reason(cond: dict[str, bool | None], sets: dict[str, bool | None], details: dict[str, str],
            stale: dict[str, str] | None = None) -> str:
    held = [name for name, v in sets.items() if v]
    if held:
        why = {"stalled_engine": "engine steps stopped, the token counters with them, while requests are pending",
               "classic": "all five classic conditions hold"}
        return "; ".join(f"{name}: {why[name]}" for name in held)
    note = "".join(f"; stale witness {k}: {why}" for k, why in (stale or {}).items())
    unknown = [c for name, v in sets.items() if v is None for c in CONDITION_SETS[name] if cond[c] is None]
    if unknown:
        return "unknown: " + "; ".join(f"{c} ({details.get(c, 'unknown')})" for c in dict.fromkeys(unknown)) + note
    return "not holding: " + ", ".join(c for c in CONDITIONS if cond[c] is False) + note
