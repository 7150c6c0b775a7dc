"""KV pressure and recomputation, five sections: the KV pressure regime (KV usage, the threshold, the regime;
methods.md s3, s10), preemptions, tokens and FLOPs (prompt tokens by source), the recomputation tax (s4), and the
engine's own KV-block residency record (s11)."""

from __future__ import annotations

from typing import Iterator

from exporter import rules
from exporter.catalog import bounds
from exporter.catalog.declare import (
    Elsewhere,
    MetricDef,
    Sample,
    Section,
    Words,
    deprecation_help,
    judged,
    learned,
    per_server,
    per_window,
    reading,
    server_block,
    server_key,
    setting,
    window_block,
    window_key,
)
from exporter.figures import ServerFigures, Snapshot, WindowFigures

REGIME_SECTION = "KV pressure regime"
PREEMPTION_SECTION = "Preemptions"
TOKENS_SECTION = "Tokens and FLOPs"
TAX_SECTION = "Recomputation tax"
RESIDENCY_SECTION = "KV-block residency"

STATES = ("known", "provisional", "unknown")  # a verdict's state (methods.md s10): one series each, 1 for the current
VERDICTS = ("regime", "tax", "reference", "threshold")
REGIME_ABOVE = "kvwatt_kv_pressure_regime_above"  # the regime, 1 above (was kvwatt_kv_pressure_above_threshold)


def _again(w: WindowFigures, attr: str) -> float | None:
    """A field of the window's post-preemption recomputation (None when the window has none)."""
    return getattr(w.preemption_recompute, attr) if w.preemption_recompute is not None else None


def _again_json(r) -> dict | None:
    if r is None:
        return None
    return {"tokens_per_second": r.tokens_per_second, "share": r.share,
            "scheduled_tokens_per_second": r.scheduled_tokens_per_second, "residual_share": r.residual_share,
            "state": r.state, "reason": r.reason, "write_model": _write_model_json(r.write_model)}


def _write_model_json(m) -> dict | None:
    """The write model the figure used (methods.md s4): where it came from (fitted, config.json, or both
    agreeing), its state and each candidate's coefficients (bytes per computed prompt token, per generated
    token) and check."""
    if m is None:
        return None
    def side(coef, residual, check):
        return None if coef is None else {"bytes_per_computed_token": coef[0], "bytes_per_generated_token": coef[1],
                                          "residual_share": residual, "check": check or "not_yet"}
    return {"source": m.source or None, "state": m.state, "reason": m.reason, "windows": m.windows,
            "fitted": side(m.fitted, m.fitted_residual, m.fitted_check),
            "config_json": side(m.configured, m.configured_residual, m.configured_check), "agrees": m.agrees}


def _located(attr: str):
    """A located threshold's figure, labelled with its method; nothing before there is evidence."""
    def fill(snap: Snapshot) -> Iterator[Sample]:
        for s in snap.servers:
            if s.located is not None:
                yield (s.name, s.located.method), getattr(s.located, attr)
    return fill


def _threshold_in_use(snap: Snapshot) -> Iterator[Sample]:
    for s in snap.servers:
        yield (s.name, s.threshold_source), s.threshold_in_use


def _verdict_states(snap: Snapshot) -> Iterator[Sample]:
    """A stateset: per server and verdict, 1 for its current state and 0 for the others."""
    for s in snap.servers:
        for verdict in VERDICTS:
            now = getattr(s, f"{verdict}_state")
            for state in STATES:
                yield (s.name, verdict, state), 1.0 if state == now else 0.0


def _regime_states(snap: Snapshot) -> Iterator[Sample]:
    """A stateset per window: 1 for the state of the window's regime, 0 for the others."""
    for s in snap.servers:
        for w in s.windows:
            for state in STATES:
                yield (s.name, state, w.window), 1.0 if state == w.regime_state else 0.0


# --- KV-block residency (vLLM --kv-cache-metrics, methods.md s11) -------------------------------------------
def _evicted_before_reuse(snap: Snapshot) -> Iterator[Sample]:
    for s in snap.servers:
        for w in s.windows:
            if w.kv_before_reuse_yardstick is not None:
                yield (s.name, w.kv_before_reuse_yardstick, w.window), w.kv_evicted_before_reuse_ratio


