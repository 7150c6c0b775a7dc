"""One window's figures of one server (``WindowFigures``), built from its aggregate and what the server's model
learned (model/server.py ServerModel): each derivation of derive/ once, with the window's money and carbon when
prices are set. The model keeps the learners and latches; this module only reads them (``sm``: the server's
ServerModel, not imported here: model/server.py imports this module)."""

from __future__ import annotations

from typing import Mapping

from exporter.config import format_window
from exporter.derive import energy as derive_energy
from exporter.derive import kappa, offload, preemption, pressure, recompute, residency, tier_energy
from exporter.figures import EnergyFigure, WindowFigures
from exporter.model import offload as offload_figures
from exporter.model import pressure as pressure_model
from exporter.model.cost import Prices
from exporter.model.window_state import WindowState
from exporter.store import WindowAggregate, identity

SCOPES = ("gpu", "host")


def build(sm, st: WindowState, now: float, peers: Mapping,
          prices: Prices | None = None) -> WindowFigures:
    """The window's figures, built once (with their money and carbon when ``prices`` has a setting)."""
    cfg, seconds = sm.cfg, st.seconds
    agg: WindowAggregate = sm.history.aggregate(seconds)
    covered = agg.covered_seconds
    if agg.n == 0 or not sm.status.up:  # down: nothing of it is known now (model/advice.py says so too)
        why = st.why or sm.unknown_regime()
        return WindowFigures(window=format_window(seconds), seconds=seconds, covered_seconds=covered,
                             regime_state=why[0], regime_reason=why[1])
    # learn() derived the p95 and the preemptions/min this tick
    p95_interval = st.p95 if st.learned else pressure_model.p95_of(agg)
    p95 = p95_interval.value
    per_minute = st.per_minute if st.learned else pressure.preemptions_per_minute(agg)
    shares = recompute.token_shares(recompute.token_counts(agg))
    flops, flops_per_token = recompute.mfu_view(agg, agg.delta("generation_tokens"))
    rates = offload.transfer_rates(agg)
    tokens = offload.token_rates(agg)
    info = sm.info
    buffer_bytes = info.offload_buffer_bytes if info else None
    capacity = pressure.waiting_for_capacity(agg)
    regime_state, regime_reason = st.why or sm.unknown_regime()
    again = _again(sm, agg, seconds)
    phase_costs = sm.phase.figures()
    again_watts = {c.scope: w for c in phase_costs if (w := recompute.preemption_recompute_watts(
        again, derive_energy.priced_with_recomputation(agg, c, again.tokens_per_second))) is not None}
    energy = _energy(agg, cfg.min_load_seconds)
    priced = derive_energy.tax_in_energy(agg, sm.reference.value, phase_costs,
                                         info.offload_enabled if info else None,
                                         cfg.load_to_compute_cost_ratio)
    costs = prices.costs(energy, priced["recompute_tax_watts"], priced["offload_saved_watts"]) if prices else ()
    tiers_priced = _tier_energy(sm, agg, phase_costs)
    return WindowFigures(
        regime_state=regime_state, regime_reason=regime_reason,
        requests_waiting_for_kv_capacity=capacity.mean if capacity else None,
        requests_waiting_for_kv_capacity_share=capacity.share if capacity else None,
        window=format_window(seconds), seconds=seconds, covered_seconds=covered,
        kv_usage_p95=p95, kv_usage_max=pressure.kv_usage_quantile(agg, 1.0),
        kv_usage_p95_low=p95_interval.low, kv_usage_p95_high=p95_interval.high,
        above_threshold=st.above, preemptions_per_minute=per_minute,
        kv_pools_above_threshold=pressure.pools_above_threshold(agg, sm.pressure.threshold),
        preemption_onset=pressure.preemption_onset(per_minute, covered, seconds, cfg.preemption_onset_per_minute),
        generation_tokens_per_second=pressure.rate_per_second(agg, "generation_tokens"),
        token_shares=shares, cached_tier_shares=recompute.cached_tier_shares(agg),
        recompute_tax=recompute.window_tax(shares, sm.reference.value),
        flops_per_second=flops, flops_per_generated_token=flops_per_token,
        energy=energy, costs=costs,
        prompt_energy_per_token=derive_energy.prompt_attribution(agg, cfg.min_load_seconds,
                                                                 cfg.load_to_compute_cost_ratio),
        offload_write_bytes_per_second=rates.write_bytes_per_second,
        offload_read_bytes_per_second=rates.read_bytes_per_second,
        offload_write_tokens_per_second=tokens.write_tokens_per_second,
        offload_read_tokens_per_second=tokens.read_tokens_per_second,
        offload_buffer_residency_seconds=_residency(sm, buffer_bytes, rates, tokens),
        cached_to_prefill_ratio=kappa.observed(agg),
        savings=_savings(sm, agg, now, seconds, peers), **_newest_series(sm, agg),
        preemption_recompute=again, preemption_recompute_watts=again_watts or None,
        implausible_counts=sm.implausible.within(now, seconds),
        offload_tier_energy=tiers_priced,
        second_tier_energy_saving=tier_energy.second_tier_saving(tiers_priced, agg, "gpu"),
        **_residency_figures(sm, agg), **priced)


