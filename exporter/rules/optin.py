"""The families /metrics carries only when the configuration asks for them (``metrics_opt_in``): no alert rule,
dashboard or page reads them, and at fleet scale each is series Prometheus would store for nothing
(docs/fleet.md "Series budget"). /api/status and the page still show every figure: this only decides what
/metrics exports. tests/test_series_budget.py checks that no alert or dashboard reads one of them and that the
default exposition stays within the documented budget."""

from __future__ import annotations

ALL = "all"  # metrics_opt_in: [all] exports every family (the golden files do)

# family -> why it is left out by default (the README's metric reference says "opt-in")
OPT_IN_FAMILIES: dict[str, str] = {
    "kvwatt_server_capability": "one series per capability an exposition showed (12 for vLLM): /api/status lists them",
    "kvwatt_cached_prompt_token_share_ratio": "five cache sources per window; kvwatt_prompt_token_share_ratio "
                                              "and kvwatt_cached_to_prefill_ratio carry what panels read",
    "kvwatt_offload_tier_write_bytes_per_second": "per offload tier and window: the per-server totals are exported",
    "kvwatt_offload_tier_read_bytes_per_second": "per offload tier and window: the per-server totals are exported",
    "kvwatt_offload_tier_chunk_hit_ratio": "per offload tier and window",
    "kvwatt_offload_tier_job_failures": "per offload tier and window",
    "kvwatt_offload_tier_residency_seconds": "per offload tier and window: kvwatt_offload_buffer_residency_seconds "
                                             "is the server's",
    "kvwatt_offload_tier_undersized": "per offload tier and window: kvwatt_offload_buffer_undersized is the server's",
    "kvwatt_offload_tier_dropped_stores_per_second": "per offload tier and window: the advice tier_dropping_stores "
                                                     "says it (/api/status)",
    "kvwatt_offload_tier_dropped_blocks_per_second": "per offload tier and window: the advice tier_dropping_stores "
                                                     "says it; the alert reads vLLM's own counter",
    # issue 41: the second tier's failures and energy, per tier and window (/api/status offload_tiers,
    # offload_tier_energy; the alerts read vLLM's own failure counters)
    "kvwatt_offload_tier_failed_promotions_per_second": "per offload tier and window: the alert "
                                                        "KVOffloadTierJobsFailing reads vLLM's own counter",
    "kvwatt_offload_tier_failed_cascades_per_second": "per offload tier and window: the alert "
                                                      "KVOffloadTierJobsFailing reads vLLM's own counter",
    "kvwatt_offload_tier_reload_joules_per_token": "per offload tier and window (/api/status offload_tier_energy)",
    "kvwatt_offload_tier_breakeven_ratio": "per offload tier and window (/api/status offload_tier_energy)",
    "kvwatt_offload_tier_cached_to_prefill_ratio": "per offload tier and window: kvwatt_cached_to_prefill_ratio is "
                                                   "the server's",
    "kvwatt_offload_tier_reload_watts": "per offload tier and window (/api/status offload_tier_energy)",
    "kvwatt_offload_tier_saved_watts": "per offload tier and window: kvwatt_offload_saved_watts is the server's",
    "kvwatt_offload_second_tier_energy_saving_ratio": "per window, a tiered server's only (/api/status "
                                                      "second_tier_energy_saving)",
    # issue 41 item 2: each tier's transfer times and kappa_crit (/api/status offload_tiers)
    "kvwatt_offload_tier_read_bandwidth_bytes_per_second": "per offload tier and window (/api/status offload_tiers)",
    "kvwatt_offload_tier_write_bandwidth_bytes_per_second": "per offload tier and window (/api/status offload_tiers)",
    "kvwatt_offload_tier_read_seconds_per_second": "per offload tier and window (/api/status offload_tiers)",
    "kvwatt_offload_tier_write_seconds_per_second": "per offload tier and window (/api/status offload_tiers)",
    "kvwatt_offload_tier_critical_cached_to_prefill_ratio": "per offload tier and window: "
                                                            "kvwatt_critical_cached_to_prefill_ratio is the server's",
    "kvwatt_offload_tier_lookup_seconds": "per offload tier and window (/api/status offload_tiers)",
    "kvwatt_offload_tier_lookup_wait_seconds": "per offload tier and window (/api/status offload_tiers)",
    "kvwatt_offload_saved_cost_per_day": "money per baseline and window: kvwatt_offload_saved_watts times the price",
    "kvwatt_offload_saved_co2e_grams_per_day": "per baseline and window: kvwatt_offload_saved_watts times the "
                                               "carbon intensity",
    "kvwatt_kv_cache_usage_p95_lower_ratio": "the p95's uncertainty interval, per window",
    "kvwatt_kv_cache_usage_p95_upper_ratio": "the p95's uncertainty interval, per window",
    "kvwatt_requests_in_kv_fetch": "per KV fetch stage: the stall detector reads it in /api/status",
    "kvwatt_preemptions_by_reason_per_minute": "per preemption reason and window: kvwatt_preemptions_per_minute "
                                               "is the total the alerts read",
    "kvwatt_preemptions_per_request": "per percentile and window",
    "kvwatt_preempted_requests_ratio": "per bound and window",
    "kvwatt_admission_rejections_per_minute": "per rejection reason and window",
    "kvwatt_recompute_tax_cost_per_day": "money per scope and window: kvwatt_recompute_tax_watts times the price",
    "kvwatt_recompute_tax_co2e_grams_per_day": "per scope and window: kvwatt_recompute_tax_watts times the carbon "
                                               "intensity",
    "kvwatt_offload_write_tokens_per_second": "per window: kvwatt_offload_write_bytes_per_second is the panel's",
    "kvwatt_offload_read_tokens_per_second": "per window: kvwatt_offload_read_bytes_per_second is the panel's",
    "kvwatt_offload_tier_hit_ratio": "per offload tier",
    "kvwatt_estimated_flops_per_second": "per window: kvwatt_estimated_flops_per_generated_token is the panel's",
    "kvwatt_recompute_reference_windows": "evidence behind the reference share (/api/status)",
    "kvwatt_offload_buffer_residency_target_seconds": "the residency target, a configured rule",
    "kvwatt_preemption_recompute_tokens_per_second": "per window: kvwatt_preemption_recompute_share_ratio is the "
                                                     "share of the engine's work it is",
    "kvwatt_preemption_recompute_watts": "per scope and window: its power at the per-phase cost (/api/status)",
    "kvwatt_window_age_seconds": "0 but on a node of many servers (their long windows rebuilt in turn): "
                                 "/api/status says it per window",
    # issue 39: the budget down to 100 series per fully configured server
    "kvwatt_energy_cost_per_million_tokens": "money per scope and window: kvwatt_marginal_energy_per_token_joules "
                                             "times the price (the dashboard multiplies them)",
    "kvwatt_co2e_grams_per_thousand_tokens": "per scope and window: kvwatt_marginal_energy_per_token_joules times "
                                             "the carbon intensity (the dashboard multiplies them)",
    "kvwatt_marginal_energy_cost_per_day": "money per scope and window: the marginal power times the price (the "
                                           "dashboard multiplies them)",
    "kvwatt_marginal_co2e_grams_per_day": "per scope and window: the marginal power times the carbon intensity (the "
                                          "dashboard multiplies them)",
    "kvwatt_estimated_flops_per_generated_token": "per window: an estimate from vLLM's MFU metrics, on the page",
    "kvwatt_kv_cache_usage_max_ratio": "per window: the p95 is the figure the regime, alerts and panels read",
    "kvwatt_prompt_energy_per_token_joules": "per source and window: an attribution model, not a measurement "
                                             "(/api/status)",
    "kvwatt_comparison_windows": "per baseline and window: the evidence count behind dE, whose standard error the "
                                 "panels show (/api/status)",
    "kvwatt_kv_block_idle_before_evict_seconds": "per percentile and window: KV-block residency detail (/api/status)",
    "kvwatt_kv_block_reuse_gap_seconds": "per percentile and window: KV-block residency detail (/api/status)",
    "kvwatt_kv_block_evictions_per_second": "per window: KV-block residency detail (/api/status)",
    "kvwatt_kv_block_evictions_per_prompt_block_ratio": "per window: KV-block residency detail (/api/status)",
    "kvwatt_kv_block_evicted_before_reuse_ratio": "per window: KV-block residency detail (/api/status)",
    "kvwatt_kv_block_residency_pressure_evidence": "per window: evidence behind the regime (/api/status)",
    "kvwatt_requests_waiting_for_kv_capacity": "per window: evidence behind the regime, which the alerts read",
    "kvwatt_requests_waiting_for_kv_capacity_samples_ratio": "per window: evidence behind the regime, which the "
                                                             "alerts read",
    "kvwatt_kv_pools_above_threshold": "per window: the p95 is already the fullest pool's (/api/status)",
    "kvwatt_kv_pressure_threshold_ratio": "the configured threshold: kvwatt_kv_pressure_threshold_in_use_ratio is "
                                          "the one in force",
    "kvwatt_kv_pressure_threshold_located_low_ratio": "the located threshold's interval (/api/status)",
    "kvwatt_kv_pressure_threshold_located_high_ratio": "the located threshold's interval (/api/status)",
    "kvwatt_kv_pressure_threshold_located_windows": "evidence behind the located threshold (/api/status)",
}


def exported(name: str, opt_in: frozenset[str]) -> bool:
    """Whether the family ``name`` is on /metrics with ``opt_in`` (the configuration's metrics_opt_in)."""
    return name not in OPT_IN_FAMILIES or name in opt_in or ALL in opt_in
