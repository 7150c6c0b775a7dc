"""Offloading, four sections: its traffic (transfer rates, the buffer's use, tiers; methods.md s6), the buffer's
sizing (s6), the collapse signature (s5), its economics (dE and dTPS by baseline, s2; kappa, s7); and the
advice's JSON (exporter.model.advice), which rests on these and the regime."""

from __future__ import annotations

from typing import Iterator

from exporter.catalog import bounds
from exporter.catalog.declare import (
    Fill,
    MetricDef,
    Sample,
    Section,
    Words,
    flag,
    judged,
    per_server,
    reading,
    series_value,
    server_block,
    server_key,
    window_block,
    window_key,
)
from exporter.figures import ServerFigures, Snapshot, WindowFigures

TRAFFIC_SECTION = "Offload traffic"
BUFFER_SECTION = "Offload buffer sizing"
COLLAPSE_SECTION = "Collapse"
ECONOMICS_SECTION = "Offload economics"


def _tier_hits(snap: Snapshot) -> Iterator[Sample]:
    for s in snap.servers:
        for tier, ratio in sorted((s.tiers.hit_ratio or {}).items()):
            yield (s.name, tier), ratio


def _residency_target(snap: Snapshot) -> Iterator[Sample]:
    for s in snap.servers:
        if s.buffer is not None and s.info and s.info.offload_enabled:
            yield (s.name, s.buffer.residency_target_source), s.buffer.residency_target_seconds


def _tiers(attr: str) -> Fill:
    def fill(snap: Snapshot) -> Iterator[Sample]:
        for s in snap.servers:
            for w in s.windows:
                for t in w.offload_tiers:
                    yield (s.name, t.tier, w.window), series_value(getattr(t, attr))
    return fill


def _buffer(attr: str) -> Fill:
    return per_server(lambda s: getattr(s.buffer, attr) if s.buffer and s.info and s.info.offload_enabled else None)


def _conditions(snap: Snapshot) -> Iterator[Sample]:
    for s in snap.servers:
        if s.collapse is not None:
            for name, value in s.collapse.conditions.items():
                yield (s.name, name), flag(value)


def _condition_sets(snap: Snapshot) -> Iterator[Sample]:
    for s in snap.servers:
        if s.collapse is not None:
            for name, value in s.collapse.condition_sets.items():
                yield (s.name, name), flag(value)


def _savings(get, *, throughput_only: bool = False) -> Fill:
    """One sample per server, baseline and window of a SavingFigure attribute; ``throughput_only``: only the
    baselines that measure a throughput."""
    def fill(snap: Snapshot) -> Iterator[Sample]:
        for s in snap.servers:
            for w in s.windows:
                for sv in w.savings:
                    if not throughput_only or sv.has_throughput:
                        yield (s.name, sv.baseline, w.window), get(sv)
    return fill


