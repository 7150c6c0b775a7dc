"""Recomputation tax (methods.md s4): prompt-token shares by source and their rise over a low-pressure
reference; the MFU-counter view that also sees re-prefill after preemption (vllm-metrics.md)."""

from __future__ import annotations

from dataclasses import replace

from exporter import rules
from exporter.results import PreemptionRecompute, WriteModel
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


def window_tax(shares: dict[str, float] | None, reference_share: float | None) -> float | None:
    """The recompute tax of a window from its prompt-token shares (token_shares; None: no prompt tokens, or too
    few to judge) against the low-pressure reference share (methods.md s10): the one place every window figure,
    regime sign and evidence window takes it from."""
    return recompute_tax(shares["local_compute"] if shares else None, reference_share)


def judged_shares(x: WindowAggregate | ScopeSums, min_prompt_tokens: float) -> dict[str, float] | None:
    """token_shares, or None where the window served fewer than ``min_prompt_tokens`` prompt tokens: a share of
    a handful of tokens is no evidence (the learners' guard, derive/pressure_evidence.py MIN_PROMPT_TOKENS)."""
    counts = token_counts(x)
    return token_shares(counts) if counts and sum(counts.values()) >= min_prompt_tokens else None


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


# --- the recomputation no token counter shows (methods.md s4, "after preemption") --------------------------
# the token identity's check: windows without preemption with at least this many scheduled tokens in all must
# give recomputed ~ 0; measured -0.19 % and under 0.5 % on the real engine, +100 % when the shape is wrong
# (tensor parallel 2 halves the per-GPU heads): 2 % tells the two apart (derive/write_model.py applies it)
IDENTITY_MIN_TOKENS = 1000.0
IDENTITY_TOLERANCE = 0.02
# fewer scheduled tokens in a window give no figure: the demo's engine, stopped with requests in flight, wrote 7
# tokens' worth its counters never saw (aborted), a "100 % recomputed" window of nothing
MIN_SCHEDULED_TOKENS = 100.0
NO_WRITE_MODEL = ("the model's write traffic per token is unknown (a dense decoder's config.json as "
                  "servers[].model_config; MoE models are not modelled)")


def preemption_recompute(x: WindowAggregate, write_bytes_per_token: float | None,
                         write_bytes_per_logits_token: float | None, window_seconds: float,
                         no_model_reason: str = NO_WRITE_MODEL) -> PreemptionRecompute:
    """The window's post-preemption recomputation from the write-traffic estimate and the token counters;
    ``write_bytes_per_*``: the write model's coefficients (WriteModel: fitted, or config.json's,
    sources/model_config.engine_write_bytes); ``no_model_reason`` says why there is none."""
    writes, generated = x.delta("engine_write_bytes"), x.delta("generation_tokens")
    computed = x.delta("prompt_local_compute")
    seconds = x.seconds_with("engine_write_bytes")
    if writes is None or seconds <= 0:
        return PreemptionRecompute(reason="the engine exports no write-traffic estimate "
                                          "(vLLM 0.17+ vllm:estimated_write_bytes_per_gpu_total)")
    if computed is None or generated is None:
        return PreemptionRecompute(reason="the engine does not count prompt tokens by source (vLLM 0.16+)")
    if seconds < max(x.seconds_with("generation_tokens"), x.seconds_with("prompt_local_compute")) - 1e-6:
        # a step with tokens but no write increase: the write counter went backwards there (store/identity.py
        # RegressionWatch), so the window's writes do not cover its tokens; the write model is not to blame
        return PreemptionRecompute(reason="the write-traffic counter has no increase over part of the window its "
                                          "tokens cover (it went backwards there: a reset or regression of that "
                                          "counter, or it was not read): the window's writes do not cover its "
                                          "tokens")
    if writes <= 0 and generated + computed > 0:
        return PreemptionRecompute(reason="the write-traffic estimate does not move: start vLLM with "
                                          "--enable-mfu-metrics")
    if not write_bytes_per_token or write_bytes_per_logits_token is None:
        return PreemptionRecompute(reason=no_model_reason)
    scheduled = (writes - write_bytes_per_logits_token * generated) / write_bytes_per_token
    if scheduled <= 0:
        return PreemptionRecompute(tokens_per_second=0.0, share=None, scheduled_tokens_per_second=0.0,
                                   residual_share=None, state="known", reason="no tokens scheduled in the window",
                                   scheduled_tokens=0.0)
    recomputed = scheduled - computed - generated
    clipped = max(recomputed, 0.0)
    if scheduled < MIN_SCHEDULED_TOKENS:
        return PreemptionRecompute(reason=f"only {scheduled:.0f} tokens scheduled in the window: too few to tell",
                                   scheduled_tokens=scheduled)
    fig = PreemptionRecompute(tokens_per_second=clipped / seconds, share=clipped / scheduled,
                              scheduled_tokens_per_second=scheduled / seconds, residual_share=recomputed / scheduled,
                              state="known", reason="", scheduled_tokens=scheduled)
    if x.covered_seconds < rules.SUSTAINED_MIN_COVERED.default * window_seconds:  # as the onset's
        return replace(fig, state="provisional",
                       reason=f"window {x.covered_seconds / window_seconds:.0%} covered")
    return fig


def judged(r: PreemptionRecompute, model: WriteModel) -> PreemptionRecompute:
    """The figure's state given its write model's (derive/write_model.py ``choose``): ``provisional`` while the
    model is (not yet checked on enough windows without preemption, or a fit not yet checked on held-out ones),
    ``unknown`` when the model is (its check failed on the evidence: not this engine's shape, e.g. tensor
    parallel or another KV dtype; or none yet). The model is re-judged as windows come, never latched."""
    if r.state == "unknown":
        return replace(r, write_model=model)
    if model.state == "unknown":
        return PreemptionRecompute(reason=model.reason, write_model=model)
    if model.state == "provisional":
        return replace(r, state="provisional", reason=f"{r.reason}; {model.reason}" if r.reason else model.reason,
                       write_model=model)
    return replace(r, write_model=model)


def preemption_recompute_watts(recompute: PreemptionRecompute, costs) -> float | None:
    """W spent on the window's post-preemption recomputation: recomputed tokens/s x J per computed prompt token
    (methods.md s12; a re-prefill is a prefill). None without the figure or a usable price. ``costs`` as the
    window may price them (derive/energy.py ``priced_with_recomputation``: within its own energy, as the tax)."""
    if recompute.tokens_per_second is None or costs is None or not costs.usable:
        return None
    return recompute.tokens_per_second * costs.prompt_computed_j
