"""NVIDIA Dynamo adapter: a Dynamo worker's KV statistics and the KV Block Manager (KVBM), an add-on to the
engine the worker runs (tests/data/dynamo/README.md names the source).

A Dynamo worker's /metrics (``DYN_SYSTEM_PORT``) carries its backend engine's own series (``vllm:``,
``sglang:``, ``trtllm_``) next to ``dynamo_component_*``; KVBM serves ``kvbm_*`` on its own port
(``DYN_KVBM_METRICS_PORT``, 6880), read as a sidecar (docs/engines.md). sources/combine.py merges this
adapter's keys into the backend engine's reading, the engine's own series winning.

Series read, from lib/runtime/src/metrics/prometheus_names.rs (modules ``kvstats`` and ``kvbm``):

- KV usage: ``dynamo_component_kvstats_gpu_cache_usage_percent`` (0..1 despite its name; label ``dp_rank``);
- offload traffic in blocks: ``kvbm_offload_blocks_d2h`` + ``kvbm_offload_blocks_d2d`` (device -> host,
  device -> disk) and ``kvbm_onboard_blocks_h2d`` + ``kvbm_onboard_blocks_d2d`` (host -> device, disk ->
  device); tokens once the engine's block size is known (combine.py);
- tokens found in KVBM's tiers and loaded: ``kvbm_matched_tokens``;
- the engine's own hit rates of its tiers: ``kvbm_host_cache_hit_rate``, ``kvbm_disk_cache_hit_rate``
  (a sliding window kept by KVBM, 0..1).

Not read: ``kvbm_onboard_blocks_d2h`` (KVBM v2, docs/components/kvbm/kvbm-v2-guide.md at commit
13e7e6440d7f18b425638ba8244fe62cc4e7149b: disk -> host, the staging step of a disk hit before its promotion to
the GPU, which ``onboard_blocks_h2d`` then counts) and ``kvbm_offload_blocks_h2d`` below: moves between tiers.

Object storage tier (lib/runtime/src/metrics/prometheus_names.rs at commit
04070c75b52f33346a2d5723eed93a0093e77bad): ``kvbm_offload_blocks_d2o`` / ``kvbm_onboard_blocks_o2d`` count with
the device <-> tier blocks above, ``kvbm_object_write_failures`` (blocks) as stores skipped. Not read there:
``kvbm_offload_bytes_object`` / ``kvbm_onboard_bytes_object`` (bytes of the object tier alone: as the offload
bytes they would hide the host and disk tiers' traffic), ``kvbm_object_read_failures`` (a failed load, no
store), ``kvbm_object_cache_hit_rate`` (kvwatt's tier hit ratios are host and disk).

At that commit KVBM exports no tier capacity or occupancy (host or disk: the sizes are configuration only,
``DYN_KVBM_CPU_CACHE_GB`` / ``DYN_KVBM_DISK_CACHE_GB``), and no host/disk offload bytes: those figures are
absent. Host -> disk
(``kvbm_offload_blocks_h2d``) moves blocks between tiers, not to or from the GPU: not offload traffic.
"""

from __future__ import annotations

from exporter.samples import EngineInfo
from exporter.sources.engine import DYNAMO_ORDER, register
from exporter.sources.engine_specs import EngineSpec, Parts, Pick, SpecAdapter, model_name

KVSTATS = "dynamo_component_kvstats_"
SPEC = EngineSpec(
    prefixes=("",),
    counters={
        # device -> host, -> disk, -> object storage (d2o: prometheus_names.rs at 04070c75)
        "offload_store_blocks": (Pick("kvbm_offload_blocks_d2h"), Pick("kvbm_offload_blocks_d2d"),
                                 Pick("kvbm_offload_blocks_d2o")),
        "offload_load_blocks": (Pick("kvbm_onboard_blocks_h2d"), Pick("kvbm_onboard_blocks_d2d"),
                                Pick("kvbm_onboard_blocks_o2d")),
        # blocks whose write to object storage failed: stores of the offload tier that did not land
        "offload_stores_skipped": (Pick("kvbm_object_write_failures"),),
        "offload_load_tokens": (Pick("kvbm_matched_tokens"),),
    },
    fractions={
        "kv_usage": Pick(KVSTATS + "gpu_cache_usage_percent"),
        "offload_host_hit_ratio": Pick("kvbm_host_cache_hit_rate"),
        "offload_disk_hit_ratio": Pick("kvbm_disk_cache_hit_rate"),
    },
    rank_label="dp_rank",
)


class DynamoAdapter(SpecAdapter):
    name = "dynamo"
    addon = True
    spec = SPEC
    detect_prefixes = (KVSTATS, "kvbm_")

    def facts(self, parts: Parts, process_start: float | None) -> EngineInfo:
        kvbm = any(name.startswith("kvbm_") for name in parts.series)
        return EngineInfo(model_name=model_name(parts.series), offload_enabled=True if kvbm else None,
                        offload_backend="kvbm" if kvbm else "", process_start_time_seconds=process_start)


register(DynamoAdapter(), order=DYNAMO_ORDER)