# what offloading moves: transfer rates, the buffer's use and residency, each tier's flows (methods.md s6)
TRAFFIC: tuple[MetricDef, ...] = (
    MetricDef(
        name="kvwatt_offload_enabled", type="gauge", labels=("server",),
        help="1 when the server offloads KV to host memory (vLLM: cache_config_info or offload series; SGLang "
             "HiCache, TensorRT-LLM host tier, LMCache, Dynamo KVBM series: docs/engines.md).",
        computes=reading("sources.vllm.extract"),
        section=TRAFFIC_SECTION,
        status=server_key("offload_enabled", lambda s: s.info.offload_enabled if s.info else None),
        bounds=bounds.BOOLEAN,
    ),
    MetricDef(
        name="kvwatt_offload_buffer_bytes", type="gauge", labels=("server",),
        help="Configured host offload buffer (kv_offloading_size GiB, or kv_offload_config_info on 0.33).",
        computes=reading("sources.vllm.extract"),
        section=TRAFFIC_SECTION,
        status=server_key("offload_buffer_bytes", lambda s: s.info.offload_buffer_bytes if s.info else None),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_offload_write_bytes_per_second", type="gauge", labels=("server", "window"),
        help="Store rate GPU -> offload tier over the window.",
        computes="derive.offload.transfer_rates",
        section=TRAFFIC_SECTION,
        status=window_key("offload_write_bytes_per_second", lambda w: w.offload_write_bytes_per_second),
        words=(Words("offload writes", "bytes_per_second"),),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_offload_read_bytes_per_second", type="gauge", labels=("server", "window"),
        help="Load rate offload tier -> GPU over the window.",
        computes="derive.offload.transfer_rates",
        section=TRAFFIC_SECTION,
        status=window_key("offload_read_bytes_per_second", lambda w: w.offload_read_bytes_per_second),
        words=(Words("offload reads", "bytes_per_second"),),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_offload_write_tokens_per_second", type="gauge", labels=("server", "window"),
        help="Offload stores counted in tokens over the window (engines that count tokens: SGLang HiCache evictions "
             "to host, LMCache stored tokens, Dynamo KVBM blocks x block size).",
        computes="derive.offload.token_rates",
        section=TRAFFIC_SECTION,
        status=window_key("offload_write_tokens_per_second", lambda w: w.offload_write_tokens_per_second),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_offload_read_tokens_per_second", type="gauge", labels=("server", "window"),
        help="Offload loads counted in tokens over the window (SGLang load-back, LMCache hits retrieved, Dynamo KVBM "
             "matched tokens).",
        computes="derive.offload.token_rates",
        section=TRAFFIC_SECTION,
        status=window_key("offload_read_tokens_per_second", lambda w: w.offload_read_tokens_per_second),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_offload_buffer_used_ratio", type="gauge", labels=("server",),
        help="Offload buffer occupancy as the engine last reported it: used / capacity (SGLang "
             "hicache_host_used_tokens / hicache_host_total_tokens, TensorRT-LLM kv_cache_host_utilization). Never "
             "vLLM's kv_offload_cpu_cache_usage_perc, which is the share pinned by transfers.",
        computes="derive.offload.tier_state",
        section=TRAFFIC_SECTION,
        status=server_key("offload_buffer_used_ratio", lambda s: s.tiers.used_ratio),
        bounds=bounds.SHARE,
    ),
    MetricDef(
        name="kvwatt_offload_buffer_used_bytes", type="gauge", labels=("server",),
        help="Bytes of KV held in the offload buffer as the engine last reported them (LMCache local_cache_usage, "
             "summed over workers; LMCache exports no capacity, so no ratio).",
        computes="derive.offload.tier_state",
        section=TRAFFIC_SECTION,
        status=server_key("offload_buffer_used_bytes", lambda s: s.tiers.used_bytes),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_offload_tier_hit_ratio", type="gauge", labels=("server", "tier"),
        help="The engine's own recent hit rate of an offload tier (host, disk), as last reported (Dynamo KVBM's "
             "sliding window).",
        computes="derive.offload.tier_state",
        section=TRAFFIC_SECTION,
        fill=_tier_hits,
        status=server_key("offload_tier_hit_ratio", lambda s: s.tiers.hit_ratio),
        bounds=bounds.SHARE,
    ),
    MetricDef(
        name="kvwatt_offload_buffer_residency_seconds", type="gauge", labels=("server", "window"),
        help="Buffer bytes / write rate: how long an offloaded block survives (methods.md s6); in tokens for an "
             "engine that counts them (SGLang HiCache host pool / tokens backed up to it per second).",
        computes="derive.offload.residency",
        section=TRAFFIC_SECTION,
        status=window_key("offload_buffer_residency_seconds", lambda w: w.offload_buffer_residency_seconds),
        words=(Words("buffer residency", "seconds"),),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_offload_tier_write_bytes_per_second", type="gauge", labels=("server", "tier", "window"),
        help="vLLM tiering (0.28+): bytes/s written from the primary CPU tier to a secondary tier (tier = "
             "\"<index>:<type>\", e.g. \"1:fs\") over the window (vllm:kv_offload_tiering_write_bytes_total).",
        computes="derive.offload.tier_flows",
        section=TRAFFIC_SECTION,
        fill=_tiers("write_bytes_per_second"),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_offload_tier_read_bytes_per_second", type="gauge", labels=("server", "tier", "window"),
        help="vLLM tiering: bytes/s read from a secondary tier back into the primary tier (promotions) over the "
             "window (vllm:kv_offload_tiering_read_bytes_total).",
        computes="derive.offload.tier_flows",
        section=TRAFFIC_SECTION,
        fill=_tiers("read_bytes_per_second"),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_offload_tier_chunk_hit_ratio", type="gauge", labels=("server", "tier", "window"),
        help="vLLM tiering: chunk lookups that hit in the tier / lookups sent to it over the window.",
        computes="derive.offload.tier_flows",
        section=TRAFFIC_SECTION,
        fill=_tiers("chunk_hit_ratio"),
        bounds=bounds.SHARE,
    ),
    MetricDef(
        name="kvwatt_offload_tier_job_failures", type="gauge", labels=("server", "tier", "window"),
        help="vLLM tiering: failed promotion (read) and cascade (write) jobs of the tier in the window.",
        computes="derive.offload.tier_flows",
        section=TRAFFIC_SECTION,
        fill=_tiers("job_failures"),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_offload_tier_residency_seconds", type="gauge", labels=("server", "tier", "window"),
        help="vLLM tiering: the tier's configured capacity (servers[].offload_tier_bytes: vLLM exports none) / its "
             "write rate: how long a block written to it survives (methods.md s6).",
        computes="derive.offload.tier_flows",
        section=TRAFFIC_SECTION,
        fill=_tiers("residency_seconds"),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_offload_tier_undersized", type="gauge", labels=("server", "tier", "window"),
        help="vLLM tiering: 1 when the tier's residency is below the p99 tool-call latency or one of its promotion "
             "or cascade jobs failed in the window (the CPU tier's flag is kvwatt_offload_buffer_undersized).",
        computes="derive.offload.tier_flows",
        section=TRAFFIC_SECTION,
        fill=_tiers("undersized"),
        bounds=bounds.BOOLEAN,
    ),
    MetricDef(
        name="kvwatt_offload_tier_dropped_stores_per_second", type="gauge", labels=("server", "tier", "window"),
        help="vLLM tiering: stores (cascade jobs) bound for the tier that its back-pressure detector dropped, per "
             "second over the window (vllm:kv_offload_tiering_backpressure_stores_dropped_total; 0 where the "
             "engine counts drops and this tier had none).",
        computes="derive.offload.tier_flows",
        section=TRAFFIC_SECTION,
        fill=_tiers("dropped_stores_per_second"),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_offload_tier_dropped_blocks_per_second", type="gauge", labels=("server", "tier", "window"),
        help="vLLM tiering: KV blocks bound for the tier that its back-pressure detector dropped (the tier too slow "
             "for the write rate: those blocks will never be served from it), per second over the window "
             "(vllm:kv_offload_tiering_backpressure_blocks_dropped_total).",
        computes="derive.offload.tier_flows",
        section=TRAFFIC_SECTION,
        fill=_tiers("dropped_blocks_per_second"),
        bounds=bounds.NON_NEGATIVE,
    ),
)


