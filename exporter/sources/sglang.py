"""SGLang adapter: the scheduler's and tokenizer manager's series (tests/data/sglang/README.md names the source).

Series read (``sglang:`` in SGLang's code, ``sglang_`` in some exports; both accepted), from
python/sglang/srt/observability/metrics_collector.py (SchedulerMetricsCollector, TokenizerMetricsCollector,
RadixCacheMetricsCollector):

- KV usage: ``token_usage`` (used / ``max_total_num_tokens`` of the device pool, 0..1);
- preemption: ``num_retracted_requests_total`` (SGLang "retracts" a running request when the KV pool runs
  out: what vLLM calls a preemption);
- token sources: ``realtime_tokens_total{mode=prefill_compute|prefill_cache|decode}`` (earlier releases:
  ``prompt_tokens_total`` minus ``cached_tokens_total``); cached tokens by tier:
  ``cached_tokens_total{cache_source=device|host|storage_<backend>}`` (``storage_file`` is the local disk,
  any other storage backend -- mooncake, hf3fs, nixl ... -- counts as external);
- offload traffic in tokens of the hierarchical cache (HiCache): from commit
  016d8605e45876180312e29d6988e1de06562472 (``RadixCacheMetricsCollector``) ``hicache_backup_tokens_total{pool="kv"}``
  (device -> host) and ``load_back_tokens_total{pool="kv"}`` (host -> device); there ``evicted_tokens_total``
  counts every device slot freed, backed up or destroyed, so it is read as device -> host only in earlier
  releases (no ``hicache_dropped_tokens`` / ``hicache_backup_tokens`` series), with an unlabelled load-back;
- offload traffic in bytes (016d8605): ``hicache_backup_bytes_total`` and ``load_back_bytes_total`` (all pools
  and draft transfers: the bytes the link carried);
- stores dropped with the host tier full: ``hicache_dropped_tokens_total{reason="host_pressure",pool="kv"}``
  (device KV destroyed because its write-back backup found no host room);
- buffer size and occupancy: ``hicache_host_total_tokens`` (the host pool in tokens: with the offload rate in
  tokens it gives the residency) and ``hicache_host_used_tokens / hicache_host_total_tokens`` (published with
  HiCache only); where only the per-pool series are exported (hybrid models' host pool group),
  ``hicache_host_pool_used_tokens{pool="kv"} / hicache_host_pool_total_tokens{pool="kv"}`` (the KV pool;
  python/sglang/srt/observability/hicache_pool_stats.py at commit 1f83301c7de566d5daffecefed820f7582eff2ad);
- liveness: ``cuda_graph_passes_total{mode}`` counts every decode forward pass (each mode), so its sum is the
  engine's step counter while it decodes;
- requests: ``num_running_reqs``, ``num_queue_reqs``;
- KV capacity in tokens: ``max_total_num_tokens`` (the device pool, summed over data-parallel ranks).

Not read (tests/data/sglang/README.md lists them with their commit): ``kv_available_tokens`` /
``kv_evictable_tokens`` / ``kv_used_tokens`` (the device pool in tokens: ``token_usage`` = used / total with
the evictable slots free already gives the used share, ``max_total_num_tokens`` the capacity), the ``swa_*`` /
``mamba_*`` pools (other resources than the KV pool; ``token_usage`` is already the fullest of them),
``evicted_tokens_total`` at 016d8605 (LRU turnover of the radix cache, without the idle-before-evict or reuse
record that makes vLLM's evictions pressure evidence), ``prefetched_tokens_total`` / ``backuped_tokens_total``
/ ``hicache_prefetch_outcomes_total{outcome}`` (storage (L3) <-> host, moves between tiers, not GPU traffic),
``hicache_host_pool_evicted_tokens_total{pool}`` (host slots freed: normal LRU turnover of the host tier).

SGLang has no FLOP estimate: that figure is absent.
Parallelism (docs/engines.md "Labels"): ``dp_rank`` (data-parallel attention) is a rank with its own requests,
tokens and KV pool -- summed, each pool's usage kept, and the store tracks each rank's resets. Tensor-,
pipeline- and expert-parallel ranks (``tp_rank``, ``pp_rank``, ``moe_ep_rank``) repeat their group's
scheduler figures: counted once (engine_specs.py ``kept``), so ``dp_rank="3",tp_rank="3"`` is DP rank 3, not a
replica. ``pid`` (prometheus_client's multiprocess mode) is ignored. A router re-exporting its workers' series
labels each with ``worker_addr``: each worker is its own engine, summed into the one server.
"""

