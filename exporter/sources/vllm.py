"""The vLLM engine adapter: one exposition -> an EngineReading (sources/endpoint.py fetches it).

Server-wide figures sum counters over ``engine`` (data-parallel ranks), and the reading keeps each engine's
own counters too, so the store sees one engine reset or vanish (store.engine_deltas); KV usage takes the
highest engine, because the fullest engine is the one that preempts. Out-of-range values (negative, NaN,
infinite, KV usage outside [0, 1]) are refused per family: unknown, and the status says "out_of_range".
Names and renames from vLLM 0.11 to 0.33 are handled here and nowhere else (docs/vllm-metrics.md).

``VllmAdapter.read(text)`` parses only the families ``extract`` uses (``NEEDED_FAMILIES``, located by one
regex scan: exporter/expfmt.parse_families); ``extract(parse(text))`` -- the general parser -- gives exactly
the same reading (tests/test_engine_adapter.py holds them equal). ``EngineSource.read`` runs the decoding in
a worker thread so a large exposition never stalls the event loop.
"""

from __future__ import annotations

import logging

from exporter import rules
from exporter.samples import EngineInfo, EngineReading
from exporter.sources.engine import (
    KV_POOL_USAGE,
    OFFLOAD_BUFFER,
    VLLM_ORDER,
    SourceError,
    capabilities_of,
    labelled_key,
    register,
)
from exporter.sources.expfmt import Exposition, Labels, parse_families, process_start_time
from exporter.sources.ranges import GIB, MAX_VALUE, OUT_OF_RANGE
from exporter.sources.vllm_names import RENAMES

__all__ = ["COUNTERS", "DEPRECATED_OFFLOAD", "GAUGES_SUM", "GIB", "MAX_VALUE", "NEEDED_FAMILIES", "OUT_OF_RANGE",
           "SourceError", "VllmAdapter", "extract"]
log = logging.getLogger("kvwatt.vllm")