def _evidence(w: WindowFigures) -> float | None:
    return {"pressure": 1.0, "low_pressure": 0.0}.get(w.residency_evidence or "")


# KV usage, the threshold and the regime with the verdicts' states, requests waiting on KV (methods.md s3, s10)
REGIME: tuple[MetricDef, ...] = (
    MetricDef(
        name="kvwatt_kv_capacity_tokens", type="gauge", labels=("server",),
        help="The engine's KV-cache pool in tokens as the engine states it (vllm:cache_config_info "
             "kv_cache_size_tokens, 0.32+; sglang:max_total_num_tokens; trtllm_kv_cache_max_blocks x "
             "trtllm_kv_cache_tokens_per_block): the whole the KV-usage ratios are shares of. Absent where the "
             "engine states none.",
        computes=reading("sources.vllm.extract"),
        section=REGIME_SECTION,
        status=server_key("kv_capacity_tokens", lambda s: s.info.kv_capacity_tokens if s.info else None),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_kv_cache_usage_p95_ratio", type="gauge", labels=("server", "window"),
        help="95th percentile of the engine's KV-cache usage (vllm:kv_cache_usage_perc, sglang:token_usage, "
             "trtllm_kv_cache_utilization) over the window from kvwatt's dense samples (methods.md s3); a 15 s "
             "scrape misses the peaks.",
        computes="derive.pressure.kv_usage_quantile",
        section=REGIME_SECTION,
        status=window_key("kv_usage_p95", lambda w: w.kv_usage_p95),
        words=(Words("KV-cache usage p95", "percent"),),
        bounds=bounds.SHARE,
    ),
    MetricDef(
        name="kvwatt_kv_cache_usage_max_ratio", type="gauge", labels=("server", "window"),
        help="Maximum of the engine's KV-cache usage over the window from dense samples.",
        computes="derive.pressure.kv_usage_quantile",
        section=REGIME_SECTION,
        status=window_key("kv_usage_max", lambda w: w.kv_usage_max),
        words=(Words("KV-cache usage max", "percent"),),
        bounds=bounds.SHARE,
    ),
    MetricDef(
        name="kvwatt_kv_pressure_threshold_ratio", type="gauge", labels=("server",),
        help=f"The configured KV-pressure regime threshold on p95 usage (default "
             f"{rules.KV_PRESSURE_THRESHOLD.default:.2f}, methods.md s3).",
        computes=setting("config.resolve"),
        section=REGIME_SECTION,
        status=server_key("threshold", lambda s: s.threshold),
        bounds=bounds.SHARE,
    ),
    MetricDef(
        name="kvwatt_kv_cache_usage_p95_lower_ratio", type="gauge", labels=("server", "window"),
        help="Lower bound of the ~95 % order-statistic interval of the window's p95 KV usage (methods.md s10; "
             "assumes independent samples, so the real uncertainty is larger).",
        computes="derive.pressure_evidence.quantile_bounds",
        section=REGIME_SECTION,
        fill=per_window(lambda w: w.kv_usage_p95_low),
        bounds=bounds.SHARE,
    ),
    MetricDef(
        name="kvwatt_kv_cache_usage_p95_upper_ratio", type="gauge", labels=("server", "window"),
        help="Upper bound of the ~95 % order-statistic interval of the window's p95 KV usage (methods.md s10).",
        computes="derive.pressure_evidence.quantile_bounds",
        section=REGIME_SECTION,
        fill=per_window(lambda w: w.kv_usage_p95_high),
        bounds=bounds.SHARE,
    ),
    MetricDef(
        name="kvwatt_kv_pressure_threshold_located_ratio", type="gauge", labels=("server", "method"),
        help="KV-p95 threshold located from this server's own history: the p95 cut between clean windows and windows "
             "with sustained preemptions (method=preemption_onset) or a recomputation tax above noise "
             "(method=tax_onset), methods.md s10. Absent until the evidence is there.",
        computes="derive.threshold.locate_why",
        section=REGIME_SECTION,
        fill=_located("ratio"),
        bounds=bounds.SHARE,
    ),
    MetricDef(
        name="kvwatt_kv_pressure_threshold_located_low_ratio", type="gauge", labels=("server", "method"),
        help="Lower end of the located threshold's interval: the highest clean window's p95 (its lower bound).",
        computes="derive.threshold.locate_why",
        section=REGIME_SECTION,
        fill=_located("low"),
        bounds=bounds.SHARE,
    ),
    MetricDef(
        name="kvwatt_kv_pressure_threshold_located_high_ratio", type="gauge", labels=("server", "method"),
        help="Upper end of the located threshold's interval: the lowest pressured window's p95 (its upper bound).",
        computes="derive.threshold.locate_why",
        section=REGIME_SECTION,
        fill=_located("high"),
        bounds=bounds.SHARE,
    ),
    MetricDef(
        name="kvwatt_kv_pressure_threshold_located_windows", type="gauge", labels=("server", "method"),
        help="Number of evidence windows (threshold_window each, clean or pressured) the located threshold rests on.",
        computes="derive.threshold.locate_why",
        section=REGIME_SECTION,
        fill=_located("points"),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_kv_pressure_threshold_in_use_ratio", type="gauge", labels=("server", "source"),
        help="The threshold the regime's prediction uses (it never overrules a sign the engine shows): "
             "source=located once located (kv_pressure_threshold_source: located), else source=configured.",
        computes=learned("model.pressure.ThresholdLearner.observe",
                         why="the located threshold once the history locates one, else the configured one "
                             "(methods.md s10)"),
        section=REGIME_SECTION,
        fill=_threshold_in_use,
        bounds=bounds.SHARE,
    ),
    MetricDef(
        name=REGIME_ABOVE, type="gauge", labels=("server", "window"),
        help="The window's KV-pressure regime: 1 on any sign of pressure the engine shows (requests waiting for KV "
             "capacity, preemptions, a recompute tax above noise, KV-block residency), whatever the threshold in "
             "use; 0 only on positive signs of low pressure; else the threshold's prediction (1 when the p95's lower "
             "bound clears it) or absent (unknown). Its state is kvwatt_kv_pressure_regime_state (methods.md s10).",
        computes=judged("model.pressure.regime",
                        why="weighs the engine's signs of pressure against the threshold's prediction (methods.md "
                            "s10)"),
        section=REGIME_SECTION,
        status=window_key("above_threshold", lambda w: w.above_threshold),
        bounds=bounds.BOOLEAN,
    ),
    MetricDef(
        name="kvwatt_kv_pressure_above_threshold", type="gauge", labels=("server", "window"),
        help=deprecation_help(REGIME_ABOVE) + " The same values: the regime, which can be 1 with the p95 under the "
             "threshold (a sign of pressure the engine shows decides it, not the threshold).",
        computes=judged("model.pressure.regime",
                        why="weighs the engine's signs of pressure against the threshold's prediction (methods.md "
                            "s10)"),
        section=REGIME_SECTION,
        fill=per_window(lambda w: w.above_threshold),
        status=Elsewhere(f"deprecated: {REGIME_ABOVE}'s values (windows.<window>.above_threshold), /metrics only"),
        bounds=bounds.BOOLEAN,
        deprecated=REGIME_ABOVE,
    ),
    MetricDef(
        name="kvwatt_kv_pressure_regime_state", type="gauge", labels=("server", "state", "window"),
        help="State of the window's regime verdict (kvwatt_kv_pressure_regime_above), a stateset: 1 for its "
             "current state (known, provisional, unknown), 0 for the others; the why is in /api/status "
             "(windows.<window>.regime). Read the regime with its state: a provisional one may still change, an "
             "unknown one has no value (methods.md s10).",
        computes=judged("model.pressure.regime",
                        why="weighs the engine's signs of pressure against the threshold's prediction (methods.md "
                            "s10)"),
        section=REGIME_SECTION,
        fill=_regime_states,
        status=window_key("regime", lambda w: {"state": w.regime_state, "reason": w.regime_reason}),
        bounds=bounds.BOOLEAN,
    ),
    MetricDef(
        name="kvwatt_verdict_state", type="gauge", labels=("server", "verdict", "state"),
        help="State of each of the server's learned verdicts, a stateset: verdict=regime (the shortest window with "
             "one, as /api/status regime), tax (kvwatt_recompute_tax_ratio), reference "
             "(kvwatt_recompute_reference_share_ratio), threshold (kvwatt_kv_pressure_threshold_located_ratio); 1 "
             "for the current state (known, provisional, unknown), 0 for the others (methods.md s10).",
        computes=judged("model.server.ServerModel.figures",
                        why="the state of each learned verdict, gathered when the server's figures are assembled "
                            "(methods.md s10)"),
        section=REGIME_SECTION,
        fill=_verdict_states,
        bounds=bounds.BOOLEAN,
    ),
    MetricDef(
        name="kvwatt_requests_waiting_for_kv_capacity", type="gauge", labels=("server", "window"),
        help="Requests waiting because the KV cache has no room for them, averaged over the window's samples, from "
             "vllm:num_requests_waiting_by_reason{reason=\"capacity\"} (vLLM 0.20+): the most direct sign of KV "
             "pressure (methods.md s10). Absent where the engine does not export it.",
        computes="derive.pressure.waiting_for_capacity",
        section=REGIME_SECTION,
        status=window_key("requests_waiting_for_kv_capacity", lambda w: w.requests_waiting_for_kv_capacity),
        words=(Words("requests waiting for KV capacity (mean)", "number", absent_when_none=True),),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_requests_waiting_for_kv_capacity_samples_ratio", type="gauge", labels=("server", "window"),
        help="Share of the window's samples with at least one request waiting for KV capacity (vLLM 0.20+): in most "
             f"samples (>= {rules.CAPACITY_SUSTAINED.default:g}) it is known pressure, in any it rules out low "
             "pressure (methods.md s10).",
        computes="derive.pressure.waiting_for_capacity",
        section=REGIME_SECTION,
        status=window_key("requests_waiting_for_kv_capacity_share",
                          lambda w: w.requests_waiting_for_kv_capacity_share),
        words=(Words("samples with requests waiting for KV capacity", "percent", absent_when_none=True),),
        bounds=bounds.SHARE,
    ),
    MetricDef(
        name="kvwatt_kv_pools_above_threshold", type="gauge", labels=("server", "window"),
        help="Number of the server's KV pools (data-parallel ranks, a router's workers: docs/engines.md) whose own "
             "p95 usage over the window is above the threshold in use. Absent for a server with one pool; "
             "kvwatt_kv_cache_usage_p95_ratio is the fullest pool's.",
        computes="derive.pressure.pools_above_threshold",
        section=REGIME_SECTION,
        status=window_key("kv_pools_above_threshold", lambda w: w.kv_pools_above_threshold),
        words=(Words("KV pools above threshold", "number", absent_when_none=True),),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_requests_in_kv_fetch", type="gauge", labels=("server", "stage"),
        help="Requests in an asynchronous KV fetch, by stage (waiting_to_start, in_progress, completed_waiting) at "
             "the last read, from vllm:num_requests_kv_fetch_by_stage (0.32, with a connector that loads KV): not "
             "requests waiting for KV capacity (kvwatt_requests_waiting_for_kv_capacity). Requests held in_progress "
             "while nothing runs point at the async-load stall (vLLM #57841).",
        computes=reading("sources.vllm.extract"),
        section=REGIME_SECTION,
        status=server_key("requests_in_kv_fetch", lambda s: s.kv_fetch_waiting),
        bounds=bounds.NON_NEGATIVE,
    ),
)


