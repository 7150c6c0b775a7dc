"""The seam between an inference engine's /metrics and kvwatt: one adapter per engine.

An adapter turns one exposition into an engine-neutral ``EngineReading`` (exporter/samples.py): cumulative
counters and gauges under kvwatt's own keys below, slow-changing facts, and the capabilities the exposition
showed. Everything after the adapter (store, derivations, figures) only knows these keys, so adding an
engine (SGLang, TensorRT-LLM, ...) means writing one adapter whose module calls ``register`` below and
importing that module in exporter/sources/__init__.py -- no derivation changes. An adapter maps what its engine
has onto these keys and leaves out what it does not have; the capability set then tells the figures that depend
on a missing key that they cannot exist for this server (absent, not zero).

Adapters run in a worker thread (the vLLM source calls ``read`` through ``asyncio.to_thread``), so ``read``
must be a pure function of its text: no shared mutable state.
"""

from __future__ import annotations

import math
import threading
from typing import Protocol, runtime_checkable

from exporter.rules.keys import labelled, labelled_key  # noqa: F401  (the seam's names for adapters)
from exporter.samples import EngineInfo, EngineReading


class SourceError(Exception):
    """A read failed; ``reason`` is a short word used as the label value (timeout, refused, http_503 ...)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# --- engine-neutral keys ------------------------------------------------------------------------------------
# Counters: cumulative since the engine process started, summed over data-parallel ranks.
COUNTER_KEYS: dict[str, str] = {
    "generation_tokens": "output tokens generated",
    "prompt_tokens": "prompt tokens processed (all sources)",
    "preemptions": "requests preempted (KV blocks taken back)",
    "prompt_local_compute": "prompt tokens computed by prefill on this server",
    "prompt_local_cache_hit": "prompt tokens served from the local prefix cache (GPU or offload tier)",
    "prompt_external_kv_transfer": "prompt tokens whose KV came from another server / connector",
    "prefix_queries": "tokens looked up in the local prefix cache",
    "prefix_hits": "tokens found in the local prefix cache",
    "external_prefix_queries": "tokens looked up in an external KV store / connector",
    "external_prefix_hits": "tokens found in an external KV store / connector",
    "flops": "estimated floating-point operations per GPU",
    "engine_write_bytes": "estimated bytes written to device memory per GPU (every scheduled token's activations "
                          "and KV, re-prefills after preemption included)",
    "offload_store_bytes": "bytes copied GPU -> offload tier",
    "offload_load_bytes": "bytes copied offload tier -> GPU",
    "offload_allocation_failures": "offload-tier allocations that failed",
    "offload_stores_skipped": "stores to the offload tier skipped",
    "engine_steps": "engine iterations (scheduler steps / forward passes)",
    "prompt_cached_device": "cached prompt tokens found in device (GPU) memory",
    "prompt_cached_host": "cached prompt tokens loaded from host (CPU) memory",
    "prompt_cached_disk": "cached prompt tokens loaded from local disk",
    "prompt_cached_p2p": "cached prompt tokens received from a peer server",
    "prompt_cached_external": "cached prompt tokens loaded from an external or unspecified store",
    "offload_store_tokens": "tokens whose KV was copied GPU -> offload tier",
    "offload_load_tokens": "tokens whose KV was loaded offload tier -> GPU",
    "offload_store_blocks": "KV blocks copied GPU -> offload tier (tokens once the block size is known)",
    "offload_load_blocks": "KV blocks loaded offload tier -> GPU (tokens once the block size is known)",
    "preemption_hist_count": "finished requests observed by the preemptions-per-request histogram",
    "preemption_hist_sum": "preemptions of those requests, summed",
    "offload_stores_dropped_full": "stores to the offload tier dropped because it was full",
    # KV-block residency histograms (vLLM --kv-cache-metrics): observed once per SAMPLED block at its eviction
    "kv_idle_before_evict_hist_count": "sampled KV blocks evicted (idle-before-evict histogram count)",
    "kv_idle_before_evict_hist_sum": "seconds those evicted blocks sat idle before eviction, summed",
    "kv_reuse_gap_hist_count": "reuse gaps of sampled evicted blocks (time between consecutive accesses)",
    "kv_reuse_gap_hist_sum": "those reuse gaps in seconds, summed",
    "kv_lifetime_hist_count": "sampled KV blocks evicted (lifetime histogram count)",
    "kv_lifetime_hist_sum": "allocation-to-eviction seconds of those blocks, summed",
}
# Labelled counters: one counter per value of a label, keyed "<prefix>@<value>" (e.g. "tier_write_bytes@1:fs");
# cumulative and summed over ranks like the others, so the store differences them the same way.
LABELLED_COUNTER_KEYS: dict[str, str] = {
    "preemption_hist_le": "finished requests preempted at most <le> times (cumulative histogram bucket)",
    "admission_rejections": "requests refused at admission by a queue limit, by reason",
    "preemptions_by_reason": "requests preempted, by reason (KV cache full, priority, prefix-cache reset)",
    "tier_write_bytes": "bytes written from the primary (CPU) offload tier to a secondary tier, by tier",
    "tier_read_bytes": "bytes read from a secondary offload tier into the primary tier, by tier",
    "tier_read_seconds": "seconds a secondary offload tier spent reading into the primary tier, summed over its "
                         "promotion jobs, by tier",
    "tier_write_seconds": "seconds a secondary offload tier spent writing from the primary tier, summed over its "
                          "cascade jobs, by tier",
    "tier_lookup_seconds_sum": "seconds the scheduler blocked in an offload tier's resolved chunk lookups, summed, "
                               "by tier",
    "tier_lookup_seconds_count": "chunk lookups an offload tier resolved (hit or miss), by tier",
    "tier_lookup_wait_seconds_sum": "seconds from an offload tier's first 'retry' to the lookup's resolution, summed "
                                    "over the lookups that waited, by tier",
    "tier_lookup_wait_seconds_count": "chunk lookups that waited on an offload tier's asynchronous lookup, by tier",
    "tier_chunk_queries": "chunk lookups sent to an offload tier, by tier",
    "tier_chunk_hits": "chunk lookups that hit in an offload tier, by tier",
    "tier_job_failures": "failed promotion (read) and cascade (write) jobs of an offload tier, by tier",
    "tier_promotion_failures": "failed promotion jobs (secondary tier -> CPU tier) of an offload tier, by tier",
    "tier_cascade_failures": "failed cascade jobs (CPU tier -> secondary tier) of an offload tier, by tier",
    "kv_idle_before_evict_hist_le": "sampled evicted KV blocks idle at most <le> seconds (cumulative bucket)",
    "kv_reuse_gap_hist_le": "reuse gaps of sampled evicted KV blocks of at most <le> seconds (cumulative bucket)",
    "kv_lifetime_hist_le": "sampled evicted KV blocks that lived at most <le> seconds (cumulative bucket)",
}


# Labelled gauges, the same way: "<prefix>@<value>", summed over ranks (kv_pool_usage: one per pool, not summed).
LABELLED_GAUGE_KEYS: dict[str, str] = {
    "kv_fetch": "waiting requests by asynchronous KV load stage (waiting_to_start, in_progress, completed_waiting)",
    "kv_pool_usage": "fraction of one KV pool in use (0..1), by pool (a data-parallel rank, a router's worker); "
                     "present when a server has more than one pool",
}
KV_POOL_USAGE = "kv_pool_usage"


# Gauges: the value at read time. Request counts are summed over ranks; kv_usage is the fullest rank (0..1).
GAUGE_KEYS: dict[str, str] = {
    "running": "requests running",
    "waiting": "requests waiting",
    "waiting_capacity": "requests waiting because KV capacity is short",
    "waiting_deferred": "requests waiting, deferred for another reason",
    "kv_usage": "fraction of the KV cache in use, highest rank (0..1)",
    "offload_buffer_used_ratio": "fraction of the offload buffer holding KV (true occupancy, 0..1)",
    "offload_buffer_used_bytes": "bytes of KV held in the offload buffer",
    "offload_buffer_tokens": "offload buffer capacity in tokens (engines that size it in tokens: SGLang HiCache)",
    "offload_host_hit_ratio": "the engine's own recent hit rate of its host (CPU) offload tier (0..1)",
    "offload_disk_hit_ratio": "the engine's own recent hit rate of its disk offload tier (0..1)",
}

# --- capabilities -------------------------------------------------------------------------------------------
KV_USAGE = "kv_usage"  # KV-cache usage gauge
PREEMPTIONS = "preemptions"  # preemption counter
TOKEN_SOURCES = "token_sources"  # prompt tokens split by source (compute / cache hit / external transfer)
PREFIX_CACHE = "prefix_cache"  # prefix-cache queries and hits
MFU = "mfu"  # FLOP estimate (model FLOPs utilisation)
OFFLOAD_TRAFFIC = "offload_traffic"  # offload store/load bytes
OFFLOAD_BUFFER = "offload_buffer"  # offload buffer size known
OFFLOAD_FAILURES = "offload_failures"  # offload allocation failures / skipped stores
REQUESTS = "requests"  # running / waiting request gauges
ENGINE_STEPS = "engine_steps"  # cumulative engine iterations (liveness: a stalled engine stops stepping)
CACHED_BY_TIER = "cached_by_tier"  # cached prompt tokens by the tier they came from
OFFLOAD_OCCUPANCY = "offload_occupancy"  # offload buffer occupancy (used/capacity, 0..1)
OFFLOAD_USED_BYTES = "offload_used_bytes"  # bytes held in the offload buffer (capacity unknown)
OFFLOAD_TOKENS = "offload_tokens"  # offload store/load counted in tokens
OFFLOAD_HIT_RATE = "offload_hit_rate"  # the engine's own hit rate per offload tier
PREEMPTIONS_PER_REQUEST = "preemptions_per_request"  # histogram of preemptions per finished request
OFFLOAD_TIERS = "offload_tiers"  # per-tier offload traffic (vLLM tiering: primary CPU tier + secondary tiers)
KV_BLOCK_RESIDENCY = "kv_block_residency"  # KV-block eviction/reuse histograms (vLLM --kv-cache-metrics)

CAPABILITIES: frozenset[str] = frozenset({KV_USAGE, PREEMPTIONS, TOKEN_SOURCES, PREFIX_CACHE, MFU,
                                          OFFLOAD_TRAFFIC, OFFLOAD_BUFFER, OFFLOAD_FAILURES, REQUESTS,
                                          ENGINE_STEPS, CACHED_BY_TIER, OFFLOAD_OCCUPANCY, OFFLOAD_USED_BYTES,
                                          OFFLOAD_TOKENS, OFFLOAD_HIT_RATE, PREEMPTIONS_PER_REQUEST,
                                          OFFLOAD_TIERS, KV_BLOCK_RESIDENCY})

# capability -> the counter/gauge keys any one of which shows it
CAPABILITY_KEYS: dict[str, tuple[str, ...]] = {
    KV_USAGE: ("kv_usage",),
    PREEMPTIONS: ("preemptions",),
    TOKEN_SOURCES: ("prompt_local_compute", "prompt_local_cache_hit", "prompt_external_kv_transfer"),
    PREFIX_CACHE: ("prefix_queries", "prefix_hits"),
    MFU: ("flops",),
    OFFLOAD_TRAFFIC: ("offload_store_bytes", "offload_load_bytes"),
    OFFLOAD_BUFFER: ("offload_buffer_tokens",),  # or a size in bytes in the reading's info
    OFFLOAD_FAILURES: ("offload_allocation_failures", "offload_stores_skipped", "offload_stores_dropped_full"),
    REQUESTS: ("running", "waiting"),
    ENGINE_STEPS: ("engine_steps",),
    CACHED_BY_TIER: ("prompt_cached_device", "prompt_cached_host", "prompt_cached_disk", "prompt_cached_p2p",
                     "prompt_cached_external"),
    OFFLOAD_OCCUPANCY: ("offload_buffer_used_ratio",),
    OFFLOAD_USED_BYTES: ("offload_buffer_used_bytes",),
    OFFLOAD_TOKENS: ("offload_store_tokens", "offload_load_tokens"),
    OFFLOAD_HIT_RATE: ("offload_host_hit_ratio", "offload_disk_hit_ratio"),
    PREEMPTIONS_PER_REQUEST: ("preemption_hist_count",),
    KV_BLOCK_RESIDENCY: ("kv_idle_before_evict_hist_count",),
}
# capability -> labelled counter prefixes any one of which shows it
CAPABILITY_PREFIXES: dict[str, tuple[str, ...]] = {
    OFFLOAD_TIERS: ("tier_write_bytes", "tier_read_bytes"),
}


def capabilities_of(counters: dict[str, float], gauges: dict[str, float], info: EngineInfo) -> frozenset[str]:
    """The capabilities a reading shows, from which keys it carries (any adapter can use this)."""
    caps = {cap for cap, keys in CAPABILITY_KEYS.items() if any(k in counters or k in gauges for k in keys)}
    caps |= {cap for cap, prefixes in CAPABILITY_PREFIXES.items()
             if any(k.startswith(tuple(p + "@" for p in prefixes)) for k in counters)}
    if info.offload_buffer_bytes is not None and math.isfinite(info.offload_buffer_bytes):
        caps.add(OFFLOAD_BUFFER)
    return frozenset(caps)


@runtime_checkable
class EngineAdapter(Protocol):
    """Turns one engine's /metrics text into an EngineReading."""

    name: str  # "vllm", ...; becomes EngineReading.engine
    # An adapter may also say ``addon = True``: its component runs beside an engine (LMCache, Dynamo's KVBM)
    # and its reading is merged into the engine's (sources/combine.py). Without the attribute: an engine.

    def detect(self, text: str) -> bool:
        """Does this exposition come from my engine? Cheap (a substring test), never raises."""
        ...

    def read(self, text: str, problems: list[str] | None = None) -> EngineReading:
        """The reading, with only kvwatt's keys. Raises ``SourceError("parse_error", ...)`` when the text
        holds nothing usable. Problems that do not stop the read (malformed lines skipped) are appended to
        ``problems`` as short reasons ("parse_error: 2 bad lines skipped") when a list is given."""
        ...


