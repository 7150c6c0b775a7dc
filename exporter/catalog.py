"""Every series kvwatt exports, in one place.

The collector can only emit names listed here (``family()`` looks them up), the README's metric reference is
checked against this list by a test, and the alert/dashboard tests refuse a query that names a ``kvwatt_``
series missing from it. To find where a metric is computed, grep its name: the ``where`` field points at the
function. Formulas cite ../shared/docs/methods.md sections (copied into docs/methods.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MetricDef:
    name: str
    type: str  # "gauge" | "counter" | "info"
    labels: tuple[str, ...]
    help: str
    where: str  # module.function that computes it
    section: str


def _m(section, name, type_, labels, help_, where):
    return MetricDef(name, type_, tuple(labels), help_, where, section)


_H = "Sources"
_E = "Energy"
_K = "KV pressure and recomputation"
_O = "Offloading"

METRICS: tuple[MetricDef, ...] = (
    # --- health of the sources -------------------------------------------------------------------------
    _m(_H, "kvwatt_source_up", "gauge", ["source", "server"],
       "1 if the last read of this source succeeded, 0 if not (see kvwatt_source_info for the reason). "
       "server is empty for host-wide sources (nvml, rapl).", "collector.render_status"),
    _m(_H, "kvwatt_source_info", "info", ["source", "server", "state", "reason"],
       "Why a source is down or degraded (permission, absent, timeout, parse error, gpu lost); value 1.",
       "collector.render_status"),
    _m(_H, "kvwatt_sample_duration_seconds", "gauge", ["source", "server"],
       "How long the last read of this source took.", "collector.render_status"),
    _m(_H, "kvwatt_server_info", "info", ["server", "url", "model_name", "offload_backend"],
       "What kvwatt knows of each watched vLLM server (from vllm:cache_config_info); value 1.",
       "collector.render_server"),
    _m(_H, "kvwatt_window_covered_seconds", "gauge", ["server", "window"],
       "Seconds of gap-free samples the window actually holds (less than the window right after start "
       "or after a server outage).", "derive.window.covered_seconds"),
    # --- energy ---------------------------------------------------------------------------------------
    _m(_E, "kvwatt_gpu_energy_joules_total", "counter", ["gpu", "uuid"],
       "GPU energy since kvwatt started watching it (NVML total-energy counter, or integrated instant "
       "power where the counter is missing). rate() gives watts.", "energy.runtime.device_series"),
    _m(_E, "kvwatt_gpu_energy_method_info", "info", ["gpu", "uuid", "method"],
       "How that GPU's energy is measured: counter or power_integration; value 1.", "energy.runtime.device_series"),
    _m(_E, "kvwatt_gpu_power_watts", "gauge", ["gpu", "uuid"],
       "Current board power (NVML power usage; a 1 s trailing average on Ampere and newer).",
       "energy.runtime.device_series"),
    _m(_E, "kvwatt_host_energy_joules_total", "counter", ["zone", "domain"],
       "RAPL energy of a package or dram zone since kvwatt started watching it, wrap-corrected.",
       "energy.runtime.device_series"),
    _m(_E, "kvwatt_gpu_idle_power_watts", "gauge", ["gpu", "uuid"],
       "Idle baseline P_idle of this GPU (learned, measured or configured).", "energy.runtime.device_series"),
    _m(_E, "kvwatt_host_idle_power_watts", "gauge", ["zone", "domain"],
       "Idle baseline P_idle of this RAPL zone.", "energy.runtime.device_series"),
    _m(_E, "kvwatt_idle_baseline_age_seconds", "gauge", ["device"],
       "Seconds since that device's idle baseline was measured.", "energy.runtime.device_series"),
    _m(_E, "kvwatt_marginal_energy_per_token_joules", "gauge", ["server", "scope", "window"],
       "(E - P_idle*dt) / generated tokens over the window (methods.md s1). Absent without >= 30 s of load "
       "or without tokens.", "derive.energy.per_token"),
    _m(_E, "kvwatt_energy_per_token_joules", "gauge", ["server", "scope", "window"],
       "E / generated tokens over the window, no idle subtraction. Absent without enough load.",
       "derive.energy.per_token"),
    _m(_E, "kvwatt_prompt_energy_per_token_joules", "gauge", ["server", "source", "window"],
       "Attribution model, not a measurement: marginal GPU joules per prompt token by token source, "
       "pricing reloaded tokens at the configured load/compute cost ratio (docs/energy.md).",
       "derive.energy.prompt_attribution"),
    # --- KV pressure and recomputation ------------------------------------------------------------------
    _m(_K, "kvwatt_kv_cache_usage_p95_ratio", "gauge", ["server", "window"],
       "95th percentile of vllm:kv_cache_usage_perc over the window from kvwatt's dense samples "
       "(methods.md s3); a 15 s scrape misses the peaks.", "derive.pressure.kv_usage_quantile"),
    _m(_K, "kvwatt_kv_cache_usage_max_ratio", "gauge", ["server", "window"],
       "Maximum of vllm:kv_cache_usage_perc over the window from dense samples.",
       "derive.pressure.kv_usage_quantile"),
    _m(_K, "kvwatt_kv_pressure_threshold_ratio", "gauge", ["server"],
       "The configured KV-pressure regime threshold on p95 usage (default 0.90, methods.md s3).",
       "collector.render_server"),
    _m(_K, "kvwatt_kv_pressure_above_threshold", "gauge", ["server", "window"],
       "1 when the window's p95 KV usage is above the threshold: offloading pays in this regime.",
       "derive.pressure.above_threshold"),
    _m(_K, "kvwatt_preemptions_per_minute", "gauge", ["server", "window"],
       "Preemptions per minute over the window, from vllm:num_preemptions_total deltas.",
       "derive.pressure.rate_per_second"),
    _m(_K, "kvwatt_preemption_onset", "gauge", ["server", "window"],
       "1 when preemptions are sustained at >= the onset rate (default 0.5/min, methods.md s3).",
       "derive.pressure.preemption_onset"),
    _m(_K, "kvwatt_generation_tokens_per_second", "gauge", ["server", "window"],
       "Generated tokens per second over the window.", "derive.pressure.rate_per_second"),
    _m(_K, "kvwatt_prompt_token_share_ratio", "gauge", ["server", "source", "window"],
       "Share of prompt tokens by source (local_compute, local_cache_hit, external_kv_transfer) over the "
       "window; sums to 1. vLLM < 0.16: estimated from prefix-cache counters. First prefills only: "
       "re-prefill after preemption is not counted (see kvwatt_estimated_flops_per_generated_token).",
       "derive.recompute.token_shares"),
    _m(_K, "kvwatt_recompute_tax_ratio", "gauge", ["server", "window"],
       "local_compute share minus this server's low-pressure reference share (methods.md s4).",
       "derive.recompute.recompute_tax"),
    _m(_K, "kvwatt_recompute_reference_share_ratio", "gauge", ["server"],
       "The low-pressure local_compute reference share the tax is measured against (learned or configured).",
       "derive.recompute.ReferenceShare"),
    _m(_K, "kvwatt_estimated_flops_per_second", "gauge", ["server", "window"],
       "FLOP/s vLLM estimated for the tokens it actually scheduled (MFU counters, --enable-mfu-metrics); "
       "includes re-prefill after preemption, which the token counters miss.",
       "derive.recompute.mfu_view"),
    _m(_K, "kvwatt_estimated_flops_per_generated_token", "gauge", ["server", "window"],
       "Estimated FLOPs per generated token over the window (MFU counters): rises with every kind of "
       "recomputation, preemption re-prefill included.", "derive.recompute.mfu_view"),
    # --- offloading ------------------------------------------------------------------------------------
    _m(_O, "kvwatt_offload_enabled", "gauge", ["server"],
       "1 when the server offloads KV to host memory (from vllm:cache_config_info or offload series).",
       "sources.vllm.extract"),
    _m(_O, "kvwatt_offload_buffer_bytes", "gauge", ["server"],
       "Configured host offload buffer (kv_offloading_size GiB, or kv_offload_config_info on 0.33).",
       "sources.vllm.extract"),
    _m(_O, "kvwatt_offload_write_bytes_per_second", "gauge", ["server", "window"],
       "Store rate GPU -> offload tier over the window.", "derive.offload.transfer_rates"),
    _m(_O, "kvwatt_offload_read_bytes_per_second", "gauge", ["server", "window"],
       "Load rate offload tier -> GPU over the window.", "derive.offload.transfer_rates"),
    _m(_O, "kvwatt_offload_buffer_residency_seconds", "gauge", ["server", "window"],
       "Buffer bytes / write rate: how long an offloaded block survives (methods.md s6).",
       "derive.offload.residency"),
    _m(_O, "kvwatt_offload_buffer_undersized", "gauge", ["server"],
       "1 when residency is below the configured p99 tool-call latency, or stores fail.",
       "derive.offload.undersized"),
    _m(_O, "kvwatt_offload_recommended_buffer_bytes", "gauge", ["server"],
       "Buffer size that keeps residency above the p99 tool-call latency with the configured headroom.",
       "derive.offload.recommended_buffer"),
    _m(_O, "kvwatt_collapse_signature", "gauge", ["server"],
       "1 while the throughput-collapse signature holds (methods.md s5): all conditions below at once.",
       "derive.collapse.evaluate"),
    _m(_O, "kvwatt_collapse_condition", "gauge", ["server", "condition"],
       "Each collapse condition on its own: offload_enabled, zero_preemptions, throughput_collapsed, "
       "power_near_idle, requests_pending.", "derive.collapse.evaluate"),
    _m(_O, "kvwatt_energy_saving_ratio", "gauge", ["server", "baseline", "window"],
       "dE as a ratio (0.26 = 26 % less energy per token with offloading, methods.md s2). "
       "baseline=estimated is a model estimate, see docs.", "derive.economics.saving"),
    _m(_O, "kvwatt_energy_saving_stderr_ratio", "gauge", ["server", "baseline", "window"],
       "Standard error of dE (delta method, methods.md s2), where there are repeats.", "derive.economics.saving"),
    _m(_O, "kvwatt_throughput_gain_ratio", "gauge", ["server", "baseline", "window"],
       "dTPS as a ratio (methods.md s2).", "derive.economics.gain"),
    _m(_O, "kvwatt_throughput_gain_stderr_ratio", "gauge", ["server", "baseline", "window"],
       "Standard error of dTPS, where there are repeats.", "derive.economics.gain"),
    _m(_O, "kvwatt_comparison_windows", "gauge", ["server", "baseline", "window"],
       "Number of windows the dE/dTPS comparison rests on.", "derive.economics.window_stats"),
    _m(_O, "kvwatt_cached_to_prefill_ratio", "gauge", ["server", "window"],
       "kappa observed: external_kv_transfer / local_compute prompt tokens over the window (methods.md s7).",
       "derive.kappa.observed"),
    _m(_O, "kvwatt_critical_cached_to_prefill_ratio", "gauge", ["server"],
       "kappa_crit from model and hardware parameters (roofline form, methods.md s7).",
       "derive.kappa.critical"),
    _m(_O, "kvwatt_recompute_breakeven_tokens", "gauge", ["server"],
       "Sequence length above which reloading KV beats recomputing it (Tetris form with GQA width, "
       "methods.md s7).", "derive.kappa.breakeven_tokens"),
)

BY_NAME: dict[str, MetricDef] = {m.name: m for m in METRICS}


def get(name: str) -> MetricDef:
    return BY_NAME[name]


def exported_series_names() -> set[str]:
    """Names as they appear on the wire (counters also carry no extra suffix: we name them *_total)."""
    return set(BY_NAME)