# preemptions and admission rejections: the engine's signs of KV pressure (methods.md s3)
PREEMPTIONS: tuple[MetricDef, ...] = (
    MetricDef(
        name="kvwatt_preemptions_per_minute", type="gauge", labels=("server", "window"),
        help="Preemptions per minute over the window, from vllm:num_preemptions_total deltas (SGLang: retractions, "
             "sglang:num_retracted_requests_total; absent for engines without such a counter).",
        computes="derive.pressure.preemptions_per_minute",
        section=PREEMPTION_SECTION,
        status=window_key("preemptions_per_minute", lambda w: w.preemptions_per_minute),
        words=(Words("preemptions per minute", "number"),),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_preemption_onset", type="gauge", labels=("server", "window"),
        help=f"1 when preemptions are sustained at >= the onset rate (default "
             f"{rules.PREEMPTION_ONSET_PER_MINUTE.default:g}/min, methods.md s3).",
        computes="derive.pressure.preemption_onset",
        section=PREEMPTION_SECTION,
        status=window_key("preemption_onset", lambda w: w.preemption_onset),
        bounds=bounds.BOOLEAN,
    ),
    MetricDef(
        name="kvwatt_preemptions_per_request", type="gauge", labels=("server", "percentile", "window"),
        help="Preemptions per request finished in the window at the percentile (p50, p99), from the histogram "
             "vllm:request_num_preemptions (0.30+): the upper edge of the bucket holding it (at most this many; "
             "vLLM's first bucket holds 0 and 1 together); absent above the largest bucket.",
        computes="derive.preemption.quantiles",
        section=PREEMPTION_SECTION,
        status=window_key("preemptions_per_request", lambda w: w.preemptions_per_request),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_preempted_requests_ratio", type="gauge", labels=("server", "bound", "window"),
        help="Share of the requests finished in the window that were preempted at least once, as a lower and an "
             "upper bound (equal when the histogram's buckets and sum tell it exactly), from "
             "vllm:request_num_preemptions (0.30+).",
        computes="derive.preemption.preempted_share",
        section=PREEMPTION_SECTION,
        status=window_key("preempted_requests_share", lambda w: w.preempted_requests_share),
        bounds=bounds.SHARE,
    ),
    MetricDef(
        name="kvwatt_preemptions_by_reason_per_minute", type="gauge", labels=("server", "reason", "window"),
        help="Preemptions per minute over the window by reason (kv_full, priority, prefix_cache_reset) where vLLM "
             "exports vllm:num_preemptions_by_reason_total (vLLM PR #58037, not in a release yet): only kv_full is "
             "KV pressure.",
        computes="derive.pressure.labelled_per_minute",
        section=PREEMPTION_SECTION,
        status=window_key("preemptions_by_reason_per_minute", lambda w: w.preemptions_by_reason_per_minute),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_admission_rejections_per_minute", type="gauge", labels=("server", "reason", "window"),
        help="Requests refused at admission per minute over the window, by reason (a queue limit: "
             "max_num_queued_reqs, max_num_queued_tokens), from vllm:admission_rejections_total (0.32+).",
        computes="derive.pressure.labelled_per_minute",
        section=PREEMPTION_SECTION,
        status=window_key("admission_rejections_per_minute",
                                                    lambda w: w.admission_rejections_per_minute),
        bounds=bounds.NON_NEGATIVE,
    ),
)