# counter key -> (series base name without "vllm:" and "_total", label filter)
COUNTERS: dict[str, tuple[str, dict[str, str]]] = {
    "generation_tokens": ("generation_tokens", {}),
    "prompt_tokens": ("prompt_tokens", {}),
    "preemptions": ("num_preemptions", {}),
    "prompt_local_compute": ("prompt_tokens_by_source", {"source": "local_compute"}),
    "prompt_local_cache_hit": ("prompt_tokens_by_source", {"source": "local_cache_hit"}),
    "prompt_external_kv_transfer": ("prompt_tokens_by_source", {"source": "external_kv_transfer"}),
    "prefix_queries": ("prefix_cache_queries", {}),
    "prefix_hits": ("prefix_cache_hits", {}),
    "external_prefix_queries": ("external_prefix_cache_queries", {}),
    "external_prefix_hits": ("external_prefix_cache_hits", {}),
    "flops": ("estimated_flops_per_gpu", {}),
    # --enable-mfu-metrics (0.17+): from the tokens actually scheduled, so re-prefill after preemption is in it
    # (the token counters count first prefills only): the recomputation no token counter shows (methods.md s4)
    "engine_write_bytes": ("estimated_write_bytes_per_gpu", {}),
    "offload_store_bytes": ("kv_offload_store_bytes", {}),
    "offload_load_bytes": ("kv_offload_load_bytes", {}),
    "offload_allocation_failures": ("kv_offload_allocation_failure", {}),
    "offload_stores_skipped": ("kv_offload_stores_skipped", {}),
    # the histogram's _count: one observation per engine step (0.23+), vLLM's own "engine steps/s" panel
    "engine_steps": ("iteration_tokens_total_count", {}),
    "prompt_cached_device": ("prompt_tokens_cached_by_source", {"source": "device"}),  # 0.32+
    "prompt_cached_host": ("prompt_tokens_cached_by_source", {"source": "host"}),
    "prompt_cached_disk": ("prompt_tokens_cached_by_source", {"source": "disk"}),
    "prompt_cached_p2p": ("prompt_tokens_cached_by_source", {"source": "p2p"}),
    "prompt_cached_external": ("prompt_tokens_cached_by_source", {"source": "external_unspecified"}),
    "preemption_hist_count": ("request_num_preemptions_count", {}),  # 0.30+
    "preemption_hist_sum": ("request_num_preemptions_sum", {}),
    # SimpleCPUOffloadConnector (0.32, vllm/v1/simple_kv_offload/metrics.py): stores dropped, the pool full
    "offload_stores_dropped_full": ("simple_kv_offload_save_outcomes", {"outcome": "dropped_cpu_full"}),
    # its loads, in blocks (tokens once the block size is known, combine.py): the finished ones, label phase
    # = issued | completed at 222790a9; 0.32.0 counted finished loads without the label (DEPRECATED_OFFLOAD)
    "offload_load_blocks": ("simple_kv_offload_load_blocks", {"phase": "completed"}),
    # KV-block residency (--kv-cache-metrics, 0.11+): observed at eviction, for the sampled blocks only
    "kv_idle_before_evict_hist_count": ("kv_block_idle_before_evict_seconds_count", {}),
    "kv_idle_before_evict_hist_sum": ("kv_block_idle_before_evict_seconds_sum", {}),
    "kv_reuse_gap_hist_count": ("kv_block_reuse_gap_seconds_count", {}),
    "kv_reuse_gap_hist_sum": ("kv_block_reuse_gap_seconds_sum", {}),
    "kv_lifetime_hist_count": ("kv_block_lifetime_seconds_count", {}),
    "kv_lifetime_hist_sum": ("kv_block_lifetime_seconds_sum", {}),
}
# labelled counter prefix -> (series base, label, {label value: replacement}); engine.LABELLED_COUNTER_KEYS
LABELLED: dict[str, tuple[str, str]] = {
    "preemption_hist_le": ("request_num_preemptions_bucket", "le"),  # 0.30+; buckets 1,2,3,4,5,10,20 in 0.32
    "admission_rejections": ("admission_rejections", "reason"),  # 0.32+ (no engine label)
    # vLLM PR #58037 (open): reason = kv_full | priority | prefix_cache_reset, summing to num_preemptions
    "preemptions_by_reason": ("num_preemptions_by_reason", "reason"),
    # tiering (0.28+), label tier = "<index>:<type>" ("0:primary", "1:fs"): vllm/v1/kv_offload/tiering/spec.py
    "tier_write_bytes": ("kv_offload_tiering_write_bytes", "tier"),
    "tier_read_bytes": ("kv_offload_tiering_read_bytes", "tier"),
    # seconds of transfer, summed over the tier's finished jobs (per job: its I/O tasks' wall time, not its queue
    # wait; parallel jobs add up): vllm/v1/kv_offload/tiering/metrics.py, fs/thread_pool.py (0.32)
    "tier_read_seconds": ("kv_offload_tiering_read_time", "tier"),
    "tier_write_seconds": ("kv_offload_tiering_write_time", "tier"),
    # per-chunk lookups (histograms, seconds): the scheduler's blocking time in a lookup that resolved (one per
    # resolved lookup), and the wait of a lookup that first returned "retry" until it resolved (the fs tier's
    # asynchronous lookup: a new prompt waits a step for it); vllm/v1/kv_offload/tiering/metrics.py
    "tier_lookup_seconds_sum": ("kv_offload_tiering_lookup_sync_delay_seconds_sum", "tier"),
    "tier_lookup_seconds_count": ("kv_offload_tiering_lookup_sync_delay_seconds_count", "tier"),
    "tier_lookup_wait_seconds_sum": ("kv_offload_tiering_lookup_async_delay_seconds_sum", "tier"),
    "tier_lookup_wait_seconds_count": ("kv_offload_tiering_lookup_async_delay_seconds_count", "tier"),
    "tier_chunk_queries": ("kv_offload_tiering_chunk_queries", "tier"),
    "tier_chunk_hits": ("kv_offload_tiering_chunk_hits", "tier"),
    # stores (cascade jobs) and their blocks a secondary tier's back-pressure detector dropped (0.32: EMA policy)
    "tier_dropped_stores": ("kv_offload_tiering_backpressure_stores_dropped", "tier"),
    "tier_dropped_blocks": ("kv_offload_tiering_backpressure_blocks_dropped", "tier"),
    # failed promotion (secondary -> CPU tier) and cascade (CPU -> secondary) jobs apart (issue 41: failures as
    # figures); HELP lines and no sample until the first failure
    "tier_promotion_failures": ("kv_offload_tiering_promotion_job_failures", "tier"),
    "tier_cascade_failures": ("kv_offload_tiering_cascade_job_failures", "tier"),
    # KV-block residency histograms' buckets (--kv-cache-metrics, 0.11+): sampled evicted blocks, cumulative
    "kv_idle_before_evict_hist_le": ("kv_block_idle_before_evict_seconds_bucket", "le"),
    "kv_reuse_gap_hist_le": ("kv_block_reuse_gap_seconds_bucket", "le"),
    "kv_lifetime_hist_le": ("kv_block_lifetime_seconds_bucket", "le"),
}
# labelled request gauges (summed over ranks), read like LABELLED
LABELLED_GAUGES: dict[str, tuple[str, str]] = {
    # 0.32 with a connector that loads KV (kv_role kv_consumer / kv_both): vllm/v1/metrics/loggers.py
    "kv_fetch": ("num_requests_kv_fetch_by_stage", "stage"),
}
# several series summed into one labelled counter: promotion (read) and cascade (write) job failures
LABELLED_SUMS: dict[str, tuple[tuple[str, ...], str]] = {
    "tier_job_failures": (("kv_offload_tiering_promotion_job_failures", "kv_offload_tiering_cascade_job_failures"),
                          "tier"),
}
# deprecated spelling (0.16 -> now), used only when the flat 0.24+ series is absent
DEPRECATED_OFFLOAD = {
    "offload_store_bytes": ("kv_offload_total_bytes", {"transfer_type": "GPU_to_CPU"}),
    "offload_load_bytes": ("kv_offload_total_bytes", {"transfer_type": "CPU_to_GPU"}),
    "offload_load_blocks": ("simple_kv_offload_load_blocks", {"phase": ""}),  # 0.32.0: no phase label
}
GAUGES_SUM = {
    "running": ("num_requests_running", {}),
    "waiting": ("num_requests_waiting", {}),
    "waiting_capacity": ("num_requests_waiting_by_reason", {"reason": "capacity"}),
    "waiting_deferred": ("num_requests_waiting_by_reason", {"reason": "deferred"}),
}
INFO_BASES = ("kv_cache_usage_perc", "cache_config_info", "kv_offload_config_info")