def _tier_energy(sm, agg: WindowAggregate, phase_costs) -> tuple:
    """Each offload tier's reloads (methods.md s14): kappa, bytes and hop energy per token from the counters and
    the configured energy per byte of each hop, priced against a recompute on the GPU scope where it has
    per-phase costs; only on a server that offloads."""
    if not (sm.info and sm.info.offload_enabled):
        return ()
    gpu = next((c for c in phase_costs if c.scope == "gpu"), None)
    cfg = sm.cfg
    hops = tier_energy.HopEnergy(host_memory=cfg.host_memory_joules_per_byte,
                                 host_link=cfg.host_link_joules_per_byte, disk=cfg.disk_joules_per_byte)
    return tier_energy.tier_energy(agg, gpu, hops, cfg.load_to_compute_cost_ratio)


def _again(sm, agg: WindowAggregate, seconds: float) -> recompute.PreemptionRecompute:
    """The window's post-preemption recomputation over the write model in use, judged by its state."""
    m = sm.writes.model
    r = recompute.preemption_recompute(agg, m.bytes_per_token, m.bytes_per_logits_token, seconds,
                                       m.reason or recompute.NO_WRITE_MODEL)
    return recompute.judged(r, m)


def _residency(sm, buffer_bytes: float | None, rates: offload.TransferRates,
               tokens: offload.TokenRates) -> float | None:
    """Buffer / write rate in bytes; for an engine that sizes its buffer and counts its stores in tokens
    (SGLang HiCache), in tokens (methods.md s6)."""
    if buffer_bytes is not None:
        return offload.residency(buffer_bytes, rates.write_bytes_per_second)
    return offload.residency((sm.gauges or {}).get("offload_buffer_tokens"), tokens.write_tokens_per_second)


def _newest_series(sm, agg: WindowAggregate) -> dict:
    """The figures from vLLM's newest series (0.30+, docs/vllm-metrics.md): preemptions per request, admission
    rejections, offload tiers; each absent where the engine does not export its series."""
    hist = preemption.histogram(agg)
    return {"preemptions_per_request": preemption.quantiles(hist),
            "preempted_requests_share": preemption.preempted_share(hist),
            "admission_rejections_per_minute": pressure.labelled_per_minute(agg, "admission_rejections"),
            "preemptions_by_reason_per_minute": pressure.labelled_per_minute(agg, "preemptions_by_reason"),
            "offload_tiers": offload.tier_flows(agg, sm.server.offload_tier_bytes, sm.cfg.p99_tool_latency_seconds,
                                                _link_critical(sm))}


def _link_critical(sm) -> tuple[float, float] | None:
    """(s7's kappa_crit over the host link, the link's bytes/s) for each tier's own (methods.md s14)."""
    crit, hw = sm.offload.kappa.critical, sm.offload.hardware
    return None if crit is None or hw is None else (crit, hw.host_device_bytes_per_second)


def _residency_figures(sm, agg: WindowAggregate) -> dict:
    """KV-block residency from vLLM's --kv-cache-metrics histograms and the evidence it gives (methods.md
    s11); all absent where the engine does not export them."""
    r = residency.window_residency(agg, sm.info.block_size if sm.info else None,
                                   sm.server.kv_cache_metrics_sample, sm.cfg.p99_tool_latency_seconds,
                                   process_age_seconds(sm.history.identity.process_start, sm.wall))
    ev = residency.residency_evidence(r)
    return {"kv_evicted_blocks_per_second": r.evicted_blocks_per_second,
            "kv_evictions_per_prompt_block": r.evictions_per_prompt_block,
            "kv_idle_before_evict_seconds": r.idle_before_evict_seconds,
            "kv_reuse_gap_seconds": r.reuse_gap_seconds,
            "kv_evicted_before_reuse_ratio": r.evicted_before_reuse_ratio,
            "kv_before_reuse_yardstick": r.yardstick, "kv_before_reuse_yardstick_seconds": r.yardstick_seconds,
            "residency_evidence": ev.kind, "residency_evidence_reason": ev.reason}


def process_age_seconds(start: float | None, wall: float | None) -> float | None:
    """Wall seconds since the engine's process started (process_start_time_seconds), plus the clock slack
    between the engine's host and kvwatt's; None when unknown or when the start lies ahead of kvwatt's clock
    (two clocks that disagree: no age to bound anything by)."""
    if start is None or wall is None or wall <= start:
        return None
    return wall - start + identity.CLOCK_SLACK_SECONDS


def _energy(agg: WindowAggregate, min_load_seconds: float) -> tuple[EnergyFigure, ...]:
    out = []
    for scope in SCOPES:
        basis = derive_energy.window_energy(agg, scope)
        if basis is None:
            continue
        fig = derive_energy.qualified(basis, min_load_seconds)
        out.append(EnergyFigure(scope, basis, fig.joules_per_token if fig else None,
                                fig.marginal_joules_per_token if fig else None))
    return tuple(out)


def _savings(sm, agg: WindowAggregate, now: float, seconds: float,
             peers: Mapping) -> tuple:
    enabled = sm.info.offload_enabled if sm.info else None
    if enabled is None:
        return ()
    on = sm.repeat_windows(now, seconds)
    total = sm.repeat_windows(now, seconds, marginal=False) if sm.offload.profile is not None else on
    pair = peers.get(sm.server.pair_off_server or "")
    off = pair.repeat_windows(now, seconds) if pair is not None and enabled else None
    collapsed = bool(enabled and sm.collapse is not None and sm.collapse.signature)  # learn() judged it
    return offload_figures.savings(agg, on, total, off, enabled, sm.reference.value, sm.cfg, sm.offload,
                                   sm.phase.costs.get("gpu"), collapse_holds=collapsed)