# what the engine produced and computed: generated tokens, prompt tokens by source, estimated FLOPs (s4)
TOKENS: tuple[MetricDef, ...] = (
    MetricDef(
        name="kvwatt_generation_tokens_per_second", type="gauge", labels=("server", "window"),
        help="Generated tokens per second over the window.",
        computes="derive.pressure.rate_per_second",
        section=TOKENS_SECTION,
        status=window_key("generation_tokens_per_second", lambda w: w.generation_tokens_per_second),
        words=(Words("generated tokens/s", "number"),),
        bounds=bounds.TOKEN_RATE,
    ),
    MetricDef(
        name="kvwatt_prompt_token_share_ratio", type="gauge", labels=("server", "source", "window"),
        help="Share of prompt tokens by source (local_compute, local_cache_hit, external_kv_transfer) over the "
             "window; sums to 1. vLLM < 0.16: estimated from prefix-cache counters. First prefills only: re-prefill "
             "after preemption is not counted (see kvwatt_estimated_flops_per_generated_token).",
        computes="derive.recompute.token_shares",
        section=TOKENS_SECTION,
        status=window_key("prompt_token_shares", lambda w: w.token_shares),
        words=(Words("prompt tokens recomputed", "percent", ("prompt_token_shares", "local_compute")),
               Words("prompt tokens from prefix cache", "percent",
                     ("prompt_token_shares", "local_cache_hit")),
               Words("prompt tokens reloaded (offload)", "percent",
                     ("prompt_token_shares", "external_kv_transfer"))),
        bounds=bounds.SHARE,
    ),
    MetricDef(
        name="kvwatt_cached_prompt_token_share_ratio", type="gauge", labels=("server", "tier", "window"),
        help="Share of the prompt tokens served from a cache by the tier that supplied them (device, host, disk, "
             "p2p, external) over the window; sums to 1 (vllm:prompt_tokens_cached_by_source_total, 0.32+): a reload "
             "from host memory and one from disk are told apart.",
        computes="derive.recompute.cached_tier_shares",
        section=TOKENS_SECTION,
        status=window_key("cached_prompt_token_shares", lambda w: w.cached_tier_shares),
        bounds=bounds.SHARE,
    ),
    MetricDef(
        name="kvwatt_estimated_flops_per_second", type="gauge", labels=("server", "window"),
        help="FLOP/s vLLM estimated for the tokens it actually scheduled (MFU counters, --enable-mfu-metrics); "
             "includes re-prefill after preemption, which the token counters miss.",
        computes="derive.recompute.mfu_view",
        section=TOKENS_SECTION,
        status=window_key("estimated_flops_per_second", lambda w: w.flops_per_second),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_estimated_flops_per_generated_token", type="gauge", labels=("server", "window"),
        help="Estimated FLOPs per generated token over the window (MFU counters): rises with every kind of "
             "recomputation, preemption re-prefill included.",
        computes="derive.recompute.mfu_view",
        section=TOKENS_SECTION,
        status=window_key("estimated_flops_per_generated_token", lambda w: w.flops_per_generated_token),
        words=(Words("FLOPs per generated token (estimated)", "gigaflops"),),
        bounds=bounds.NON_NEGATIVE,
    ),
)