def _needed() -> tuple[frozenset[str], frozenset[str]]:
    bases = {base for base, _ in (*COUNTERS.values(), *DEPRECATED_OFFLOAD.values(), *GAUGES_SUM.values(),
                                  *LABELLED.values(), *LABELLED_GAUGES.values())}
    bases |= set(INFO_BASES) | {b for group, _ in LABELLED_SUMS.values() for b in group}
    spellings = bases | {old for old, new in RENAMES.items() if new in bases}
    families = {f"vllm:{b}{suffix}" for b in spellings for suffix in ("", "_total")}
    return frozenset(bases), frozenset(families)


# NEEDED_BASES: the canonical base names extract() reads; NEEDED_FAMILIES: every wire name that maps onto
# one of them (with and without _total, old names before a rename). Nothing else is parsed on the fast path.
NEEDED_BASES, NEEDED_FAMILIES = _needed()


def _canonical(exp: Exposition) -> dict[str, dict]:
    """Series keyed by base name: strip 'vllm:', '_total'; apply renames. Newer names win over old ones.

    Only the bases extract() reads are kept, so a full parse and a parse of NEEDED_FAMILIES give the same."""
    out: dict[str, dict] = {}
    from_old_name: set[str] = set()
    for name, samples in exp.series.items():
        if not name.startswith("vllm:"):
            continue
        base = name[5:].removesuffix("_total")
        renamed = base in RENAMES
        if renamed:
            base = RENAMES[base]
        if base not in NEEDED_BASES:
            continue
        if renamed:
            if base not in out:
                out[base] = samples
                from_old_name.add(base)
        elif base not in out or base in from_old_name:  # the current name wins over an old one
            out[base] = samples
            from_old_name.discard(base)
        # else: both "x" and "x_total" on the wire, the same counter: keep the first
    return out


def _out_of_range(pairs: list[tuple[Labels, float]], base: str, high: float) -> str:
    """'' when every sample lies in [0, high], else a detail naming the first that does not (NaN never does)."""
    for labels, v in pairs:
        if not 0.0 <= v <= high:
            return _detail(base, labels, v, high)
    return ""


def _detail(base: str, labels: Labels, v: float, high: float) -> str:
    shown = ",".join(f'{k}="{val}"' for k, val in labels)
    return f"{base}{{{shown}}} = {v!r} outside [0, {high:g}]"  # the base name: no vllm:, no _total


