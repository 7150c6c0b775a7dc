"""KV-block residency from the engine itself (vLLM ``--kv-cache-metrics``, 0.11+; methods.md s11).

vLLM tracks a sampled share ``s`` of KV blocks (``--kv-cache-metrics-sample``, default 0.01, exported nowhere:
servers[].kv_cache_metrics_sample says it) and observes each tracked block once, at its eviction, in three
histograms: idle time before eviction, lifetime, and the gaps between its (up to 4) last accesses
(vllm/v1/core/kv_cache_metrics.py). Over a window their counters are differenced like any counter:

    evicted blocks per second     = sampled evictions / covered seconds / s
    evictions per prompt block    = (sampled evictions / s) / (prompt tokens / block size)
    idle, reuse-gap quantiles     = the upper edge of the bucket holding the quantile (as derive/preemption.py)
    evicted before reuse          = F_idle(b) / N_idle, b the largest idle bucket bound <= the yardstick:
                                    the longer of the configured p99 tool-call latency and the reuse-gap
                                    p50 with >= rules.MIN_REUSE_GAPS gaps in the window (the figure names which)

Reuse gaps are only seen for blocks reused before their eviction, so they are the gaps the cache survived: a
lower bound on the workload's, which can lengthen the yardstick but never shorten it. Under heavy eviction
the survivors are the short gaps inside a turn (all at most 0.5 s on the 96-block CPU engine), and a yardstick
that short counts only 49.6 % of the lead's 96-block capture's evictions before reuse, under the 50 % needed.
Evidence rule (methods.md s11), from the lead's captures on the vLLM 0.32 CPU engine
(tests/data/kv-cache-metrics/README.md): 96 blocks gave 0.84 evictions per prompt block (87 % of prompt tokens
recomputed), 2000 blocks 0.037 (51 %, the workload's own floor); idle-before-evict was under 2 s in both, so the
volume, not the idle distribution, separates them.

    pressure      evictions per prompt block >= rules.PRESSURE_EVICTIONS_PER_PROMPT_BLOCK and >= half the
                  evictions came before reuse
    low_pressure  evictions per prompt block <= rules.LOW_PRESSURE_EVICTIONS_PER_PROMPT_BLOCK
    unknown       histograms absent, no block size, too few prompt blocks for the sample share to show
                  pressure (fewer than MIN_EXPECTED_SAMPLES sampled evictions at the pressure level), or between
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from exporter import rules
from exporter.derive import compare
from exporter.derive.pressure import rate_per_second
from exporter.rules.keys import labelled
from exporter.store import WindowAggregate

DEFAULT_SAMPLE_SHARE = rules.VLLM_KV_CACHE_METRICS_SAMPLE  # vLLM's --kv-cache-metrics-sample default
QUANTILES = (0.5, 0.99)
BEFORE_REUSE_SHARE = 0.5  # pressure evidence: most evictions came before the block's reuse was due
MIN_EXPECTED_SAMPLES = 10.0  # sampled evictions the pressure level would give: below, the window can't tell
MIN_QUANTILE_SAMPLES = 5  # observations for a p50/p99 figure

# the longest a KV block can have waited when the engine's process age is unknown (no
# process_start_time_seconds): an engine process that served a year without a restart. A bound, not a measure
MAX_PROCESS_AGE_SECONDS = 365 * 86400.0

IDLE, REUSE = "kv_idle_before_evict_hist", "kv_reuse_gap_hist"
YARDSTICK_REUSE_GAP = "reuse_gap_p50"
YARDSTICK_TOOL_LATENCY = "p99_tool_latency"


@dataclass(frozen=True, kw_only=True)
class Residency:
    """One window's residency figures; None where unknown, ``reason`` saying why ("" when all are known)."""

    sampled_evictions: float | None = None
    evicted_blocks_per_second: float | None = None
    prompt_blocks: float | None = None
    evictions_per_prompt_block: float | None = None
    idle_before_evict_seconds: dict[str, float] | None = None  # "p50", "p99" -> upper bucket edge
    reuse_gap_seconds: dict[str, float] | None = None
    evicted_before_reuse_ratio: float | None = None
    yardstick: str | None = None  # reuse_gap_p50 | p99_tool_latency
    yardstick_seconds: float | None = None  # the idle bucket bound the share was counted at
    sample_share: float = DEFAULT_SAMPLE_SHARE
    reason: str = ""