# the recomputation tax, its low-pressure reference, and the recomputation preemptions caused (methods.md s4)
TAX: tuple[MetricDef, ...] = (
    MetricDef(
        name="kvwatt_recompute_tax_ratio", type="gauge", labels=("server", "window"),
        help="local_compute share minus this server's low-pressure reference share (methods.md s4).",
        computes="derive.recompute.recompute_tax",
        section=TAX_SECTION,
        status=window_key("recompute_tax", lambda w: w.recompute_tax),
        words=(Words("recompute tax (points)", "points"),),
        bounds=bounds.SHARE_DIFFERENCE,
    ),
    MetricDef(
        name="kvwatt_recompute_reference_share_ratio", type="gauge", labels=("server",),
        help="The low-pressure local_compute reference share the tax is measured against (learned or configured). "
             "Learned from windows of true low pressure only: no preemption, no tax above noise, p95 well under the "
             "threshold in use (methods.md s10); persisted in the state directory.",
        computes=learned("model.pressure.LowPressureReference.offer",
                         why="learned from the low-pressure windows of the server's history and persisted "
                             "(methods.md s10)"),
        section=TAX_SECTION,
        status=server_key("reference_local_compute_share", lambda s: s.reference_share),
        bounds=bounds.SHARE,
    ),
    MetricDef(
        name="kvwatt_recompute_reference_windows", type="gauge", labels=("server",),
        help="Number of low-pressure windows (threshold_window each) the learned reference share rests on; 0 when "
             "configured.",
        computes=learned("model.pressure.LowPressureReference.offer",
                         why="learned from the low-pressure windows of the server's history and persisted "
                             "(methods.md s10)"),
        section=TAX_SECTION,
        fill=per_server(lambda s: s.reference_windows),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_preemption_recompute_tokens_per_second", type="gauge", labels=("server", "window"),
        help="Tokens computed again after a preemption (a resumed request's prompt and generated context), per "
             "second: every token vLLM scheduled (its write-traffic estimate, --enable-mfu-metrics, over the bytes "
             "per token fitted from the engine's windows without preemption, or config.json's) less the first "
             "prefills and generated tokens its counters see (methods.md s4). vLLM 0.16+ counts prompt tokens by "
             "source on first prefills only, so the recomputation tax misses this work. State, reason and the write "
             "model's source (fitted, config.json, both agree) in /api/status.",
        computes="derive.recompute.preemption_recompute",
        section=TAX_SECTION,
        status=window_key("preemption_recompute", lambda w: _again(w, "tokens_per_second"),
                          json=lambda w: _again_json(w.preemption_recompute)),
        bounds=bounds.TOKEN_RATE,
    ),
    MetricDef(
        name="kvwatt_preemption_recompute_share_ratio", type="gauge", labels=("server", "window"),
        help="The post-preemption recomputation's share of the tokens the engine scheduled in the window "
             "(kvwatt_preemption_recompute_tokens_per_second over all scheduled tokens/s, methods.md s4).",
        computes="derive.recompute.preemption_recompute",
        section=TAX_SECTION,
        status=window_key("preemption_recompute_share", lambda w: _again(w, "share")),
        words=(Words("recomputed after preemption (of scheduled tokens)", "percent"),
               Words("its write model", "write_model", path=("preemption_recompute", "write_model"))),
        bounds=bounds.SHARE,
    ),
)


