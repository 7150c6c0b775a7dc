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

Multiprocess mode (LMCache as its own server, ``lmcache.v1.multiprocess``) exports OpenTelemetry instruments
under ``lmcache_mp.``, ``lmcache_mp_`` on Prometheus (lmcache/v1/mp_observability/METRICS.md at commit
15f981531e438b31c7180bb18494d9e0a9b070d4; the L1 gauges registered by ``L1Manager`` in later revisions, no
commit pinned: tests/data/lmcache/README.md):

- buffer: ``l1_usage_ratio`` (L1 used / total bytes, 0..1: occupancy as a ratio, which the older names lack)
  and ``l1_memory_usage_bytes`` (bytes held in L1);
- store failures: ``sm_write_failed_keys`` (chunks whose write to the storage manager failed: no room, or a
  conflicting write), counted with the older skipped stores;
- external prefix cache: ``lookup_requested_tokens_total`` and ``lookup_hit_tokens_total`` (L1 + L2 hits of
  each lookup, summed over ``model_name`` / ``cache_salt``), from
  lmcache/v1/mp_observability/subscribers/metrics/lookup.py at commit 6bdca8ea92d20fc48df62de550aafa141ad89433;
  the L1 gauges from lmcache/v1/distributed/l1_manager.py at 0101edda1914240eed4f2d1d6bb98ff7a37d213a.

Not read: ``l1_evicted_keys``, ``l1_read_keys``, ``l1_write_keys`` (chunks, with no chunk size exported they
are no token or byte rate), ``l2_usage_bytes`` (the L2 backends' bytes: a second tier, capacity unknown),
``lookup_hit_l1_tokens`` / ``lookup_hit_l2_tokens`` (the split of the lookup hits by tier: found at lookup,
not what vLLM then loaded, so no cached-by-tier figure), ``num_submitted_stores`` / ``num_finished_stores`` /
``num_submitted_retrieves`` / ``num_finished_retrieves`` (transfers in flight = submitted - finished, per
``device``: a count of copies, no bytes or tokens; kvwatt has no in-flight figure),
``l1_staging_bytes`` (write-reserved, not yet admitted).
A release that samples ``l1_usage_ratio`` as a histogram (the eviction loop's) exports no gauge of it: the
ratio is then absent.

Tensor-parallel workers (label ``worker_id``) retrieve the same tokens for their shards: tokens are worker 0's.
"""

from __future__ import annotations

from exporter.samples import EngineInfo
from exporter.sources.engine import LMCACHE_ORDER, register
from exporter.sources.engine_specs import EngineSpec, Parts, Pick, SpecAdapter, model_name

SPEC = EngineSpec(
    prefixes=("lmcache:", "lmcache_mp_"),
    counters={
        "offload_store_tokens": (Pick("num_stored_tokens"),),
        "offload_load_tokens": (Pick("num_hit_tokens"),),
        # multiprocess mode: lookup_requested / lookup_hit (OTel unit "tokens": ``_tokens_total`` on the wire)
        "external_prefix_queries": (Pick("num_lookup_tokens"), Pick("lookup_requested_tokens")),
        "external_prefix_hits": (Pick("num_lookup_hits"), Pick("num_lookup_hit_tokens"), Pick("lookup_hit_tokens")),
        "offload_stores_skipped": (Pick("local_cpu_evict_failed_count"), Pick("sm_write_failed_keys")),
    },
    gauges={"offload_buffer_used_bytes": (Pick("local_cache_usage", all_replicas=True),
                                          Pick("l1_memory_usage_bytes", all_replicas=True))},
    fractions={"offload_buffer_used_ratio": Pick("l1_usage_ratio")},
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