from __future__ import annotations

from exporter.samples import EngineInfo
from exporter.sources.engine import SGLANG_ORDER, register
from exporter.sources.engine_specs import EngineSpec, Parts, Pick, SpecAdapter, model_name, rank_sums
from exporter.sources.ranges import MAX_VALUE

STORAGE = "storage_"
KV_POOL = (("pool", "kv"),)  # the host pool group's KV pool (hicache_pool_stats.DEFAULT_HOST_POOL_LABELS)
SPEC = EngineSpec(
    prefixes=("sglang:", "sglang_"),
    counters={
        "generation_tokens": (Pick("generation_tokens"),),
        "prompt_tokens": (Pick("prompt_tokens"),),
        "preemptions": (Pick("num_retracted_requests"),),
        "prompt_local_compute": (Pick("realtime_tokens", (("mode", "prefill_compute"),)),),
        "prompt_local_cache_hit": (Pick("realtime_tokens", (("mode", "prefill_cache"),)),),
        "prompt_cached_device": (Pick("cached_tokens", (("cache_source", "device"),)),),
        "prompt_cached_host": (Pick("cached_tokens", (("cache_source", "host"),)),),
        "prompt_cached_disk": (Pick("cached_tokens", (("cache_source", "storage_file"),)),),
        # D->H / H->D bytes, all pools and draft transfers included (RadixCacheMetricsCollector at 016d8605)
        "offload_store_bytes": (Pick("hicache_backup_bytes"),),
        "offload_load_bytes": (Pick("load_back_bytes"),),
        # device KV destroyed because the host pool could not take its backup (write-back, host full)
        "offload_stores_dropped_full": (Pick("hicache_dropped_tokens", (("reason", "host_pressure"),) + KV_POOL),),
        "engine_steps": (Pick("cuda_graph_passes"),),
    },
    gauges={
        "running": (Pick("num_running_reqs"),),
        "waiting": (Pick("num_queue_reqs"),),
    },
    fractions={"kv_usage": Pick("token_usage")},
    info=("hicache_host_used_tokens", "hicache_host_total_tokens", "hicache_host_pool_used_tokens",
          "hicache_host_pool_total_tokens", "cache_config_info", "max_total_num_tokens",
          "evicted_tokens", "hicache_backup_tokens", "load_back_tokens", "kv_evictable_tokens"),
    rank_label="dp_rank",
    replica_labels=("tp_rank", "pp_rank", "moe_ep_rank"),
    worker_labels=("worker_addr",),
)


