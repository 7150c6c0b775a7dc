"""LMCache adapter: LMCache's own series, an add-on to the vLLM server it offloads for (tests/data/lmcache/
README.md names the source).

LMCache runs inside vLLM's workers as a KV connector and registers its series in its own process: they come on
LMCache's own port (its internal API server) or, with a shared ``PROMETHEUS_MULTIPROC_DIR``, on vLLM's
/metrics. Either way the adapter is an add-on (``addon``): sources/combine.py merges its keys into the vLLM
reading, vLLM's own series winning where both say the same thing (a server configured with
``sidecar_urls`` reads LMCache's port with the same deadline, docs/engines.md).

Series read, from lmcache/observability.py (PrometheusLogger, prefix ``lmcache:``):

- offload traffic in tokens: ``num_stored_tokens`` (stored, evicted ones included) and ``num_hit_tokens``
  (retrieved back for vLLM);
- external prefix cache: ``num_lookup_tokens`` and ``num_lookup_hits`` (``num_lookup_hit_tokens`` in later
  releases);
- store failures: ``local_cpu_evict_failed_count`` (no room could be made in the CPU buffer: the store is
  skipped);
- buffer: ``local_cache_usage`` (bytes held in the local CPU buffer; each worker holds its own shard, so the
  workers are summed). LMCache does not export the buffer's capacity (``max_local_cpu_size`` is
  configuration only): occupancy as a ratio is absent, the bytes are exported.

Tensor-parallel workers (label ``worker_id``) retrieve the same tokens for their shards: tokens are worker 0's.
"""

from __future__ import annotations

from exporter.samples import EngineInfo
from exporter.sources.engine import LMCACHE_ORDER, register
from exporter.sources.families import EngineSpec, Parts, Pick, SpecAdapter, model_name

SPEC = EngineSpec(
    prefixes=("lmcache:",),
    counters={
        "offload_store_tokens": (Pick("num_stored_tokens"),),
        "offload_load_tokens": (Pick("num_hit_tokens"),),
        "external_prefix_queries": (Pick("num_lookup_tokens"),),
        "external_prefix_hits": (Pick("num_lookup_hits"), Pick("num_lookup_hit_tokens")),
        "offload_stores_skipped": (Pick("local_cpu_evict_failed_count"),),
    },
    gauges={"offload_buffer_used_bytes": (Pick("local_cache_usage", all_replicas=True),)},
    replica_labels=("worker_id",),
)


class LmcacheAdapter(SpecAdapter):
    name = "lmcache"
    addon = True
    spec = SPEC
    detect_prefixes = SPEC.prefixes

    def facts(self, parts: Parts, process_start: float | None) -> EngineInfo:
        return EngineInfo(model_name=model_name(parts.series), offload_enabled=True, offload_backend="lmcache",
                        process_start_time_seconds=process_start)


register(LmcacheAdapter(), order=LMCACHE_ORDER)