# whether the offload buffer is big enough, and the size it should be (methods.md s6)
BUFFER: tuple[MetricDef, ...] = (
    MetricDef(
        name="kvwatt_offload_buffer_undersized", type="gauge", labels=("server",),
        help="1 when residency is below the configured p99 tool-call latency, or stores fail.",
        computes="derive.offload.undersized",
        section=BUFFER_SECTION,
        fill=_buffer("undersized"),
        bounds=bounds.BOOLEAN,
    ),
    MetricDef(
        name="kvwatt_offload_recommended_buffer_bytes", type="gauge", labels=("server",),
        help="Buffer size that keeps residency above the p99 tool-call latency with the configured headroom.",
        computes="derive.offload.recommended_buffer",
        section=BUFFER_SECTION,
        fill=_buffer("recommended_bytes"),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_offload_buffer_residency_target_seconds", type="gauge", labels=("server", "source"),
        help="The residency the offload buffer must outlast in kvwatt_offload_buffer_undersized and "
             "kvwatt_offload_recommended_buffer_bytes: the measured KV-block reuse-gap p99 (source=reuse_gap_p99, "
             "vLLM --kv-cache-metrics) or the configured p99 tool-call latency (source=p99_tool_latency).",
        computes=judged("model.offload.residency_target",
                        why="a choice between the measured reuse-gap p99 and the configured p99 tool-call latency, "
                            "made where both are at hand"),
        section=BUFFER_SECTION,
        fill=_residency_target,
        bounds=bounds.NON_NEGATIVE,
    ),
)