class SglangAdapter(SpecAdapter):
    name = "sglang"
    spec = SPEC
    detect_prefixes = SPEC.prefixes

    def facts(self, parts: Parts, process_start: float | None) -> EngineInfo:
        self._offload_tokens(parts)
        self._external_storage(parts)
        self._shares_from_cached_tokens(parts)
        self._occupancy(parts)
        hicache = any(k in parts.series for k in ("hicache_host_total_tokens", "hicache_host_pool_total_tokens")) or \
            any(k in parts.counters for k in ("offload_store_tokens", "offload_load_tokens"))
        scheduler = "kv_usage" in parts.gauges or "max_total_num_tokens" in parts.series
        enabled = True if hicache else (False if scheduler else None)  # HiCache series exist only with HiCache
        page_size, pages = _cache_config(parts.series.get("cache_config_info", {}))
        capacity = rank_sums(parts.series, (Pick("max_total_num_tokens"),), self.spec, "kv_capacity_tokens",
                             parts.rejected)
        return EngineInfo(model_name=model_name(parts.series), offload_enabled=enabled,
                        offload_backend="hicache" if enabled else ("none" if enabled is False else ""),
                        num_gpu_blocks=pages, block_size=page_size,
                        has_token_sources="prompt_local_compute" in parts.counters,
                        process_start_time_seconds=process_start,
                        kv_capacity_tokens=sum(capacity.values()) if capacity else None)

    def _offload_tokens(self, parts: Parts) -> None:
        """GPU <-> host tokens of the KV pool. Releases that pre-seed ``hicache_dropped_tokens`` (016d8605) count
        the D->H copies in ``hicache_backup_tokens{pool}``, and ``evicted_tokens`` there is every device slot
        freed, backed up or not: no offload traffic. Earlier releases counted D->H in ``evicted_tokens``; a
        server without HiCache (no host pool series) that reports ``kv_evictable_tokens`` evicts to nowhere.
        ``load_back_tokens`` gained a ``pool`` label (kv, swa, mamba): the KV pool's, or all where unlabelled."""
        host = any(k in parts.series for k in ("hicache_host_total_tokens", "hicache_host_pool_total_tokens"))
        if "hicache_dropped_tokens" in parts.series or "hicache_backup_tokens" in parts.series:
            store: tuple[Pick, ...] = (Pick("hicache_backup_tokens", KV_POOL),)
        elif "kv_evictable_tokens" in parts.series and not host:
            store = ()  # a radix cache without HiCache (scheduler of the kv_*_tokens era): evictions free slots
        else:
            store = (Pick("evicted_tokens"),)
        loads = parts.series.get("load_back_tokens", {})
        pooled = any("pool" in dict(labels) for labels in loads)
        load = (Pick("load_back_tokens", KV_POOL if pooled else ()),)
        for key, picks in (("offload_store_tokens", store), ("offload_load_tokens", load)):
            sums = None if not picks else rank_sums(parts.series, picks, self.spec, key, parts.rejected)
            if sums is None:
                continue
            parts.counters[key] = sum(sums.values())
            for rank, v in sums.items():
                parts.by_rank.setdefault(rank, {})[key] = v

    def _external_storage(self, parts: Parts) -> None:
        """Cached tokens from a storage backend other than the local file one: the external tier."""
        pick = Pick("cached_tokens", label_prefix=("cache_source", STORAGE))
        sums = rank_sums(parts.series, (pick,), self.spec, "prompt_cached_external", parts.rejected)
        if sums is None:
            return
        disk = parts.counters.get("prompt_cached_disk", 0.0)
        parts.counters["prompt_cached_external"] = sum(sums.values()) - disk
        for rank, v in sums.items():
            counters = parts.by_rank.setdefault(rank, {})
            counters["prompt_cached_external"] = v - counters.get("prompt_cached_disk", 0.0)

    def _shares_from_cached_tokens(self, parts: Parts) -> None:
        """Releases before ``realtime_tokens_total``: cached = every ``cached_tokens_total`` source (``total``
        where SGLang had no detail), computed = prompt - cached (both counted per finished request)."""
        if "prompt_local_compute" in parts.counters or "prompt_local_cache_hit" in parts.counters:
            return
        sums = rank_sums(parts.series, (Pick("cached_tokens"),), self.spec, "prompt_local_cache_hit", parts.rejected)
        if sums is None or "prompt_tokens" not in parts.counters:
            return
        cached = sum(sums.values())
        if cached <= parts.counters["prompt_tokens"]:
            parts.counters["prompt_local_cache_hit"] = cached
            parts.counters["prompt_local_compute"] = parts.counters["prompt_tokens"] - cached
            for key in ("prompt_local_cache_hit", "prompt_local_compute"):
                parts.by_rank.setdefault("", {})[key] = parts.counters[key]

    def _occupancy(self, parts: Parts) -> None:
        """Host pool used / total, summed over data-parallel ranks (tensor-parallel rank 0's pool): the anchor
        gauges, else the KV pool of the per-pool series."""
        anchor = "hicache_host_total_tokens" in parts.series
        used_pick = Pick("hicache_host_used_tokens") if anchor else Pick("hicache_host_pool_used_tokens", KV_POOL)
        total_pick = Pick("hicache_host_total_tokens") if anchor else Pick("hicache_host_pool_total_tokens", KV_POOL)
        used = rank_sums(parts.series, (used_pick,), self.spec, "offload_buffer_used_ratio", parts.rejected)
        total = rank_sums(parts.series, (total_pick,), self.spec, "offload_buffer_used_ratio", parts.rejected)
        if used is None or total is None:
            return
        u, c = sum(used.values()), sum(total.values())
        if 0 < c and u <= c:
            parts.gauges["offload_buffer_used_ratio"] = u / c
            parts.gauges["offload_buffer_tokens"] = c


def _cache_config(samples: dict) -> tuple[float | None, float | None]:
    """(page size in tokens, pages in the device pool) from sglang:cache_config_info{page_size, num_pages}."""
    for labels in samples:
        lab = dict(labels)
        try:
            page, pages = float(lab.get("page_size", "")), float(lab.get("num_pages", ""))
        except ValueError:
            continue
        if 0 < page <= MAX_VALUE and 0 <= pages <= MAX_VALUE:
            return page, pages
    return None, None


register(SglangAdapter(), order=SGLANG_ORDER)