def _checked_sums(series: dict, base: str, match: dict[str, str], key: str,
                  rejected: dict[str, str]) -> dict[str, float] | None:
    """Per data-parallel engine (the ``engine`` label, "" without one), the sum of a counter's or request
    gauge's samples matching ``match``; None when there is none, or (``rejected[key]`` then says why) when a
    sample or the server-wide sum is out of range: negative, NaN, infinite or above MAX_VALUE. One pass
    over the samples: this runs for every family at every read."""
    samples = series.get(base)
    if samples is None:
        return None
    sums: dict[str, float] = {}
    for labels, v in samples.items():
        lab = dict(labels)
        if match and any(lab.get(k, "") != want for k, want in match.items()):  # absent = "" (Prometheus)
            continue
        if not 0.0 <= v <= MAX_VALUE:  # NaN fails too
            rejected[key] = _detail(base, labels, v, MAX_VALUE)
            return None
        engine = lab.get("engine", "")
        sums[engine] = sums.get(engine, 0.0) + v
    if not sums:
        return None
    total = sum(sums.values())
    if total > MAX_VALUE:
        rejected[key] = f"{base} summed over engines = {total!r} above {MAX_VALUE:g}"
        return None
    return sums


def extract(exp: Exposition, process_start: float | None = None) -> EngineReading:
    """The reading from a parsed exposition (a full ``parse`` or ``parse_families(text, NEEDED_FAMILIES)``).

    Out-of-range values are refused per family (docs/architecture.md "Data-parallel engines and value
    ranges"): the family is left out of the reading (unknown, not zero) and named in ``rejected``."""
    series = _canonical(exp)
    rejected: dict[str, str] = {}
    spellings: dict[str, str] = {}
    counters, by_engine = _counters(series, rejected, spellings)
    gauges = _gauges(series, rejected)
    info = _info(series, counters, process_start, rejected)
    return EngineReading(counters=counters, gauges=gauges, info=info,
                         capabilities=_capabilities(counters, gauges, info, rejected), engine="vllm",
                         engine_counters=by_engine, rejected=rejected, spellings=spellings)


def _counters(series: dict, rejected: dict[str, str],
              spellings: dict[str, str] | None = None) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """(server-wide counters, the same per engine); ``spellings`` gets, per key with a deprecated spelling, the
    series it was read from."""
    counters: dict[str, float] = {}
    by_engine: dict[str, dict[str, float]] = {}
    for key, (base, match) in COUNTERS.items():
        sums = _checked_sums(series, base, match, key, rejected)
        spelled = (base, match)
        if sums is None and key in DEPRECATED_OFFLOAD and key not in rejected:
            sums = _checked_sums(series, *DEPRECATED_OFFLOAD[key], key, rejected)
            spelled = DEPRECATED_OFFLOAD[key]
        if sums is None:
            continue
        if key in DEPRECATED_OFFLOAD and spellings is not None:
            spellings[key] = _series_words(*spelled)
        counters[key] = sum(sums.values())
        for engine, v in sums.items():
            by_engine.setdefault(engine, {})[key] = v
    for prefix, (base, label) in LABELLED.items():
        _labelled_sums(series, (base,), label, prefix, rejected, counters, by_engine)
    for prefix, (bases, label) in LABELLED_SUMS.items():
        _labelled_sums(series, bases, label, prefix, rejected, counters, by_engine)
    return counters, by_engine


def _series_words(base: str, match: dict[str, str]) -> str:
    """vllm:kv_offload_total_bytes{transfer_type="GPU_to_CPU"}: a counter's series, as the log names it."""
    labels = ",".join(f'{k}="{v}"' for k, v in match.items())
    return f"vllm:{base}" + (f"{{{labels}}}" if labels else "")