# the collapse signature and its conditions (methods.md s5)
COLLAPSE: tuple[MetricDef, ...] = (
    MetricDef(
        name="kvwatt_collapse_signature", type="gauge", labels=("server",),
        help="1 while the collapse signature holds (methods.md s5): one of its condition sets holds "
             "(kvwatt_collapse_condition_set says which).",
        computes="derive.collapse.evaluate_aggregates",
        section=COLLAPSE_SECTION,
        fill=per_server(lambda s: flag(s.collapse.signature) if s.collapse else None),
        bounds=bounds.BOOLEAN,
    ),
    MetricDef(
        name="kvwatt_collapse_condition_set", type="gauge", labels=("server", "condition_set"),
        help="Each condition set of the collapse signature: stalled_engine (engine steps, and the token counters with "
             "them, stopped while requests are pending; only where the engine exports a step counter) and classic "
             "(all five throughput conditions). 1 holds, 0 not; absent while unknown.",
        computes="derive.collapse.evaluate_aggregates",
        section=COLLAPSE_SECTION,
        fill=_condition_sets,
        bounds=bounds.BOOLEAN,
    ),
    MetricDef(
        name="kvwatt_collapse_condition", type="gauge", labels=("server", "condition"),
        help="Each collapse condition on its own: offload_enabled, zero_preemptions, throughput_collapsed, "
             "power_near_idle, requests_pending (classic), engine_steps_stopped (stalled_engine, with "
             "requests_pending).",
        computes="derive.collapse.evaluate_aggregates",
        section=COLLAPSE_SECTION,
        fill=_conditions,
        bounds=bounds.BOOLEAN,
    ),
)


# whether offloading pays: dE and dTPS by baseline (methods.md s2), kappa and the break-even (s7)
ECONOMICS: tuple[MetricDef, ...] = (
    MetricDef(
        name="kvwatt_energy_saving_ratio", type="gauge", labels=("server", "baseline", "window"),
        help="dE as a ratio (0.26 = 26 % less energy per token with offloading, methods.md s2): 1 - J/token ON over "
             "J/token OFF, each total energy over total tokens in the window. baseline=estimated "
             "is a model estimate, baseline=potential the saving a server without offloading would see with it (a "
             "model estimate too), see docs/offload.md.",
        computes=("derive.economics.paired", "derive.economics.recorded", "derive.economics.estimated",
                  "derive.economics.potential"),  # one formula per kind, the label baseline= (methods.md s2)
        section=ECONOMICS_SECTION,
        fill=_savings(lambda sv: sv.energy_saving),
        bounds=bounds.SAVING,
    ),
    MetricDef(
        name="kvwatt_energy_saving_stderr_ratio", type="gauge", labels=("server", "baseline", "window"),
        help="Standard error of dE (jackknife over the repeat windows, methods.md s2), where there are repeats.",
        computes=("derive.economics.paired", "derive.economics.recorded", "derive.economics.estimated",
                  "derive.economics.potential"),  # one formula per kind, the label baseline= (methods.md s2)
        section=ECONOMICS_SECTION,
        fill=_savings(lambda sv: sv.energy_saving_stderr),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_throughput_gain_ratio", type="gauge", labels=("server", "baseline", "window"),
        help="dTPS as a ratio (methods.md s2).",
        computes=("derive.economics.paired", "derive.economics.recorded"),  # the kinds that measure a throughput
        section=ECONOMICS_SECTION,
        fill=_savings(lambda sv: sv.throughput_gain, throughput_only=True),
        bounds=bounds.GAIN,
    ),
    MetricDef(
        name="kvwatt_throughput_gain_stderr_ratio", type="gauge", labels=("server", "baseline", "window"),
        help="Standard error of dTPS (jackknife over the repeat windows), where there are repeats.",
        computes=("derive.economics.paired", "derive.economics.recorded"),  # the kinds that measure a throughput
        section=ECONOMICS_SECTION,
        fill=_savings(lambda sv: sv.throughput_gain_stderr, throughput_only=True),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_comparison_windows", type="gauge", labels=("server", "baseline", "window"),
        help="Number of windows the dE/dTPS comparison rests on.",
        computes=("derive.economics.paired", "derive.economics.recorded", "derive.economics.estimated",
                  "derive.economics.potential"),  # one formula per kind, the label baseline= (methods.md s2)
        section=ECONOMICS_SECTION,
        fill=_savings(lambda sv: sv.windows if sv.energy_saving is not None else None),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_cached_to_prefill_ratio", type="gauge", labels=("server", "window"),
        help="kappa observed: external_kv_transfer / local_compute prompt tokens over the window (methods.md s7).",
        computes="derive.kappa.observed",
        section=ECONOMICS_SECTION,
        status=window_key("cached_to_prefill_ratio", lambda w: w.cached_to_prefill_ratio),
        words=(Words("cached-to-prefill ratio (kappa)", "number"),),
        bounds=bounds.UNBOUNDED_RATIO,
    ),
    MetricDef(
        name="kvwatt_critical_cached_to_prefill_ratio", type="gauge", labels=("server",),
        help="kappa_crit from model and hardware parameters (roofline form, methods.md s7).",
        computes="derive.kappa.critical",
        section=ECONOMICS_SECTION,
        fill=per_server(lambda s: s.kappa.critical),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_recompute_breakeven_tokens", type="gauge", labels=("server",),
        help="Sequence length above which reloading KV beats recomputing it (Tetris form with GQA width, methods.md "
             "s7).",
        computes="derive.kappa.breakeven",
        section=ECONOMICS_SECTION,
        fill=per_server(lambda s: s.kappa.breakeven_tokens),
        bounds=bounds.NON_NEGATIVE,
    ),
)