class Evidence(NamedTuple):
    kind: str | None  # "pressure" | "low_pressure" | None
    reason: str


def histogram(agg: WindowAggregate, prefix: str, max_seconds: float = MAX_PROCESS_AGE_SECONDS
              ) -> tuple[float, list[tuple[float, float]]] | None:
    """(N, [(bound, F(bound)) for the finite bounds, ascending]) of one residency histogram over the window;
    None without it, or when its deltas do not form a histogram (families differenced one by one can lag).

    A bucket's upper edge is the engine's choice, no measurement: no KV block idled, lived or waited between
    two accesses longer than the process has run, so a bound beyond ``max_seconds`` (the engine's process age)
    reads as ``max_seconds``. An edge of le="1e300" made the reuse-gap p99 1e300 s and the recommended buffer
    infinite (issue 38)."""
    n = agg.delta(prefix + "_count")
    if n is None or n < 0:
        return None
    buckets = sorted((min(b, max(max_seconds, 0.0)), c)
                     for le, c in labelled({k: agg.delta(k) for k in agg.keys()}, prefix + "_le").items()
                     for b in (_bound(le),) if b is not None and math.isfinite(b) and c is not None)
    cums = [c for _, c in buckets]
    if any(c < 0 or c > n + 1e-9 for c in cums) or any(b < a for a, b in zip(cums, cums[1:])):
        return None
    return n, buckets


