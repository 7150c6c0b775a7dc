"""Expositions of SGLang, TensorRT-LLM, vLLM + LMCache and a Dynamo worker with KVBM, built from each engine's
own metric definitions (names, types, HELP texts, label sets; tests/data/<engine>/README.md cites the file and
version each comes from). None of these engines can run on this CPU-only machine: SGLang's scheduler, TensorRT-
LLM, LMCache's connector and Dynamo's KVBM all need CUDA devices (see the README files), so the tests replay
these expositions over loopback HTTP instead.

One load model drives every engine, so the same figures are expected from each (as far as its series go):

    seq = Sequence("sglang", "high-pressure")
    seq.texts(t)      # {"": main exposition, "sidecar": the sidecar's or absent} at t seconds from the start

Kinds: ``normal`` (KV usage 0.3-0.5, nothing waits, no preemption), ``high-pressure`` (KV usage 0.93-0.99,
requests wait, 0.5 preemptions/s, heavy offload traffic, a full host buffer) and ``stalled`` (high pressure
until ``STALL_AT`` s, then the engine's step counter and every token counter freeze while requests keep
arriving: waiting grows, running stays). ``tests/data/engines/generate.py`` writes sample frames of each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
STALL_AT = 15.0  # seconds: when the stalled sequence's engine stops stepping
ENGINES = ("sglang", "trtllm", "lmcache", "dynamo")
KINDS = ("normal", "high-pressure", "stalled")
BLOCK_TOKENS = 16  # vLLM backend's block size (KVBM blocks -> tokens)
KV_BYTES_PER_TOKEN = 131072  # Llama-3.1-8B bf16: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes
HOST_TOKENS = 200_000  # host tier capacity in tokens (SGLang HiCache, TensorRT-LLM host pool)


@dataclass(frozen=True)
class Load:
    generation_tps: float
    prompt_tps: float
    cached_share: float  # of prompt tokens, served from a cache (device or offload tier)
    host_share: float  # of cached tokens, from the host tier (the rest from the device)
    preemptions_per_second: float
    steps_per_second: float
    kv_usage: float  # mean; +-0.03 over time
    running: float
    waiting: float
    store_tps: float  # offload writes, tokens/s
    occupancy: float  # host buffer used / capacity
    host_hit: float  # the engine's own host-tier hit rate


LOADS = {
    "normal": Load(50.0, 200.0, 0.30, 0.25, 0.0, 10.0, 0.40, 4, 0, 40.0, 0.30, 0.60),
    "high-pressure": Load(40.0, 300.0, 0.50, 0.60, 0.5, 8.0, 0.96, 8, 6, 400.0, 0.92, 0.85),
}
LOADS["stalled"] = LOADS["high-pressure"]


class Sequence:
    """The exposition(s) of one engine running one kind of load, as a function of time (seconds)."""

    def __init__(self, engine: str, kind: str, start_time: float = 1.79e9):
        if engine not in ENGINES or kind not in KINDS:
            raise ValueError(f"{engine}/{kind}")
        self.engine, self.kind, self.load, self.start_time = engine, kind, LOADS[kind], start_time

    def state(self, t: float) -> dict[str, float]:
        """Cumulative counters (tokens, steps) and gauges at ``t`` (the neutral quantities every engine
        renders in its own series)."""
        ld = self.load
        busy = min(t, STALL_AT) if self.kind == "stalled" else t  # seconds the engine has been stepping
        stalled = self.kind == "stalled" and t > STALL_AT
        prompt = ld.prompt_tps * busy
        cached = prompt * ld.cached_share
        store = ld.store_tps * busy
        return {
            "generation": ld.generation_tps * busy, "prompt": prompt, "compute": prompt - cached,
            "cached": cached, "cached_host": cached * ld.host_share, "cached_device": cached * (1 - ld.host_share),
            "preemptions": math.floor(ld.preemptions_per_second * busy),
            "steps": math.floor(ld.steps_per_second * busy),
            "store": store, "load": cached * ld.host_share,
            "kv_usage": ld.kv_usage if stalled else min(ld.kv_usage + 0.03 * math.sin(t), 1.0),
            "running": ld.running, "waiting": ld.waiting + (min(t - STALL_AT, 14.0) if stalled else 0.0),
            "occupancy": ld.occupancy, "host_hit": ld.host_hit,
        }

    def texts(self, t: float) -> dict[str, str]:
        s = self.state(t)
        return RENDER[self.engine](s, self.start_time)


# --- the exposition format, as prometheus_client writes it -------------------------------------------------
def _labels(lab: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in lab.items()) + "}" if lab else ""


def family(out: list[str], name: str, kind: str, help_text: str, samples: list[tuple[dict, float]]) -> None:
    """# HELP, # TYPE and the samples of one family (counters as ``name`` ending in ``_total``)."""
    out.append(f"# HELP {name} {help_text}")
    out.append(f"# TYPE {name} {kind}")
    out.extend(f"{name}{_labels(lab)} {float(v)!r}" for lab, v in samples)