def _labelled_sums(series: dict, bases: tuple[str, ...], label: str, prefix: str, rejected: dict[str, str],
                       counters: dict[str, float], by_engine: dict[str, dict[str, float]]) -> None:
    """One counter (or request gauge) per value of ``label``, summed over ``bases`` and engines, keyed
    "<prefix>@<value>" into ``counters``, per engine into ``by_engine``. A sample out of range makes the
    whole family unknown (``rejected[prefix]``), like any counter."""
    sums: dict[str, dict[str, float]] = {}  # engine -> key -> sum
    for base in bases:
        for labels, v in (series.get(base) or {}).items():
            lab = dict(labels)
            if label not in lab:
                continue
            if not 0.0 <= v <= MAX_VALUE:
                rejected[prefix] = _detail(base, labels, v, MAX_VALUE)
                return
            per = sums.setdefault(lab.get("engine", ""), {})
            key = labelled_key(prefix, lab[label])
            per[key] = per.get(key, 0.0) + v
    totals: dict[str, float] = {}
    for per in sums.values():
        for key, v in per.items():
            totals[key] = totals.get(key, 0.0) + v
    if any(v > MAX_VALUE for v in totals.values()):
        rejected[prefix] = f"{bases[0]} summed over engines above {MAX_VALUE:g}"
        return
    counters.update(totals)
    for engine, per in sums.items():
        by_engine.setdefault(engine, {}).update(per)


def _gauges(series: dict, rejected: dict[str, str]) -> dict[str, float]:
    """Request gauges summed over engines; KV usage from the fullest engine, a fraction in [0, 1]
    (vllm-metrics.md): 1.7 or -0.5 is no reading, the gauge is unknown."""
    gauges: dict[str, float] = {}
    for key, (base, match) in GAUGES_SUM.items():
        sums = _checked_sums(series, base, match, key, rejected)
        if sums is not None:
            gauges[key] = sum(sums.values())
    for prefix, (base, label) in LABELLED_GAUGES.items():
        _labelled_sums(series, (base,), label, prefix, rejected, gauges, {})
    usage = list(series.get("kv_cache_usage_perc", {}).items())
    if usage:
        bad = _out_of_range(usage, "kv_cache_usage_perc", 1.0)
        if bad:
            rejected["kv_usage"] = bad
        else:
            gauges["kv_usage"] = max(v for _, v in usage)
            pools = {dict(labels).get("engine", ""): v for labels, v in usage}
            if len(pools) > 1:  # data-parallel engines: one KV pool each (engine_specs.py does the same)
                gauges.update({labelled_key(KV_POOL_USAGE, engine): v for engine, v in pools.items()})
    return gauges


def _capabilities(counters: dict[str, float], gauges: dict[str, float], info: EngineInfo,
                  rejected: dict[str, str]) -> frozenset[str]:
    """A refused family was on the wire: the figures resting on it can exist for this server (unknown now)."""
    caps = capabilities_of(counters, {**gauges, **dict.fromkeys(rejected, 0.0)}, info)
    return caps | {OFFLOAD_BUFFER} if "offload_buffer_bytes" in rejected else caps


def _info(series: dict, counters: dict[str, float], process_start: float | None,
          rejected: dict[str, str]) -> EngineInfo:
    model = ""
    for samples in series.values():
        for labels in samples:
            model = dict(labels).get("model_name", "")
            if model:
                break
        if model:
            break
    enabled, buffer_bytes, backend, blocks, block_size = _offload_from_cache_config(series.get("cache_config_info"),
                                                                                    rejected)
    cfg = series.get("kv_offload_config_info")
    if cfg:
        sizes = _buffer_sizes(cfg, rejected)
        if sizes:
            buffer_bytes, enabled = sum(sizes), True
    if "offload_buffer_bytes" in rejected:
        buffer_bytes = None  # one engine's size refused: the server's buffer is unknown, not a part of it
        enabled = True if enabled else None
    if not enabled and any(k in counters for k in ("offload_store_bytes", "offload_load_bytes")):
        enabled = True  # a connector is emitting offload series
    return EngineInfo(model_name=model, offload_enabled=enabled, offload_buffer_bytes=buffer_bytes,
                    offload_backend=backend if enabled else ("none" if enabled is False else ""),
                    num_gpu_blocks=blocks, block_size=block_size,
                    has_token_sources="prompt_local_compute" in counters, has_mfu="flops" in counters,
                    process_start_time_seconds=process_start,
                    kv_capacity_tokens=_kv_capacity_tokens(series.get("cache_config_info"), rejected))


def _kv_capacity_tokens(samples: dict | None, rejected: dict[str, str]) -> float | None:
    """vllm:cache_config_info kv_cache_size_tokens (0.32+; "None" for attention-free models): the largest
    engine's, like num_gpu_blocks (the config is already the server's). Out of range: refused, unknown."""
    sizes = []
    for labels in samples or {}:
        text = dict(labels).get("kv_cache_size_tokens")
        v = _float(text)
        if v is None:
            continue
        if not 0.0 < v <= MAX_VALUE:
            rejected["kv_capacity_tokens"] = f'vllm:cache_config_info kv_cache_size_tokens="{text}"'
            return None
        sizes.append(v)
    return max(sizes) if sizes else None