# --------------------------------------------------------------------------------------------------------------
# issue 41 items 2-3: a second tier (GPU -> CPU -> disk). The tiering failures apart (failed promotions and
# cascades per tier) and each tier's reloads priced against a recompute (methods.md s14): the price of a
# reloaded token per tier, the break-even, kappa per tier, the reload energy and the net saving per tier, and
# dE of adding the second tier. One block, so it can move as a whole; all opt-in (exporter/rules/optin.py: per tier
# and window; the alerts read vLLM's own failure counters, /api/status carries them all).
# --------------------------------------------------------------------------------------------------------------
def _tier_energy(attr: str) -> Fill:
    def fill(snap: Snapshot) -> Iterator[Sample]:
        for s in snap.servers:
            for w in s.windows:
                for t in w.offload_tier_energy:  # priced on the gpu scope, or unpriced (scope "")
                    if t.scope in ("gpu", ""):
                        yield (s.name, t.tier, w.window), getattr(t, attr)
    return fill


TIERED: tuple[MetricDef, ...] = (
    MetricDef(
        name="kvwatt_offload_tier_failed_promotions_per_second", type="gauge", labels=("server", "tier", "window"),
        help="vLLM tiering: failed promotion jobs (the tier -> the CPU tier) per second over the window "
             "(vllm:kv_offload_tiering_promotion_job_failures_total; 0 where the tier moved data and vLLM has no "
             "sample yet: it has none until the first failure).",
        computes="derive.offload.tier_flows",
        section=TRAFFIC_SECTION,
        fill=_tiers("failed_promotions_per_second"),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_offload_tier_failed_cascades_per_second", type="gauge", labels=("server", "tier", "window"),
        help="vLLM tiering: failed cascade jobs (the CPU tier -> the tier) per second over the window "
             "(vllm:kv_offload_tiering_cascade_job_failures_total; 0 where the tier moved data and vLLM has no "
             "sample yet).",
        computes="derive.offload.tier_flows",
        section=TRAFFIC_SECTION,
        fill=_tiers("failed_cascades_per_second"),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_offload_tier_reload_joules_per_token", type="gauge", labels=("server", "tier", "window"),
        help="The price of a prompt token reloaded from an offload tier (tier = the cached-token source: host, "
             "disk), methods.md s14: the GPU's J per reloaded token (kvwatt_phase_joules_per_token) plus the bytes "
             "it moves x the configured J/byte of each hop (host DRAM, the host link, the disk; configured, not "
             "measured: /api/status hop_source).",
        computes="derive.tier_energy.tier_energy",
        section=TRAFFIC_SECTION,
        fill=_tier_energy("reload_joules_per_token"),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_offload_tier_breakeven_ratio", type="gauge", labels=("server", "tier", "window"),
        help="The break-even of a reload from the tier against a recompute, methods.md s14: its price "
             "(kvwatt_offload_tier_reload_joules_per_token) / the GPU's J per computed prompt token. Below 1 a "
             "reload from the tier saves energy; above 1 recomputing is cheaper.",
        computes="derive.tier_energy.tier_energy",
        section=TRAFFIC_SECTION,
        fill=_tier_energy("breakeven_ratio"),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_offload_tier_cached_to_prefill_ratio", type="gauge", labels=("server", "tier", "window"),
        help="kappa per tier (methods.md s7, s14): prompt tokens served from the tier / computed (local_compute) "
             "prompt tokens over the window (vllm:prompt_tokens_cached_by_source_total).",
        computes="derive.tier_energy.tier_energy",
        section=TRAFFIC_SECTION,
        fill=_tier_energy("cached_to_prefill"),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_offload_tier_reload_watts", type="gauge", labels=("server", "tier", "window"),
        help="What the tier's reloads cost beyond the GPU (methods.md s14): its tokens/s x the bytes each moves x "
             "the configured J/byte of its hops (host DRAM and the link; the disk's read and DRAM write too).",
        computes="derive.tier_energy.tier_energy",
        section=TRAFFIC_SECTION,
        fill=_tier_energy("reload_watts"),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_offload_tier_saved_watts", type="gauge", labels=("server", "tier", "window"),
        help="The tier's net saving against recomputing its tokens (methods.md s14): tokens/s x (J per computed - "
             "J per reloaded prompt token) on the GPU less kvwatt_offload_tier_reload_watts; over the tiers, saving "
             "plus reload W sum to kvwatt_offload_saved_watts{scope=\"gpu\"}. Below 0: the tier is dearer than a "
             "recompute.",
        computes="derive.tier_energy.tier_energy",
        section=TRAFFIC_SECTION,
        fill=_tier_energy("saved_watts"),
        bounds=bounds.TIER_SAVED_POWER,
    ),
    MetricDef(
        name="kvwatt_offload_second_tier_energy_saving_ratio", type="gauge", labels=("server", "window"),
        help="dE of adding the disk tier (methods.md s14): its net saving (kvwatt_offload_tier_saved_watts{tier="
             "\"disk\"}) / the GPU energy without it (the marginal power plus the disk tokens' computation less "
             "their reload). Positive: the disk tier pays for itself in energy.",
        computes="derive.tier_energy.second_tier_saving",
        section=TRAFFIC_SECTION,
        status=window_key("second_tier_energy_saving", lambda w: w.second_tier_energy_saving),
        words=(Words("dE of the disk tier", "percent", absent_when_none=True),),
        bounds=bounds.SAVING,
    ),
)