# The registry (node_exporter's registerCollector, in Python): each adapter's module registers its adapter at
# import, and exporter/sources/__init__.py imports the built-in modules, so the registry is complete whenever
# the package is imported -- before any worker thread reads it. (order, registration number, adapter); kept sorted.
_REGISTRY: list[tuple[float, int, EngineAdapter]] = []
_registry_lock = threading.Lock()  # a plugin may register while worker threads read the registry

# The built-in adapters' places (auto-detection tries them in this order: the engines, then the add-ons that run
# beside one). An adapter registered without an order goes after every ordered one, in registration order.
VLLM_ORDER, SGLANG_ORDER, TRTLLM_ORDER, LMCACHE_ORDER, DYNAMO_ORDER = 10, 20, 30, 40, 50


def register(adapter: EngineAdapter, order: float = math.inf) -> None:
    """Add an adapter at ``order`` (lower is tried first; equal orders keep registration order)."""
    global _REGISTRY
    with _registry_lock:
        # a new sorted list, swapped in whole: a reader holding the old one sees a complete registry
        _REGISTRY = sorted([*_REGISTRY, (order, len(_REGISTRY), adapter)], key=lambda entry: entry[:2])


def adapters() -> tuple[EngineAdapter, ...]:
    """The registered adapters: vLLM, SGLang, TensorRT-LLM, then the add-ons LMCache and Dynamo, then any
    registered later."""
    return tuple(adapter for _, _, adapter in _REGISTRY)