def _buffer_sizes(samples: dict, rejected: dict[str, str]) -> list[float]:
    """cpu_kv_cache_size_bytes of each vllm:kv_offload_config_info sample (bytes: 0, or each and their sum within
    rules.OFFLOAD_BUFFER_MIN_BYTES..OFFLOAD_BUFFER_MAX_BYTES)."""
    sizes = []
    for labels in samples:
        text = dict(labels).get("cpu_kv_cache_size_bytes")
        v = _float(text)
        if v is None:
            continue
        if not (v == 0.0 or rules.offload_buffer_size_ok(v)) or (sum(sizes) + v > 0.0 and
                                                                 not rules.offload_buffer_size_ok(sum(sizes) + v)):
            rejected["offload_buffer_bytes"] = f'vllm:kv_offload_config_info cpu_kv_cache_size_bytes="{text}"'
            return []
        sizes.append(v)
    return sizes


def _float(text: str | None) -> float | None:
    """The label value as a number (NaN and infinities included: the caller checks the range), None when it
    is not one (e.g. "None")."""
    try:
        return float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _offload_from_cache_config(samples: dict | None, rejected: dict[str, str]):
    """vllm:cache_config_info: offloading is on when kv_offloading_size != "None" (GiB).

    kv_offloading_backend reads "native" even when off, so it is only meaningful with a size. A size, block
    count or block size out of range (negative, infinite, NaN; a size outside rules.OFFLOAD_BUFFER_MIN_BYTES..
    OFFLOAD_BUFFER_MAX_BYTES, alone or summed over engines) is refused: that field is unknown."""
    if not samples:
        return None, None, "", None, None
    enabled, buffer_bytes, backend, blocks, block_size = False, None, "", 0.0, None
    for labels in samples:
        lab = dict(labels)
        size = _float(lab.get("kv_offloading_size"))
        if size is not None and size != 0:
            size_bytes = size * GIB
            if not rules.offload_buffer_size_ok(size_bytes) or \
                    not rules.offload_buffer_size_ok((buffer_bytes or 0.0) + size_bytes):
                shown = lab["kv_offloading_size"]
                rejected["offload_buffer_bytes"] = f'vllm:cache_config_info kv_offloading_size="{shown}"'
            else:
                enabled = True
                buffer_bytes = (buffer_bytes or 0.0) + size_bytes
                backend = lab.get("kv_offloading_backend", "native") or "native"
        nb = _float(lab.get("num_gpu_blocks"))
        if nb is not None and not 0.0 <= nb <= MAX_VALUE:
            rejected["num_gpu_blocks"] = f'vllm:cache_config_info num_gpu_blocks="{lab["num_gpu_blocks"]}"'
        elif nb is not None:
            blocks = max(blocks, nb)  # already summed over DP engines
        bs = _float(lab.get("block_size"))
        if bs is not None and not 0.0 < bs <= MAX_VALUE:
            rejected["block_size"] = f'vllm:cache_config_info block_size="{lab["block_size"]}"'
        elif bs is not None:
            block_size = bs
    if "num_gpu_blocks" in rejected:
        blocks = 0.0
    if "block_size" in rejected:
        block_size = None
    return enabled, buffer_bytes, backend, (blocks or None), block_size


_process_start = process_start_time  # the old private name, still imported by tests


class VllmAdapter:
    """The vLLM engine adapter (exporter/sources/engine.py): only NEEDED_FAMILIES are parsed."""

    name = "vllm"

    def detect(self, text: str) -> bool:
        return text.startswith("vllm:") or "\nvllm:" in text

    def read(self, text: str, problems: list[str] | None = None) -> EngineReading:
        exp = parse_families(text, NEEDED_FAMILIES)
        if not exp.series:
            detail = f"{exp.errors} malformed lines" if exp.errors else "no usable vllm: series in the exposition"
            raise SourceError("parse_error", detail)
        if exp.errors and problems is not None:
            problems.append(f"parse_error: {exp.errors} bad lines skipped")
        return extract(exp, process_start_time(text))


register(VllmAdapter(), order=VLLM_ORDER)