# issue 41 item 2: each tier's transfer times (vLLM's kv_offload_tiering_{read,write}_time, seconds summed over the
# tier's finished jobs): its read and write bandwidth, the seconds it spent transferring per second, and s7's
# kappa_crit with a reload from it (methods.md s14); its lookup delay (vLLM's lookup histograms). Opt-in like the
# other tier figures (/api/status offload_tiers).
TIER_TIMES: tuple[MetricDef, ...] = (
    MetricDef(
        name="kvwatt_offload_tier_read_bandwidth_bytes_per_second", type="gauge", labels=("server", "tier", "window"),
        help="vLLM tiering: the tier's read bandwidth, bytes read into the CPU tier / seconds its promotion jobs spent "
             "reading over the window (vllm:kv_offload_tiering_read_bytes_total / _read_time_total; per job: with "
             "parallel I/O threads the tier's aggregate is higher). Low: a reload from the tier is slow.",
        computes="derive.offload.tier_flows",
        section=TRAFFIC_SECTION,
        fill=_tiers("read_bandwidth_bytes_per_second"),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_offload_tier_write_bandwidth_bytes_per_second", type="gauge",
        labels=("server", "tier", "window"),
        help="vLLM tiering: the tier's write bandwidth, bytes written from the CPU tier / seconds its cascade jobs "
             "spent writing over the window (vllm:kv_offload_tiering_write_bytes_total / _write_time_total).",
        computes="derive.offload.tier_flows",
        section=TRAFFIC_SECTION,
        fill=_tiers("write_bandwidth_bytes_per_second"),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_offload_tier_read_seconds_per_second", type="gauge", labels=("server", "tier", "window"),
        help="vLLM tiering: seconds the tier's promotion jobs spent reading per second of the window "
             "(vllm:kv_offload_tiering_read_time_total): the mean number of reads in flight, above 1 with parallel "
             "jobs; near the tier's read threads its reads queue.",
        computes="derive.offload.tier_flows",
        section=TRAFFIC_SECTION,
        fill=_tiers("read_seconds_per_second"),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_offload_tier_write_seconds_per_second", type="gauge", labels=("server", "tier", "window"),
        help="vLLM tiering: seconds the tier's cascade jobs spent writing per second of the window "
             "(vllm:kv_offload_tiering_write_time_total): the mean number of writes in flight.",
        computes="derive.offload.tier_flows",
        section=TRAFFIC_SECTION,
        fill=_tiers("write_seconds_per_second"),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_offload_tier_critical_cached_to_prefill_ratio", type="gauge",
        labels=("server", "tier", "window"),
        help="kappa_crit of a reload from the tier (methods.md s7, s14): s7's roofline with the tier's measured read "
             "bandwidth then the host link in series, kvwatt_critical_cached_to_prefill_ratio x B_t / (B_t + B). "
             "Above it (kvwatt_offload_tier_cached_to_prefill_ratio) reloads from the tier outlast the compute.",
        computes="derive.kappa.tier_critical",
        section=TRAFFIC_SECTION,
        fill=_tiers("critical_cached_to_prefill"),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_offload_tier_lookup_seconds", type="gauge", labels=("server", "tier", "window"),
        help="vLLM tiering: the mean time the scheduler blocked in one of the tier's chunk lookups that resolved (hit "
             "or miss) over the window (vllm:kv_offload_tiering_lookup_sync_delay_seconds _sum / _count).",
        computes="derive.offload.tier_flows",
        section=TRAFFIC_SECTION,
        fill=_tiers("lookup_seconds"),
        bounds=bounds.NON_NEGATIVE,
    ),
    MetricDef(
        name="kvwatt_offload_tier_lookup_wait_seconds", type="gauge", labels=("server", "tier", "window"),
        help="vLLM tiering: the mean wait of a chunk lookup that the tier answered 'retry' (its asynchronous lookup, "
             "the fs tier's) until it resolved, over the window (vllm:kv_offload_tiering_lookup_async_delay_seconds "
             "_sum / _count): the lookup delay a prompt waits before a reload from the tier can start.",
        computes="derive.offload.tier_flows",
        section=TRAFFIC_SECTION,
        fill=_tiers("lookup_wait_seconds"),
        bounds=bounds.NON_NEGATIVE,
    ),
)


