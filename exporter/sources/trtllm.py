"""TensorRT-LLM adapter: ``trtllm-serve``'s series (tests/data/trtllm/README.md names the source).

Series read, from tensorrt_llm/metrics/collector.py (MetricsCollector, prefix ``trtllm_``; Dynamo's older
pass-through wrote ``trtllm:``, also accepted):

- KV usage: ``kv_cache_utilization`` (used / max device blocks, 0..1);
- token sources: ``prompt_tokens_total`` and ``prompt_cached_tokens_total`` (reused blocks' tokens, device or
  host tier): computed = prompt - cached;
- cached tokens by tier: ``prompt_cache_hit_tokens_total{cache_level, cache_tier}`` (``cache_tier`` = ``gpu``,
  ``host``, ``disk``; several levels backed by the same memory are summed; pages prefetched from disk to host
  count as host), from the collector at commit 050f80def8df236e326949c8bd9dee10fd896a83;
- prefix cache: ``kv_cache_reused_blocks_total`` and ``kv_cache_missed_blocks_total`` times
  ``kv_cache_tokens_per_block``;
- offload traffic: ``kv_cache_offload_bytes_total`` (GPU -> host) and ``kv_cache_onboard_bytes_total``
  (host -> GPU);
- buffer occupancy: ``kv_cache_host_utilization`` (secondary pool used / max blocks), taken only where a host
  tier shows (``kv_cache_host_max_blocks`` > 0 or offload traffic): without one TensorRT-LLM reports 0;
- requests: ``num_requests_running``, ``num_requests_waiting``;
- KV capacity in tokens: ``kv_cache_max_blocks`` x ``kv_cache_tokens_per_block``.

Not read: ``kv_cache_disk_prefetch_blocks_total`` (disk -> host, a move between tiers, not GPU traffic). At that
commit TensorRT-LLM exports no "dropped before reuse" gauge (only a fork's ``kv_cache_host_dropped_blocks_total``).
TensorRT-LLM exports no preemption counter (``num_paused_requests`` is a gauge of the paused now), no engine
step counter (``iteration_latency_seconds`` is a gauge of the last iteration), no FLOP estimate and no host
pool size in bytes: those figures are absent.
"""

from __future__ import annotations

from exporter.samples import EngineInfo
from exporter.sources.engine import TRTLLM_ORDER, register
from exporter.sources.engine_specs import EngineSpec, Parts, Pick, SpecAdapter, first_value, model_name, rank_sums
from exporter.sources.ranges import MAX_VALUE

SPEC = EngineSpec(
    prefixes=("trtllm_", "trtllm:"),
    counters={
        "generation_tokens": (Pick("generation_tokens"),),
        "prompt_tokens": (Pick("prompt_tokens"),),
        "prompt_local_cache_hit": (Pick("prompt_cached_tokens"),),
        "offload_store_bytes": (Pick("kv_cache_offload_bytes"),),
        "offload_load_bytes": (Pick("kv_cache_onboard_bytes"),),
        "prompt_cached_device": (Pick("prompt_cache_hit_tokens", (("cache_tier", "gpu"),)),),
        "prompt_cached_host": (Pick("prompt_cache_hit_tokens", (("cache_tier", "host"),)),),
        "prompt_cached_disk": (Pick("prompt_cache_hit_tokens", (("cache_tier", "disk"),)),),
    },
    gauges={
        "running": (Pick("num_requests_running"),),
        "waiting": (Pick("num_requests_waiting"),),
    },
    fractions={"kv_usage": Pick("kv_cache_utilization"),
               "offload_buffer_used_ratio": Pick("kv_cache_host_utilization")},
    info=("kv_cache_reused_blocks", "kv_cache_missed_blocks", "kv_cache_tokens_per_block", "kv_cache_max_blocks",
          "kv_cache_host_max_blocks"),
)


class TrtllmAdapter(SpecAdapter):
    name = "trtllm"
    spec = SPEC
    detect_prefixes = SPEC.prefixes

    def facts(self, parts: Parts, process_start: float | None) -> EngineInfo:
        parts.derive_counter("prompt_local_compute", lambda p, c: p - c if p >= c else None,
                             "prompt_tokens", "prompt_local_cache_hit")
        tokens_per_block = first_value(parts.series, "kv_cache_tokens_per_block")
        self._prefix_cache(parts, tokens_per_block)
        host_blocks = first_value(parts.series, "kv_cache_host_max_blocks")
        traffic = any(parts.counters.get(k, 0.0) > 0 for k in ("offload_store_bytes", "offload_load_bytes"))
        enabled = True if (host_blocks or 0) > 0 or traffic else (False if host_blocks == 0 else None)
        if not enabled:
            parts.gauges.pop("offload_buffer_used_ratio", None)  # no host tier: its utilization reads 0
        blocks = first_value(parts.series, "kv_cache_max_blocks")
        return EngineInfo(model_name=model_name(parts.series), offload_enabled=enabled,
                        offload_backend="host_tier" if enabled else ("none" if enabled is False else ""),
                        num_gpu_blocks=blocks if blocks is not None and 0 <= blocks <= MAX_VALUE else None,
                        block_size=tokens_per_block if tokens_per_block and 0 < tokens_per_block <= MAX_VALUE else None,
                        has_token_sources="prompt_local_compute" in parts.counters,
                        process_start_time_seconds=process_start,
                        kv_capacity_tokens=_capacity_tokens(blocks, tokens_per_block))

    def _prefix_cache(self, parts: Parts, tokens_per_block: float | None) -> None:
        """Reused and missed blocks in tokens: the prefix cache's hits and queries."""
        if not tokens_per_block or not 0 < tokens_per_block <= 1e6:
            return
        reused = rank_sums(parts.series, (Pick("kv_cache_reused_blocks"),), self.spec, "prefix_hits", parts.rejected)
        missed = rank_sums(parts.series, (Pick("kv_cache_missed_blocks"),), self.spec, "prefix_queries",
                           parts.rejected)
        if reused is None or missed is None:
            return
        hits, misses = sum(reused.values()), sum(missed.values())
        parts.counters["prefix_hits"] = hits * tokens_per_block
        parts.counters["prefix_queries"] = (hits + misses) * tokens_per_block
        rank = parts.by_rank.setdefault("", {})
        rank["prefix_hits"], rank["prefix_queries"] = parts.counters["prefix_hits"], parts.counters["prefix_queries"]


def _capacity_tokens(blocks: float | None, tokens_per_block: float | None) -> float | None:
    """The device pool in tokens: max blocks x tokens per block, where both are sane."""
    if not blocks or not tokens_per_block or not (0 < blocks <= MAX_VALUE and 0 < tokens_per_block <= 1e6):
        return None
    tokens = blocks * tokens_per_block
    return tokens if tokens <= MAX_VALUE else None


register(TrtllmAdapter(), order=TRTLLM_ORDER)
