"""Recomputation tax (methods.md s4): prompt-token shares by source and their rise over a low-pressure
reference; the MFU-counter view that also sees re-prefill after preemption (vllm-metrics.md)."""

from __future__ import annotations

from exporter.store import ScopeSums, WindowAggregate

SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def token_counts(x: WindowAggregate | ScopeSums) -> dict[str, float] | None:
    """Prompt tokens by source over the window.

    vLLM >= 0.16: vllm:prompt_tokens_by_source_total. Older servers: the prefix-cache counters, where
    queries count prompt tokens looked up and hits those found: local_cache_hit = hits,
    external_kv_transfer = external hits, local_compute = queries - hits - external hits (an estimate:
    vLLM < 0.16 counts a request's tokens once, the same first-prefill-only caveat applies).

    ``x``: an aggregate or a scope's sums (agg.scope("gpu"))."""
    by_source = {s: x.delta(f"prompt_{s}") for s in SOURCES}
    if by_source["local_compute"] is not None:
        return {s: v or 0.0 for s, v in by_source.items()}
    queries, hits = x.delta("prefix_queries"), x.delta("prefix_hits")
    if queries is None or hits is None:
        return None
    external = x.delta("external_prefix_hits") or 0.0
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


def cached_tier_shares(x: WindowAggregate) -> dict[str, float] | None:
    """Shares of the cached prompt tokens by the tier that supplied them over the window (vLLM 0.32+:
    vllm:prompt_tokens_cached_by_source_total), so a reload from host memory and one from disk are told
    apart. None when the engine does not split cached tokens by tier, or nothing was served from a cache."""
    counts = {t: x.delta(f"prompt_cached_{t}") for t in CACHE_TIERS}
    known = {t: v for t, v in counts.items() if v is not None}
    total = sum(known.values())
    if not known or total <= 0:
        return None
    return {t: v / total for t, v in known.items()}


def recompute_tax(local_compute_share: float | None, reference_share: float | None) -> float | None:
    if local_compute_share is None or reference_share is None:
        return None
    return local_compute_share - reference_share


def mfu_view(x: WindowAggregate,
             generated_tokens: float | None) -> tuple[float | None, float | None]:
    """(FLOP/s, FLOPs per generated token) from vllm:estimated_flops_per_gpu_total. These count the tokens
    actually scheduled, so unlike the token counters they include re-prefill after preemption. They only
    move with --enable-mfu-metrics: a window with zero FLOPs but generated tokens means the flag is off."""
    flops = x.delta("flops")
    seconds = x.seconds_with("flops")
    if flops is None or seconds <= 0:
        return None, None
    if flops == 0 and (generated_tokens or 0) > 0:
        return None, None  # metrics disabled on the server: unknown, not zero
    # fewer than one token: no per-token figure (a near-zero fraction, from a broken exposition, gives +Inf)
    per_token = flops / generated_tokens if generated_tokens is not None and generated_tokens >= 1 else None
    return flops / seconds, per_token