# --- the sections' JSON and the sections ----------------------------------------------------------------------------
def _tiers_json(w: WindowFigures) -> dict:
    return {"offload_tiers": {t.tier: {"write_bytes_per_second": t.write_bytes_per_second,
                                       "read_bytes_per_second": t.read_bytes_per_second,
                                       "chunk_hit_ratio": t.chunk_hit_ratio, "job_failures": t.job_failures,
                                       "residency_seconds": t.residency_seconds, "undersized": t.undersized,
                                       "dropped_stores_per_second": t.dropped_stores_per_second,
                                       "dropped_blocks_per_second": t.dropped_blocks_per_second,
                                       "failed_promotions_per_second": t.failed_promotions_per_second,
                                       "failed_cascades_per_second": t.failed_cascades_per_second,
                                       "capacity_bytes": t.capacity_bytes, "capacity_reason": t.capacity_reason,
                                       "read_bandwidth_bytes_per_second": t.read_bandwidth_bytes_per_second,
                                       "write_bandwidth_bytes_per_second": t.write_bandwidth_bytes_per_second,
                                       "read_seconds_per_second": t.read_seconds_per_second,
                                       "write_seconds_per_second": t.write_seconds_per_second,
                                       "transfer_time_reason": t.transfer_time_reason,
                                       "critical_cached_to_prefill_ratio": t.critical_cached_to_prefill,
                                       "critical_reason": t.critical_reason,
                                       "lookup_seconds": t.lookup_seconds,
                                       "lookup_wait_seconds": t.lookup_wait_seconds,
                                       "lookup_reason": t.lookup_reason}
                              for t in w.offload_tiers}}


def _tier_energy_json(w: WindowFigures) -> dict:
    """Each offload tier's reloads priced against a recompute (methods.md s14), by cached-token source."""
    if not w.offload_tier_energy:
        return {}
    return {"offload_tier_energy": {t.tier: {
        "scope": t.scope or None, "tokens_per_second": t.tokens_per_second,
        "cached_to_prefill_ratio": t.cached_to_prefill,
        "bytes_per_token": t.bytes_per_token, "hop_joules_per_token": t.hop_joules_per_token,
        "reload_joules_per_token": t.reload_joules_per_token, "breakeven_ratio": t.breakeven_ratio,
        "gpu_saved_watts": t.gpu_saved_watts, "reload_watts": t.reload_watts, "saved_watts": t.saved_watts,
        "hop_source": t.hop_source, "price_reason": t.price_reason} for t in w.offload_tier_energy}}


def _buffer_json(v: ServerFigures) -> dict:
    b = v.buffer
    return {} if b is None else {"offload_buffer": {
        "undersized": b.undersized, "recommended_bytes": b.recommended_bytes, "recommended_gib": b.recommended_gib,
        "store_failures": b.store_failures, "residency_seconds": b.residency_seconds,
        "write_bytes_per_second": b.write_bytes_per_second, "p99_tool_latency_seconds": b.p99_tool_latency_seconds,
        "headroom": b.headroom, "residency_target_seconds": b.residency_target_seconds,
        "residency_target_source": b.residency_target_source, "recommended_words": b.recommended_words,
        "recommended_note": b.recommended_note, "size_setting": b.size_setting}}


def _collapse_json(v: ServerFigures) -> dict:
    return {} if v.collapse is None else {"collapse": {**v.collapse.as_status(), "window": v.collapse_window}}


