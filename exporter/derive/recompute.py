"""Recomputation tax (methods.md s4): prompt-token shares by source and their rise over a low-pressure
reference; the MFU-counter view that also sees re-prefill after preemption (vllm-metrics.md)."""

from __future__ import annotations

import statistics
from collections import deque
from typing import Sequence

from exporter.derive.window import WindowAggregate, as_aggregate, seconds_with, sum_delta
from exporter.samples import Interval

SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def token_counts(x: WindowAggregate | Sequence[Interval]) -> dict[str, float] | None:
    """Prompt tokens by source over the window.

    vLLM >= 0.16: vllm:prompt_tokens_by_source_total. Older servers: the prefix-cache counters, where
    queries count prompt tokens looked up and hits those found: local_cache_hit = hits,
    external_kv_transfer = external hits, local_compute = queries - hits - external hits (an estimate:
    vLLM < 0.16 counts a request's tokens once, the same first-prefill-only caveat applies).

    ``x``: an aggregate, a scope's sums (agg.scope("gpu")) or a list of intervals."""
    intervals = as_aggregate(x)
    by_source = {s: sum_delta(intervals, f"prompt_{s}") for s in SOURCES}
    if by_source["local_compute"] is not None:
        return {s: v or 0.0 for s, v in by_source.items()}
    queries, hits = sum_delta(intervals, "prefix_queries"), sum_delta(intervals, "prefix_hits")
    if queries is None or hits is None:
        return None
    external = sum_delta(intervals, "external_prefix_hits") or 0.0
    return {"local_compute": max(queries - hits - external, 0.0), "local_cache_hit": hits,
            "external_kv_transfer": external}


def token_shares(counts: dict[str, float] | None) -> dict[str, float] | None:
    """Shares summing to 1, or None when there were no prompt tokens (a share of nothing is unknown)."""
    if not counts:
        return None
    total = sum(counts.values())
    if total <= 0:
        return None
    return {s: counts[s] / total for s in SOURCES}


CACHE_TIERS = ("device", "host", "disk", "p2p", "external")  # keys prompt_cached_<tier> (sources/engine.py)


def cached_tier_shares(x: WindowAggregate | Sequence[Interval]) -> dict[str, float] | None:
    """Shares of the cached prompt tokens by the tier that supplied them over the window (vLLM 0.32+:
    vllm:prompt_tokens_cached_by_source_total), so a reload from host memory and one from disk are told
    apart. None when the engine does not split cached tokens by tier, or nothing was served from a cache."""
    counts = {t: sum_delta(x, f"prompt_cached_{t}") for t in CACHE_TIERS}
    known = {t: v for t, v in counts.items() if v is not None}
    total = sum(known.values())
    if not known or total <= 0:
        return None
    return {t: v / total for t, v in known.items()}


def recompute_tax(local_compute_share: float | None, reference_share: float | None) -> float | None:
    if local_compute_share is None or reference_share is None:
        return None
    return local_compute_share - reference_share


class ReferenceShare:
    """The same server's local_compute share under low pressure, learned from whole windows whose p95 KV
    usage stayed under the threshold (median of the last ``keep``), unless configured."""

    def __init__(self, configured: float | None = None, keep: int = 20, min_prompt_tokens: float = 100.0):
        self.configured = configured
        self.samples: deque[float] = deque(maxlen=keep)
        self.min_prompt_tokens = min_prompt_tokens
        self.last_learned_t: float | None = None

    def observe(self, now: float, window_seconds: float, covered: float, p95: float | None,
                threshold: float, counts: dict[str, float] | None) -> None:
        """Feed one full window at most once per window length (non-overlapping samples)."""
        if self.last_learned_t is not None and now - self.last_learned_t < window_seconds:
            return
        shares = token_shares(counts)
        if (p95 is None or p95 >= threshold or shares is None or covered < 0.9 * window_seconds
                or sum(counts.values()) < self.min_prompt_tokens):
            return
        self.samples.append(shares["local_compute"])
        self.last_learned_t = now

    @property
    def value(self) -> float | None:
        if self.configured is not None:
            return self.configured
        return statistics.median(self.samples) if self.samples else None

    @property
    def kind(self) -> str:
        return "configured" if self.configured is not None else ("learned" if self.samples else "none")


def mfu_view(x: WindowAggregate | Sequence[Interval],
             generated_tokens: float | None) -> tuple[float | None, float | None]:
    """(FLOP/s, FLOPs per generated token) from vllm:estimated_flops_per_gpu_total. These count the tokens
    actually scheduled, so unlike the token counters they include re-prefill after preemption. They only
    move with --enable-mfu-metrics: a window with zero FLOPs but generated tokens means the flag is off."""
    flops = sum_delta(x, "flops")
    seconds = seconds_with(x, "flops")
    if flops is None or seconds <= 0:
        return None, None
    if flops == 0 and (generated_tokens or 0) > 0:
        return None, None  # metrics disabled on the server: unknown, not zero
    # fewer than one token: no per-token figure (a near-zero fraction, from a broken exposition, gives +Inf)
    per_token = flops / generated_tokens if generated_tokens is not None and generated_tokens >= 1 else None
    return flops / seconds, per_token