# the engine's own KV-block residency record (vLLM --kv-cache-metrics, methods.md s11)
RESIDENCY: tuple[MetricDef, ...] = (
    MetricDef(
        name="kvwatt_kv_block_evictions_per_second", type="gauge", labels=("server", "window"),
        help="KV blocks evicted per second over the window: sampled evictions "
             "(vllm:kv_block_idle_before_evict_seconds_count, vLLM --kv-cache-metrics) / the configured "
             "servers[].kv_cache_metrics_sample (the engine's --kv-cache-metrics-sample, default "
             f"{rules.VLLM_KV_CACHE_METRICS_SAMPLE:g}).",
        computes="derive.residency.window_residency",
        section=RESIDENCY_SECTION,
        status=window_key("kv_evicted_blocks_per_second", lambda w: w.kv_evicted_blocks_per_second),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_kv_block_evictions_per_prompt_block_ratio", type="gauge", labels=("server", "window"),
        help="KV blocks evicted per prompt block processed (prompt tokens / block size) over the window (methods.md "
             f"s11): >= {rules.PRESSURE_EVICTIONS_PER_PROMPT_BLOCK.default:g} with the evictions before reuse is "
             f"pressure evidence, <= {rules.LOW_PRESSURE_EVICTIONS_PER_PROMPT_BLOCK.default:g} low-pressure evidence.",
        computes="derive.residency.window_residency",
        section=RESIDENCY_SECTION,
        status=window_key("kv_evictions_per_prompt_block", lambda w: w.kv_evictions_per_prompt_block),
        words=(Words("KV blocks evicted per prompt block", "number"),),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_kv_block_idle_before_evict_seconds", type="gauge", labels=("server", "percentile", "window"),
        help="How long evicted KV blocks sat unused before eviction, at the percentile (p50, p99) over the window: "
             "the upper edge of the bucket of vllm:kv_block_idle_before_evict_seconds holding it.",
        computes="derive.residency.quantiles",
        section=RESIDENCY_SECTION,
        status=window_key("kv_idle_before_evict_seconds", lambda w: w.kv_idle_before_evict_seconds),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_kv_block_reuse_gap_seconds", type="gauge", labels=("server", "percentile", "window"),
        help="Time between consecutive accesses of a KV block, at the percentile (p50, p99) over the window, from "
             "vllm:kv_block_reuse_gap_seconds (upper bucket edge). Only blocks reused before their eviction are "
             "seen: the gaps the cache survived.",
        computes="derive.residency.quantiles",
        section=RESIDENCY_SECTION,
        status=window_key("kv_reuse_gap_seconds", lambda w: w.kv_reuse_gap_seconds),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_kv_block_evicted_before_reuse_ratio", type="gauge", labels=("server", "yardstick", "window"),
        help="Share of the window's KV-block evictions that came before the block's reuse was due: idle at most the "
             "configured p99 tool-call latency (yardstick=p99_tool_latency) or the window's reuse-gap p50 where it "
             f"saw >= {rules.MIN_REUSE_GAPS.default:g} gaps and it is longer (yardstick=reuse_gap_p50); methods.md "
             "s11.",
        computes="derive.residency.window_residency",
        section=RESIDENCY_SECTION,
        fill=_evicted_before_reuse,
        bounds=bounds.SHARE,
    ),
    MetricDef(
        name="kvwatt_kv_block_residency_pressure_evidence", type="gauge", labels=("server", "window"),
        help="The engine's own eviction record as KV-pressure evidence over the window (methods.md s11): 1 = "
             f"pressure (evictions per prompt block >= {rules.PRESSURE_EVICTIONS_PER_PROMPT_BLOCK.default:g}, mostly "
             f"before reuse), 0 = low pressure (<= {rules.LOW_PRESSURE_EVICTIONS_PER_PROMPT_BLOCK.default:g}); absent "
             "when unknown (no --kv-cache-metrics, too few prompt blocks for the sample share, between).",
        computes="derive.residency.residency_evidence",
        section=RESIDENCY_SECTION,
        fill=per_window(_evidence),
        bounds=bounds.BOOLEAN,
    ),
)