def histogram_count(out: list[str], name: str, help_text: str, lab: dict, count: float, total: float) -> None:
    """A histogram reduced to its +Inf bucket, _count and _sum (what a rate over _count reads)."""
    out.append(f"# HELP {name} {help_text}")
    out.append(f"# TYPE {name} histogram")
    out.append(f"{name}_bucket{_labels({**lab, 'le': '+Inf'})} {float(count)!r}")
    out.append(f"{name}_count{_labels(lab)} {float(count)!r}")
    out.append(f"{name}_sum{_labels(lab)} {float(total)!r}")


def _process(out: list[str], start_time: float) -> None:
    family(out, "process_start_time_seconds", "gauge", "Start time of the process since unix epoch in seconds.",
           [({}, start_time)])


def _text(out: list[str]) -> str:
    return "\n".join(out) + "\n"


# --- SGLang (python/sglang/srt/observability/metrics_collector.py) ------------------------------------------
def sglang(s: dict, start_time: float, prefix: str = "sglang:") -> dict[str, str]:
    """The scheduler's series for tp_rank 0 and its tensor-parallel twin tp_rank 1 (the same figures: the
    adapter must not count them twice), the tokenizer manager's, the radix cache's and HiCache's."""
    out: list[str] = []
    _process(out, start_time)
    ranks = [{"model_name": MODEL, "engine_type": "unified", "tp_rank": str(r), "pp_rank": "0", "moe_ep_rank": "0"}
             for r in (0, 1)]
    tok = {"model_name": MODEL}
    p = prefix

    def per_rank(value):
        return [(lab, value) for lab in ranks]

    family(out, p + "num_running_reqs", "gauge", "The number of running requests.", per_rank(s["running"]))
    family(out, p + "num_used_tokens", "gauge", "The number of used tokens.",
           per_rank(round(s["kv_usage"] * 500_000)))
    family(out, p + "token_usage", "gauge", "The token usage.", per_rank(s["kv_usage"]))
    family(out, p + "num_queue_reqs", "gauge", "The number of requests in the waiting queue.",
           per_rank(s["waiting"]))
    family(out, p + "max_total_num_tokens", "gauge", "Maximum total number of tokens in the KV cache pool.",
           per_rank(500_000))
    family(out, p + "num_retracted_requests_total", "counter", "Total number of retracted requests.",
           per_rank(s["preemptions"]))
    family(out, p + "num_retracted_input_tokens_total", "counter", "Total number of retracted input tokens.",
           per_rank(s["preemptions"] * 900))
    family(out, p + "realtime_tokens_total", "counter",
           "Total number of tokens processed (updated on each log interval). "
           "mode: prefill_compute, prefill_cache, decode.",
           [({**lab, "mode": m}, v) for lab in ranks for m, v in
            (("prefill_compute", s["compute"]), ("prefill_cache", s["cached"]), ("decode", s["generation"]))])
    family(out, p + "cuda_graph_passes_total", "counter", "Total number of forward passes categorized by CUDA graph.",
           [({**lab, "mode": m}, v) for lab in ranks for m, v in
            (("decode_cuda_graph", s["steps"] - s["steps"] // 10), ("decode_none", s["steps"] // 10))])
    family(out, p + "hicache_host_used_tokens", "gauge", "Number of tokens currently used in the host KV cache.",
           [(ranks[0], round(s["occupancy"] * HOST_TOKENS))])
    family(out, p + "hicache_host_total_tokens", "gauge", "Total capacity of the host KV cache in tokens.",
           [(ranks[0], HOST_TOKENS)])
    family(out, p + "cache_config_info", "gauge", "Cache configuration information.",
           [({"page_size": "64", "num_pages": "7812"}, 1)])
    family(out, p + "prompt_tokens_total", "counter", "Number of prefill tokens processed.", [(tok, s["prompt"])])
    family(out, p + "generation_tokens_total", "counter", "Number of generation tokens processed.",
           [(tok, s["generation"])])
    family(out, p + "cached_tokens_total", "counter", "Number of cached prompt tokens by source (device/host/storage).",
           [({**tok, "cache_source": "device"}, s["cached_device"]),
            ({**tok, "cache_source": "host"}, s["cached_host"])])
    family(out, p + "evicted_tokens_total", "counter", "The number of tokens evicted from GPU to CPU.",
           [(ranks[0], s["store"])])
    family(out, p + "load_back_tokens_total", "counter", "The number of tokens loaded from CPU to GPU.",
           [(ranks[0], s["load"])])
    return {"": _text(out)}


# --- TensorRT-LLM (tensorrt_llm/metrics/collector.py) ------------------------------------------------------
def trtllm(s: dict, start_time: float) -> dict[str, str]:
    out: list[str] = []
    _process(out, start_time)
    lab = {"model_name": MODEL, "engine_type": "trtllm"}
    blocks = 31_250  # device pool: 500k tokens / 16 per block
    host_blocks = HOST_TOKENS // 32
    tpb = 32
    family(out, "trtllm_prompt_tokens_total", "counter", "Cumulative number of prompt (input) tokens processed.",
           [(lab, s["prompt"])])
    family(out, "trtllm_generation_tokens_total", "counter",
           "Cumulative number of generation (output) tokens produced.", [(lab, s["generation"])])
    family(out, "trtllm_prompt_cached_tokens_total", "counter",
           "Cumulative number of prompt tokens served from the KV cache.", [(lab, s["cached"])])
    family(out, "trtllm_kv_cache_utilization", "gauge", "KV cache utilization", [(lab, s["kv_usage"])])
    family(out, "trtllm_kv_cache_host_utilization", "gauge", "KV cache host (secondary) pool utilization",
           [(lab, s["occupancy"])])
    family(out, "trtllm_kv_cache_reused_blocks_total", "counter",
           "Cumulative number of KV cache blocks reused (cache hits)", [(lab, s["cached"] // tpb)])
    family(out, "trtllm_kv_cache_missed_blocks_total", "counter",
           "Cumulative number of KV cache blocks missed (cache misses)", [(lab, s["compute"] // tpb)])
    family(out, "trtllm_kv_cache_onboard_bytes_total", "counter", "Total bytes transferred from host to GPU (onboard)",
           [(lab, s["load"] * KV_BYTES_PER_TOKEN)])
    family(out, "trtllm_kv_cache_offload_bytes_total", "counter", "Total bytes transferred from GPU to host (offload)",
           [(lab, s["store"] * KV_BYTES_PER_TOKEN)])
    family(out, "trtllm_num_requests_running", "gauge", "Number of active requests", [(lab, s["running"])])
    family(out, "trtllm_num_requests_waiting", "gauge", "Number of queued requests", [(lab, s["waiting"])])
    family(out, "trtllm_num_paused_requests", "gauge", "Number of paused requests", [(lab, 0)])
    family(out, "trtllm_iteration_latency_seconds", "gauge", "Iteration latency in seconds",
           [(lab, 0.1)])
    family(out, "trtllm_kv_cache_max_blocks", "gauge", "Maximum number of KV cache blocks", [(lab, blocks)])
    family(out, "trtllm_kv_cache_used_blocks", "gauge", "Number of used KV cache blocks",
           [(lab, round(s["kv_usage"] * blocks))])
    family(out, "trtllm_kv_cache_free_blocks", "gauge", "Number of free KV cache blocks",
           [(lab, blocks - round(s["kv_usage"] * blocks))])
    family(out, "trtllm_kv_cache_tokens_per_block", "gauge", "Number of tokens per KV cache block", [(lab, tpb)])
    family(out, "trtllm_kv_cache_host_max_blocks", "gauge", "Capacity of the KV cache host (secondary) pool, in blocks",
           [(lab, host_blocks)])
    return {"": _text(out)}


# --- vLLM as LMCache's and Dynamo's backend (docs/vllm-metrics.md; vLLM 0.32 names) ---------------------------
def vllm(s: dict, start_time: float, external: bool) -> list[str]:
    """The vLLM series kvwatt reads, one engine; ``external``: prompt tokens loaded by the KV connector
    (LMCache, KVBM) count as external_kv_transfer, as vLLM counts them."""
    out: list[str] = []
    _process(out, start_time)
    lab = {"engine": "0", "model_name": MODEL}
    ext = s["cached_host"] if external else 0.0
    family(out, "vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
           [(lab, s["running"])])
    family(out, "vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
           [(lab, s["waiting"])])
    family(out, "vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
           [(lab, s["kv_usage"])])
    family(out, "vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.",
           [(lab, s["preemptions"])])
    family(out, "vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", [(lab, s["prompt"])])
    family(out, "vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
           [(lab, s["generation"])])
    family(out, "vllm:prompt_tokens_by_source_total", "counter", "Number of prompt tokens by source.",
           [({**lab, "source": "local_compute"}, s["compute"]),
            ({**lab, "source": "local_cache_hit"}, s["cached"] - ext),
            ({**lab, "source": "external_kv_transfer"}, ext)])
    histogram_count(out, "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", lab,
                    s["steps"], s["generation"] + s["compute"])
    family(out, "vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
           [({"block_size": str(BLOCK_TOKENS), "engine": "0", "kv_offloading_backend": "native",
              "kv_offloading_size": "None", "num_gpu_blocks": "31250"}, 1)])
    return out


# --- LMCache (lmcache/observability.py) ---------------------------------------------------------------------
def lmcache(s: dict, start_time: float) -> dict[str, str]:
    """vLLM's /metrics, and LMCache's own port (the sidecar) with two tensor-parallel workers: each holds its
    shard's bytes, both retrieve the same tokens."""
    side: list[str] = []
    _process(side, start_time + 3)  # LMCache's API server: another process
    workers = [{"model_name": MODEL, "worker_id": str(w)} for w in (0, 1)]

    def each(v):
        return [(lab, v) for lab in workers]

    family(side, "lmcache:num_retrieve_requests_total", "counter", "Total number of retrieve requests sent to lmcache",
           each(s["steps"] // 4))
    family(side, "lmcache:num_requested_tokens_total", "counter", "Total number of tokens requested from lmcache",
           each(s["prompt"]))
    family(side, "lmcache:num_hit_tokens_total", "counter", "Total number of tokens hit in lmcache", each(s["load"]))
    family(side, "lmcache:num_stored_tokens_total", "counter",
           "Total number of tokens stored in lmcache including evicted ones", each(s["store"]))
    family(side, "lmcache:num_lookup_tokens_total", "counter",
           "Total number of tokens requested in lookup from lmcache",
           each(s["prompt"]))
    family(side, "lmcache:num_lookup_hits_total", "counter", "Total number of tokens hit in lookup from lmcache",
           each(s["load"]))
    family(side, "lmcache:num_vllm_hit_tokens_total", "counter", "Number of hit tokens in vllm",
           each(s["cached_device"]))
    family(side, "lmcache:local_cpu_evict_count_total", "counter", "Total number of evict in local cpu backend",
           each(s["preemptions"] * 3))
    family(side, "lmcache:local_cpu_evict_failed_count_total", "counter",
           "Total number of failed eviction in local cpu backend", each(0))
    family(side, "lmcache:local_cache_usage", "gauge", "Local cache usage (bytes) of lmcache",
           each(s["occupancy"] * HOST_TOKENS * KV_BYTES_PER_TOKEN / 2))
    family(side, "lmcache:retrieve_hit_rate", "gauge", "Hit rate of lmcache retrieve requests since last log",
           each(s["host_hit"]))
    return {"": _text(vllm(s, start_time, external=True)), "sidecar": _text(side)}


# --- Dynamo (lib/runtime/src/metrics/prometheus_names.rs: kvstats, kvbm) ------------------------------------
def dynamo(s: dict, start_time: float) -> dict[str, str]:
    """A Dynamo vLLM worker's /metrics (its backend's series and dynamo_component_kvstats_*) and KVBM's own port
    (the sidecar): the Rust prometheus crate writes counters under their own names, no _total added."""
    worker = vllm(s, start_time, external=True)
    comp = {"dp_rank": "0", "dynamo_namespace": "dynamo", "dynamo_component": "backend"}
    total = 31_250
    family(worker, "dynamo_component_kvstats_active_blocks", "gauge",
           "Number of active KV cache blocks currently in use", [(comp, round(s["kv_usage"] * total))])
    family(worker, "dynamo_component_kvstats_total_blocks", "gauge", "Total number of KV cache blocks available",
           [(comp, total)])
    family(worker, "dynamo_component_kvstats_gpu_cache_usage_percent", "gauge",
           "GPU cache usage as a percentage (0.0-1.0).", [(comp, s["kv_usage"])])
    family(worker, "dynamo_component_kvstats_gpu_prefix_cache_hit_rate", "gauge",
           "GPU prefix cache hit rate as a percentage (0.0-1.0).", [(comp, s["cached_device"] / max(s["prompt"], 1))])
    side: list[str] = []
    family(side, "kvbm_offload_blocks_d2h", "counter", "The number of offload blocks from device to host",
           [({}, s["store"] // BLOCK_TOKENS)])
    family(side, "kvbm_offload_blocks_h2d", "counter", "The number of offload blocks from host to disk",
           [({}, s["store"] // (4 * BLOCK_TOKENS))])
    family(side, "kvbm_offload_blocks_d2d", "counter",
           "The number of offload blocks from device to disk (bypassing host memory)", [({}, 0)])
    family(side, "kvbm_onboard_blocks_h2d", "counter", "The number of onboard blocks from host to device",
           [({}, s["load"] // BLOCK_TOKENS)])
    family(side, "kvbm_onboard_blocks_d2d", "counter", "The number of onboard blocks from disk to device",
           [({}, 0)])
    family(side, "kvbm_matched_tokens", "counter", "The number of matched tokens", [({}, s["load"])])
    family(side, "kvbm_host_cache_hit_rate", "gauge", "Host cache hit rate (0.0-1.0) from the sliding window",
           [({}, s["host_hit"])])
    family(side, "kvbm_disk_cache_hit_rate", "gauge", "Disk cache hit rate (0.0-1.0) from the sliding window",
           [({}, s["host_hit"] / 4)])
    return {"": _text(worker), "sidecar": _text(side)}


RENDER = {"sglang": sglang, "trtllm": trtllm, "lmcache": lmcache, "dynamo": dynamo}