def _savings_json(w: WindowFigures) -> dict:
    savings = {sv.baseline: {"dE": sv.energy_saving, "dE_stderr": sv.energy_saving_stderr, "verdict": sv.verdict,
                             "answer": sv.answer,
                             "windows": sv.windows, "reference_windows": sv.reference_windows, "note": sv.note,
                             "dTPS": sv.throughput_gain, "dTPS_stderr": sv.throughput_gain_stderr}
               for sv in w.savings}
    return {"energy_saving": savings} if savings else {}


def _kappa_json(v: ServerFigures) -> dict:
    k = v.kappa
    return {"kappa": {"critical": k.critical, "breakeven_tokens_gqa": k.breakeven_tokens_gqa,
                      "breakeven_tokens_mha": k.breakeven_tokens_mha, "model": k.model_source,
                      "hardware": k.hardware_source}}


def _advice_json(v: ServerFigures) -> dict:
    return {"advice": [{"kind": a.kind, "severity": a.severity, "text": a.text, "evidence": dict(a.evidence)}
                       for a in v.advice]}


TRAFFIC_SEC = Section(name=TRAFFIC_SECTION, metrics=(*TRAFFIC, *TIERED, *TIER_TIMES), blocks=(
    window_block(("offload_tiers",),
                 ("kvwatt_offload_tier_write_bytes_per_second", "kvwatt_offload_tier_read_bytes_per_second",
                  "kvwatt_offload_tier_chunk_hit_ratio", "kvwatt_offload_tier_job_failures",
                  "kvwatt_offload_tier_residency_seconds", "kvwatt_offload_tier_undersized",
                  "kvwatt_offload_tier_dropped_stores_per_second", "kvwatt_offload_tier_dropped_blocks_per_second",
                  "kvwatt_offload_tier_failed_promotions_per_second", "kvwatt_offload_tier_failed_cascades_per_second",
                  *(m.name for m in TIER_TIMES)),
                 _tiers_json),
    window_block(("offload_tier_energy",),
                 ("kvwatt_offload_tier_reload_joules_per_token", "kvwatt_offload_tier_breakeven_ratio",
                  "kvwatt_offload_tier_cached_to_prefill_ratio", "kvwatt_offload_tier_reload_watts",
                  "kvwatt_offload_tier_saved_watts"),
                 _tier_energy_json),
))
BUFFER_SEC = Section(name=BUFFER_SECTION, metrics=BUFFER, blocks=(
    server_block(("offload_buffer",), ("kvwatt_offload_buffer_undersized", "kvwatt_offload_recommended_buffer_bytes",
                                       "kvwatt_offload_buffer_residency_target_seconds"), _buffer_json),
))
COLLAPSE_SEC = Section(name=COLLAPSE_SECTION, metrics=COLLAPSE, blocks=(
    server_block(("signatures",), ("kvwatt_collapse_signature",), lambda v: {"signatures": v.signatures}),
    server_block(("collapse",),
                 ("kvwatt_collapse_signature", "kvwatt_collapse_condition_set", "kvwatt_collapse_condition"),
                 _collapse_json),
))
ECONOMICS_SEC = Section(name=ECONOMICS_SECTION, metrics=ECONOMICS, blocks=(
    window_block(("energy_saving",),
                 ("kvwatt_energy_saving_ratio", "kvwatt_energy_saving_stderr_ratio", "kvwatt_throughput_gain_ratio",
                  "kvwatt_throughput_gain_stderr_ratio", "kvwatt_comparison_windows"), _savings_json),
    server_block(("kappa",), ("kvwatt_critical_cached_to_prefill_ratio", "kvwatt_recompute_breakeven_tokens"),
                 _kappa_json),
))
# "what do I do?" (exporter.model.advice): JSON only, no series of its own; it rests on other sections' figures
ADVICE_SEC = Section(name="Advice", metrics=(), blocks=(
    server_block(("recommendations",),  # the advice's words
                 ("kvwatt_offload_buffer_undersized", "kvwatt_offload_recommended_buffer_bytes",
                  "kvwatt_collapse_signature"), lambda v: {"recommendations": list(v.recommendations)}),
    server_block(("advice",),  # each check's answer with the numbers it rests on
                 ("kvwatt_source_up", "kvwatt_kv_pressure_regime_above", "kvwatt_collapse_signature",
                  "kvwatt_offload_buffer_undersized", "kvwatt_offload_recommended_buffer_bytes"), _advice_json),
))