# --- the sections' JSON and the sections ----------------------------------------------------------------------------
# the keys _threshold_json writes: extend the two together (tests/test_figures_declared.py checks they agree)
THRESHOLD_KEYS = ("threshold_in_use", "threshold_source", "threshold_located", "evidence_windows",
                  "reference_windows", "reference_spread", "threshold_state", "threshold_reason",
                  "reference_state", "reference_reason", "tax_state", "tax_reason", "regime_state",
                  "regime_reason", "evidence", "epoch")


def _threshold_json(v: ServerFigures) -> dict:
    """The located threshold and the reference's evidence (methods.md s10)."""
    loc = v.located
    return {
        "threshold_in_use": v.threshold_in_use, "threshold_source": v.threshold_source,
        "threshold_located": None if loc is None else {
            "ratio": loc.ratio, "low": loc.low, "high": loc.high, "method": loc.method, "windows": loc.points,
            "clean_below": loc.clean_below, "pressured_above": loc.pressured_above, "misplaced": loc.misplaced},
        "evidence_windows": v.evidence_windows, "reference_windows": v.reference_windows,
        "reference_spread": v.reference_spread,
        "threshold_state": v.threshold_state, "threshold_reason": v.threshold_reason,
        "reference_state": v.reference_state, "reference_reason": v.reference_reason,
        "tax_state": v.tax_state, "tax_reason": v.tax_reason,
        "regime_state": v.regime_state, "regime_reason": v.regime_reason,
        "evidence": dict(vars(v.evidence)),
        "epoch": {"started": v.epoch_started_wall, "cause": v.epoch_cause},
    }