def _bound(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def quantiles(h: tuple[float, list[tuple[float, float]]] | None) -> dict[str, float] | None:
    """{"p50": s, "p99": s}: the upper edge of the bucket holding each quantile (absent above the largest
    bound); None with fewer than MIN_QUANTILE_SAMPLES observations."""
    if h is None or h[0] < MIN_QUANTILE_SAMPLES:
        return None
    n, buckets = h
    out = {}
    for q in QUANTILES:
        edge = next((b for b, cum in buckets if cum >= q * n - 1e-9), None)
        if edge is not None:
            out[f"p{q * 100:g}"] = edge
    return out or None


def share_at_most(h: tuple[float, list[tuple[float, float]]], seconds: float) -> tuple[float, float] | None:
    """(share of observations at most b, b): b the largest bucket bound <= ``seconds``; None without one."""
    n, buckets = h
    below = [(b, cum) for b, cum in buckets if b <= seconds + 1e-12]
    if n <= 0 or not below:
        return None
    b, cum = below[-1]
    return cum / n, b


def window_residency(agg: WindowAggregate, block_size: float | None,
                     sample_share: float = DEFAULT_SAMPLE_SHARE,
                     p99_tool_latency_seconds: float = rules.P99_TOOL_LATENCY.default,
                     process_age_seconds: float | None = None) -> Residency:
    """The window's residency figures (module docstring, methods.md s11); ``process_age_seconds``: how long the
    engine's process has run (the longest any bucket edge can mean), None when unknown."""
    age = MAX_PROCESS_AGE_SECONDS if process_age_seconds is None else process_age_seconds
    idle = histogram(agg, IDLE, age)
    if idle is None:
        return Residency(sample_share=sample_share, reason="no KV-block residency histograms (start vLLM with "
                                                           "--kv-cache-metrics)")
    n = idle[0]
    reuse = histogram(agg, REUSE, age)
    sampled_rate = rate_per_second(agg, IDLE + "_count")
    prompt = agg.delta("prompt_tokens")
    blocks = prompt / block_size if prompt is not None and block_size else None
    reasons = []
    if blocks is None:
        reasons.append("block size or prompt tokens unknown")
    ratio = n / sample_share / blocks if blocks else None
    if blocks is not None and not blocks:
        reasons.append("no prompt block in the window")
    yard, yard_seconds = _yardstick(reuse, p99_tool_latency_seconds)
    before = share_at_most(idle, yard_seconds) if n > 0 else None
    if n <= 0:
        reasons.append("no sampled eviction in the window")
    return Residency(sampled_evictions=n,
                     evicted_blocks_per_second=None if sampled_rate is None else sampled_rate / sample_share,
                     prompt_blocks=blocks, evictions_per_prompt_block=ratio, idle_before_evict_seconds=quantiles(idle),
                     reuse_gap_seconds=quantiles(reuse), evicted_before_reuse_ratio=before[0] if before else None,
                     yardstick=yard if before else None, yardstick_seconds=before[1] if before else None,
                     sample_share=sample_share, reason="; ".join(reasons))


def _yardstick(reuse, p99_tool_latency_seconds: float) -> tuple[str, float]:
    """The residency an evicted block had to outlast: the configured p99 tool-call latency, or the window's
    reuse-gap p50 where enough gaps were seen and it is longer (survived gaps only bound the workload's from
    below: module docstring)."""
    if reuse is not None and reuse[0] >= rules.MIN_REUSE_GAPS.default:
        q = quantiles(reuse)
        if q and q.get("p50", 0.0) > p99_tool_latency_seconds:
            return YARDSTICK_REUSE_GAP, q["p50"]
    return YARDSTICK_TOOL_LATENCY, p99_tool_latency_seconds


def residency_evidence(window: Residency | None) -> Evidence:
    """Pressure evidence from the engine's own eviction record (methods.md s11): ``pressure``, ``low_pressure``
    or None, with the reason. History-free: no learned reference, so the pressure learner can use it from the
    first window on."""
    if window is None or window.sampled_evictions is None:
        return Evidence(None, window.reason if window else "no residency figures")
    ratio, blocks = window.evictions_per_prompt_block, window.prompt_blocks
    if ratio is None or not blocks:
        return Evidence(None, window.reason or "no prompt block in the window")
    expected = rules.PRESSURE_EVICTIONS_PER_PROMPT_BLOCK.default * blocks * window.sample_share
    if expected < MIN_EXPECTED_SAMPLES:
        return Evidence(None, f"too few prompt blocks ({blocks:.0f}) for the sample share {window.sample_share:g}:"
                              f" pressure would show {compare.op(expected, MIN_EXPECTED_SAMPLES, '.1f')} sampled "
                              "evictions")
    shown = f"{ratio:.3g} evictions per prompt block"
    low, high = (rules.LOW_PRESSURE_EVICTIONS_PER_PROMPT_BLOCK.default,
                 rules.PRESSURE_EVICTIONS_PER_PROMPT_BLOCK.default)
    if ratio <= low:
        return Evidence("low_pressure", f"{shown} <= {low:g}")
    if ratio < high:
        return Evidence(None, f"{shown}: between the low-pressure and pressure levels")
    before = window.evicted_before_reuse_ratio
    if before is None or before < BEFORE_REUSE_SHARE:
        return Evidence(None, f"{shown}, but {_pct(before)} evicted before reuse ({_yard_words(window)}): "
                              "blocks nobody came back for")
    return Evidence("pressure", f"{shown} >= {high:g}, {_pct(before)} evicted "
                                f"idle <= {window.yardstick_seconds:g} s ({_yard_words(window)})")


YARDSTICK_WORDS = {"reuse_gap_p50": "the window's reuse-gap p50", "p99_tool_latency": "the p99 tool-call latency"}


def _yard_words(window) -> str:
    """The yardstick in words (its key is in /api/status, kv_before_reuse_yardstick)."""
    return YARDSTICK_WORDS.get(window.yardstick, "the yardstick")


def _pct(share: float | None) -> str:
    return "an unknown share" if share is None else f"{share:.0%}"
