"""The vLLM series kvwatt reads, by version (../shared/docs/vllm-metrics.md, copied to docs/vllm-metrics.md).

``WIRE_SERIES`` is what a real server puts on the wire (counters with ``_total``, histograms as
``_bucket``/``_sum``/``_count``). Alert and dashboard tests use it to refuse a query naming a series vLLM
never exports (the llm-d ``vllm:num_preemptions`` bug). ``RENAMES`` maps old names to the 0.33 ones.
"""

from __future__ import annotations

# old base name -> current base name (without the "vllm:" prefix)
RENAMES: dict[str, str] = {
    "gpu_cache_usage_perc": "kv_cache_usage_perc",  # renamed in 0.9.2, gone in 0.12
    "gpu_prefix_cache_queries": "prefix_cache_queries",
    "gpu_prefix_cache_hits": "prefix_cache_hits",
    "time_per_output_token_seconds": "inter_token_latency_seconds",  # before 0.10.2
}

GAUGES = (
    "kv_cache_usage_perc",
    "num_requests_running",
    "num_requests_waiting",
    "num_requests_waiting_by_reason",
    "kv_offload_cpu_cache_usage_perc",
    "cache_config_info",
    "kv_offload_config_info",
    "num_requests_kv_fetch_by_stage",  # 0.32, KV consumers only: stage label
    "kv_offload_tiering_primary_write_usage_perc",  # 0.28+ tiering, tier label (in-flight share, not occupancy)
    "kv_offload_tiering_primary_read_usage_perc",
    "simple_kv_offload_used_blocks",  # SimpleCPU connector (0.32): pinned blocks, not occupancy
    "simple_kv_offload_pending_store_blocks",
    "simple_kv_offload_info",  # capacity_blocks label
)

COUNTERS = (
    "num_preemptions",
    "prompt_tokens",
    "generation_tokens",
    "prompt_tokens_by_source",
    "prompt_tokens_cached",
    "prompt_tokens_cached_by_source",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "external_prefix_cache_queries",
    "external_prefix_cache_hits",
    "estimated_flops_per_gpu",
    "estimated_read_bytes_per_gpu",
    "estimated_write_bytes_per_gpu",
    "request_success",
    "kv_offload_total_bytes",
    "kv_offload_total_time",
    "kv_offload_load_bytes",
    "kv_offload_load_time",
    "kv_offload_store_bytes",
    "kv_offload_store_time",
    "kv_offload_stores_skipped",
    "kv_offload_allocation_failure",
    "admission_rejections",  # 0.32: reason label, no engine label
    "num_preemptions_by_reason",  # vLLM PR #58037 (not released): reason label
    "kv_offload_tiering_read_bytes",  # 0.28+ tiering: tier label ("0:primary", "1:fs", ...)
    "kv_offload_tiering_read_time",
    "kv_offload_tiering_write_bytes",
    "kv_offload_tiering_write_time",
    "kv_offload_tiering_chunk_queries",
    "kv_offload_tiering_chunk_hits",
    "kv_offload_tiering_promotion_job_failures",
    "kv_offload_tiering_cascade_job_failures",
    "kv_offload_tiering_backpressure_stores_dropped",  # 0.32 tiering: tier label, no sample until one is dropped
    "kv_offload_tiering_backpressure_blocks_dropped",
    "simple_kv_offload_save_outcomes",  # SimpleCPU connector (0.32): outcome label
    "simple_kv_offload_load_blocks",
)

HISTOGRAMS = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "iteration_tokens_total",
    "request_num_preemptions",
    "request_prompt_tokens",
    "request_generation_tokens",
    "kv_offload_size",
    "kv_offload_load_size",
    "kv_offload_store_size",
    "kv_block_idle_before_evict_seconds",  # 0.11+, with --kv-cache-metrics (sampled blocks, at eviction)
    "kv_block_reuse_gap_seconds",
    "kv_block_lifetime_seconds",
)


def _wire() -> frozenset[str]:
    names = {f"vllm:{g}" for g in GAUGES}
    for c in COUNTERS:
        names |= {f"vllm:{c}_total", f"vllm:{c}_created"}
    for h in HISTOGRAMS:
        names |= {f"vllm:{h}_bucket", f"vllm:{h}_sum", f"vllm:{h}_count", f"vllm:{h}_created"}
    return frozenset(names)


WIRE_SERIES: frozenset[str] = _wire()