REGIME_SEC = Section(name=REGIME_SECTION, metrics=REGIME, blocks=(
    window_block(("kv_usage_p95_interval",),  # methods.md s10
                 ("kvwatt_kv_cache_usage_p95_lower_ratio", "kvwatt_kv_cache_usage_p95_upper_ratio"),
                 lambda w: {"kv_usage_p95_interval": [w.kv_usage_p95_low, w.kv_usage_p95_high]}),
    server_block(("regime", "regime_window"), (REGIME_ABOVE,),  # the shortest window's, in words
                 lambda v: {"regime": v.regime, "regime_window": v.regime_window}),
    server_block(THRESHOLD_KEYS,
                 ("kvwatt_kv_pressure_threshold_in_use_ratio", "kvwatt_kv_pressure_threshold_located_ratio",
                  "kvwatt_kv_pressure_threshold_located_low_ratio", "kvwatt_kv_pressure_threshold_located_high_ratio",
                  "kvwatt_kv_pressure_threshold_located_windows", "kvwatt_recompute_reference_windows",
                  "kvwatt_verdict_state"),
                 _threshold_json),
))
PREEMPTION_SEC = Section(name=PREEMPTION_SECTION, metrics=PREEMPTIONS)
TOKENS_SEC = Section(name=TOKENS_SECTION, metrics=TOKENS)
TAX_SEC = Section(name=TAX_SECTION, metrics=TAX, blocks=(
    server_block(("reference_kind",), ("kvwatt_recompute_reference_share_ratio",),
                 lambda v: {"reference_kind": v.reference_kind}),
))
RESIDENCY_SEC = Section(name=RESIDENCY_SECTION, metrics=RESIDENCY, blocks=(
    window_block(("kv_evicted_before_reuse_ratio", "kv_before_reuse_yardstick", "kv_before_reuse_yardstick_seconds"),
                 ("kvwatt_kv_block_evicted_before_reuse_ratio",),  # methods.md s11
                 lambda w: {"kv_evicted_before_reuse_ratio": w.kv_evicted_before_reuse_ratio,
                            "kv_before_reuse_yardstick": w.kv_before_reuse_yardstick,
                            "kv_before_reuse_yardstick_seconds": w.kv_before_reuse_yardstick_seconds}),
    window_block(("residency_evidence", "residency_evidence_reason"), ("kvwatt_kv_block_residency_pressure_evidence",),
                 lambda w: {"residency_evidence": w.residency_evidence,
                            "residency_evidence_reason": w.residency_evidence_reason}),
))
